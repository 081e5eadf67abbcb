"""The launcher-to-process contract: :class:`JobSpec`, one JSON file per attempt in the job folder.

The launcher writes ``<job>/spec.json`` (0600, launcher.launch); every task reads it (``run_task(spec_path)``:
only the path travels in submitit's pickle), and so does task 0's coordinator
(``python -m flodl_exp.coordinator.main <spec.json> <host>``). A requeue writes ``spec.attempt<k>.json``: the same
spec with ``attempt`` + 1 and ``resume`` on the preemption bundle (jobs/job.py).

The JSON keys are the field names. An older job folder's spec reads: a missing ``shuffle_seed`` is the config's
``seed``, a missing ``attempt`` 0, missing ``import_paths`` none; :meth:`JobSpec.to_dict` writes what the
launcher always wrote (``attempt`` only once it is not 0).

No credentials: ``tracking_uri`` and every URI in ``config`` are redacted (``tracking.redact_uri``); the
tasks find the credentialed URI in their environment (``tracking.URI_ENV``). A spec holding a secret is refused
when it is built, so none reaches a file.

The MLflow run is created after the job is submitted (launcher.launch: the tasks start while the launcher imports
MLflow and creates it), so the submitted ``spec.json`` has ``run_id`` ``""``: the launcher publishes the id in
``<job>/run_id.json`` (:func:`publish_run_id`) as soon as the run exists, and whoever needs it (the coordinator's
MLflow sink, task 0's failure paths) reads it with :meth:`JobSpec.with_run_id`. A requeue's spec carries it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.bundle_meta import Resume
from flodl_exp.json_fields import FieldError, Fields
from flodl_exp.tracking import redact_uri

RUN_ID_FILE = "run_id.json"
"""``<job>/run_id.json``: ``{"run_id": ...}`` once the launcher created the MLflow run, ``{"error": ...}`` when it
could not (it then cancels the job)."""
RUN_ID_WAIT_S = 60.0
"""How long a reader waits for :data:`RUN_ID_FILE` by default (the launcher writes it within seconds of the
submission, before a local job's processes are up; a SLURM job starts later still)."""


class RunIdMissing(RuntimeError):
    """The launcher did not publish the MLflow run id (it failed to create the run, or died first)."""


@dataclass(frozen=True)
class JobSpec:
    """What every process of a job reads first (see the module docstring)."""

    config: dict[str, Any]
    """The resolved config (``OmegaConf.to_container(cfg, resolve=True)``), its URIs redacted."""
    run_id: str
    """The MLflow run every attempt logs into; ``""`` until the launcher publishes it (:meth:`with_run_id`)."""
    tracking_uri: str
    """The tracking store, redacted (the credentialed one is in the tasks' environment)."""
    job_dir: str
    checkpoint_stem: str
    """Where the final bundle goes (absolute)."""
    shuffle_seed: int
    """The permutation seed of every epoch (a resume must keep it)."""
    resume: Optional[Resume] = None
    """The bundle this attempt starts from (``checkpoint.resume_from``, or the preemption bundle of a requeue)."""
    import_paths: tuple[str, ...] = ()
    """Where the experiment's modules are imported from (the launch directory, then PYTHONPATH)."""
    cuda_visible_devices: Optional[str] = None
    """The launcher's ``CUDA_VISIBLE_DEVICES`` (local tasks restore it: submitit's local executor rewrites it)."""
    attempt: int = 0
    """0 for the submitted job; k for its k-th requeue."""

    def __post_init__(self) -> None:
        leak = _secret_in(self.tracking_uri, "tracking_uri") or _secret_in(self.config, "config")
        if leak:
            raise ValueError(f"job spec {leak} holds credentials: a spec is written to the job folder, so it carries "
                             "the redacted URI (tracking.redact_uri) and the tasks read the full one from their "
                             "environment")

    @property
    def experiment_loop(self) -> Optional[str]:
        """``experiment.loop``: the cooperative tier's loop (None: the managed tier)."""
        loop = (self.config.get("experiment") or {}).get("loop")
        return str(loop) if loop else None

    def with_run_id(self, timeout_s: float = RUN_ID_WAIT_S) -> JobSpec:
        """This spec with its MLflow run id: itself when it has one, else the id the launcher published in
        ``<job>/run_id.json``, waited for up to ``timeout_s``. :class:`RunIdMissing` when the launcher said it
        could not create the run, or did not publish in time."""
        if self.run_id:
            return self
        return dataclasses.replace(self, run_id=wait_run_id(self.job_dir, timeout_s))

    def requeued(self, resume: Resume) -> JobSpec:
        """The next attempt's spec: same run and job folder, resuming from ``resume``."""
        return dataclasses.replace(self, attempt=self.attempt + 1, resume=resume)

    @classmethod
    def from_dict(cls, d: Any) -> JobSpec:
        """The spec of a parsed spec.json; :class:`~flodl_exp.json_fields.FieldError` (one line naming the key)
        when a key is missing or its value does not fit."""
        f = Fields("job spec", d)
        config = f.obj("config")
        seed = f.opt_int("shuffle_seed", lo=-(2**63))
        if seed is None:  # specs written before shuffle_seed existed: the config's seed
            seed = Fields("job spec config", config).int_("seed", lo=-(2**63))
        resume = f.opt_obj("resume")
        try:
            parsed_resume = Resume.from_dict(resume) if resume is not None else None
        except FieldError as e:
            raise FieldError(f"job spec {e}") from None
        return cls(config=config, run_id=f.str_("run_id"), tracking_uri=f.str_("tracking_uri"), job_dir=f.str_("job_dir"),
                   checkpoint_stem=f.str_("checkpoint_stem"), shuffle_seed=seed, resume=parsed_resume,
                   import_paths=tuple(f.opt_list("import_paths", str, "a str") or ()),
                   cuda_visible_devices=f.opt_str("cuda_visible_devices"), attempt=f.int_("attempt", default=0))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of spec.json (the keys the launcher always wrote; ``attempt`` once it is not 0)."""
        out: dict[str, Any] = {
            "config": self.config, "run_id": self.run_id, "tracking_uri": self.tracking_uri, "job_dir": self.job_dir,
            "checkpoint_stem": self.checkpoint_stem, "shuffle_seed": self.shuffle_seed,
            "resume": self.resume.to_dict() if self.resume is not None else None,
            "import_paths": list(self.import_paths), "cuda_visible_devices": self.cuda_visible_devices}
        if self.attempt:
            out["attempt"] = self.attempt
        return out

    @classmethod
    def load(cls, path: str) -> JobSpec:
        """Read ``path``; ValueError (one line naming the file and the key) when it is not a job spec."""
        try:
            with open(path) as fh:
                raw = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable job spec ({e})") from None
        try:
            return cls.from_dict(raw)
        except FieldError as e:
            raise ValueError(f"{path}: {e}") from None


def publish_run_id(job_dir: str, run_id: Optional[str] = None, error: Optional[str] = None) -> None:
    """The launcher's side of :data:`RUN_ID_FILE`: the created run's id, or why there is none."""
    from flodl_exp.fsio import atomic_json

    atomic_json({"run_id": run_id} if run_id else {"error": str(error or "unknown")},
                os.path.join(job_dir, RUN_ID_FILE), mode=0o600)


def read_run_id(job_dir: str) -> Optional[str]:
    """The published run id (None: not yet); :class:`RunIdMissing` when the launcher published an error."""
    try:
        with open(os.path.join(job_dir, RUN_ID_FILE)) as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return None
    if isinstance(d, dict) and isinstance(d.get("run_id"), str) and d["run_id"]:
        return str(d["run_id"])
    raise RunIdMissing(f"the launcher could not create the MLflow run: {d.get('error') if isinstance(d, dict) else d}")


def wait_run_id(job_dir: str, timeout_s: float = RUN_ID_WAIT_S) -> str:
    """:func:`read_run_id`, polled until it answers or ``timeout_s`` passed (:class:`RunIdMissing`)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        run_id = read_run_id(job_dir)
        if run_id:
            return run_id
        if time.monotonic() >= deadline:
            raise RunIdMissing(f"no MLflow run id in {os.path.join(job_dir, RUN_ID_FILE)} after {timeout_s:.0f} s: "
                               "the launcher did not create the run (see its output)")
        time.sleep(0.05)


def _secret_in(v: Any, where: str) -> Optional[str]:
    """The first place under ``v`` holding a URI with a secret redact_uri would hide (None: none)."""
    if isinstance(v, str):
        return where if "://" in v and redact_uri(v) != v else None
    if isinstance(v, dict):
        return next((w for k, x in v.items() if (w := _secret_in(x, f"{where}.{k}"))), None)
    if isinstance(v, (list, tuple)):
        return next((w for i, x in enumerate(v) if (w := _secret_in(x, f"{where}[{i}]"))), None)
    return None
