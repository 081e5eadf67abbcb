"""A finished run's measured rig, and the simulator's prediction for it (issue 31, items 2 and 3).

Pure logic first, from plain values (the run's MLflow params, its per-epoch metric histories, its result.json):

* :func:`measured` -- what the run measured, defined as the simulator defines it (report.py): samples/s = trained
  samples / the training wall (the first epoch's start to the last epoch's aggregation, from the epochs' metric
  timestamps and the first ``epoch_time_s``), syncs = the reduces counted in the epochs, each rank's batch share,
  the mean sync ms.
* :func:`measured_rig` -- the rig the run ran on, as a :class:`SimulateConfig`: each rank's step time
  (``rank<r>/compute_only_ms`` over ``rank<r>/batches``, the simulated slowdown of ``cluster.rank_speeds`` in it) and
  its data wait (``rank<r>/data_starve_ms`` over its batches: starvation is kept apart from the step, the
  first batch's refill in it, so ``chunk_start_ms`` is 0); the data (``total_picks``, ``experiment.batch_size``, the
  epochs aggregated); the mode's knobs, guard, outer optimizer and seed from the params; the model's bytes when the
  caller knows them (the bundle's size). The link keeps the base config's values (conf/simulate/config.yaml) but for
  its fixed cost per reduce, fitted so that the simulated mean sync ms of the run's own mode equals the measured
  ``sync_ms_avg`` (:data:`CALIBRATION_ROUNDS` simulations at most, each adding what the last one missed).
* :func:`predict` -- one mode on a rig: ``predicted/samples_per_s``, ``predicted/syncs``, ``predicted/share.rank<r>``.
* :func:`prediction_metrics` -- the run's own mode predicted on its measured rig, with ``predicted/error_pct`` =
  100 (measured - predicted) / predicted samples/s.

Then the I/O edge: :func:`read_run` (MlflowClient reads, result.json from the job folder or the run's artifacts) and
:func:`log_prediction` (the launcher's hook once a run is FINISHED).

Not measured, so taken from the base config: the link's latency and bandwidth, the coordinator's averaging rate,
the per-batch message cost; the divergence the guard sees. Not modelled (as in the simulator): evals, checkpoints,
deaths, CPU contention between ranks sharing a host.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from typing import Any, Iterator, Mapping, Optional, Sequence

from flodl_exp.config import GuardConfig, ModeConfig, OuterConfig
from flodl_exp.policy.mode import known_modes, variant_name, variant_of
from flodl_exp.simulate.topology import SimulateConfig, _preset, measured_rig_config

History = Mapping[str, Sequence[tuple[int, float, int]]]
"""metric key -> its points ``(step, value, timestamp_ms)`` as MLflow holds them (step = epoch)."""

PREFIX = "predicted/"
RANK_KEYS = ("batches", "compute_only_ms", "data_starve_ms")
RUN_KEYS = ("samples", "epoch_time_s", "syncs", "sync_ms_avg")
CALIBRATION_ROUNDS = 5
"""At most this many simulations of the run's mode fit the link's fixed cost (each adds what the simulated mean sync
ms misses: the anchor and the reduces' waits move with it, so one correction is not always enough)."""
CALIBRATION_TOLERANCE = 0.02
"""The fit stops once the simulated mean sync ms is within this fraction of the measured one."""
_RANK = re.compile(r"^rank(\d+)/batches$")


class NotReplayable(ValueError):
    """The run cannot be replayed (no measurements, world size 1, ...): one line saying why."""


# -- plain values -----------------------------------------------------------------------
def param(params: Mapping[str, str], key: str, default: Any = None) -> Any:
    """An MLflow param back as a value (params are strings: ``None``, ``True``, ``0.5``, ``[1.0, 0.33]``)."""
    if key not in params:
        return default
    s = str(params[key])
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s


def per_epoch(history: History, key: str) -> dict[int, float]:
    """``key``'s value per epoch (the last point of each step: a resumed run logs an epoch again)."""
    return {int(step): float(value) for step, value, _ in sorted(history.get(key, ()), key=lambda p: (p[0], p[2]))}


def world_size_of(history: History) -> int:
    ranks = [int(m.group(1)) for k in history if (m := _RANK.match(k))]
    return max(ranks) + 1 if ranks else 0


def measured(history: History) -> dict[str, float]:
    """What the run measured: ``samples_per_s``, ``wall_s``, ``syncs``, ``sync_ms``, ``share.rank<r>``,
    ``step_ms.rank<r>``, ``data_ms.rank<r>``, ``epochs``, ``samples`` and ``world_size``. Raises
    :class:`NotReplayable` when the history holds no epoch."""
    walls = per_epoch(history, "epoch_time_s")
    samples = per_epoch(history, "samples")
    epochs = sorted(set(walls) & set(samples))
    if not epochs:
        raise NotReplayable("the run has no epoch metrics (epoch_time_s, samples): nothing was measured")
    w = world_size_of(history)
    if w < 2:
        raise NotReplayable(f"the run's world size is {w}: a replay needs at least 2 ranks (one rank never syncs)")
    stamps = {int(s): ts for s, _, ts in history.get("epoch_time_s", ())}
    first, last = epochs[0], epochs[-1]
    if stamps.get(first) and stamps.get(last):  # the first epoch's start to the last one's aggregation
        wall = (stamps[last] - stamps[first]) / 1e3 + walls[first]
    else:  # no timestamps: the epochs' walls end to end
        wall = sum(walls[e] for e in epochs)
    total = sum(samples[e] for e in epochs)
    syncs = per_epoch(history, "syncs")
    sync_ms = per_epoch(history, "sync_ms_avg")
    n_sync = sum(syncs.get(e, 0.0) for e in epochs)
    out: dict[str, float] = {
        "samples_per_s": total / wall if wall > 0 else 0.0, "wall_s": wall, "samples": total,
        "syncs": float(round(n_sync)), "epochs": float(len(epochs)), "world_size": float(w),
        "sync_ms": sum(syncs.get(e, 0.0) * sync_ms.get(e, 0.0) for e in epochs) / n_sync if n_sync else 0.0,
    }
    batches = [sum(per_epoch(history, f"rank{r}/batches").values()) for r in range(w)]
    for r in range(w):
        if batches[r] <= 0:
            raise NotReplayable(f"rank {r} trained no batch: its step time was not measured")
        out[f"share.rank{r}"] = batches[r] / sum(batches)
        out[f"step_ms.rank{r}"] = sum(per_epoch(history, f"rank{r}/compute_only_ms").values()) / batches[r]
        out[f"data_ms.rank{r}"] = sum(per_epoch(history, f"rank{r}/data_starve_ms").values()) / batches[r]
    return out


def run_mode(params: Mapping[str, str]) -> str:
    """The run's mode as the simulator names it: ``cpu_cadence``, or ``cpu_cadence+overlap`` with ``mode.overlap``."""
    mode = str(param(params, "mode.name", "") or "")
    if mode not in known_modes():
        raise NotReplayable(f"the run's mode {mode or '(none)'!r} is not one the simulator runs "
                            f"({', '.join(known_modes())})")
    return variant_name(mode, param(params, "mode.overlap") is True)


def _fields(params: Mapping[str, str], prefix: str, schema: type) -> dict[str, Any]:
    return {f.name: param(params, f"{prefix}.{f.name}") for f in dataclasses.fields(schema)
            if f"{prefix}.{f.name}" in params}


def mode_knobs(params: Mapping[str, str]) -> dict[str, Any]:
    """The run's mode keys that differ from its preset (what the user set): applied to every simulated mode."""
    mode = variant_of(run_mode(params))[0]
    defaults = {f.name: f.default for f in dataclasses.fields(ModeConfig)}
    preset = {**defaults, **_preset(mode)}
    return {k: v for k, v in _fields(params, "mode", ModeConfig).items()
            if k not in ("name", "policy", "backend", "auto", "overlap") and v != preset.get(k)}


def measured_rig(params: Mapping[str, str], history: History, result: Optional[Mapping[str, Any]] = None, *,
                 base: Optional[SimulateConfig] = None, model_mb: Optional[float] = None,
                 calibrate: bool = True) -> SimulateConfig:
    """The rig ``history`` measured, as a SimulateConfig (modes = the run's own), on ``base`` (unset: the
    simulator's defaults) for what a run does not measure. ``calibrate``: fit ``link.collective_fixed_ms`` to the
    measured mean sync ms (a few simulations of the run's mode). Raises :class:`NotReplayable`."""
    m = measured(history)
    mode = run_mode(params)
    w = int(m["world_size"])
    batch = param(params, "experiment.batch_size")
    if not isinstance(batch, int) or batch < 1:
        raise NotReplayable(f"the run's experiment.batch_size param is {batch!r}: an integer >= 1 was expected")
    picks = (result or {}).get("total_picks")
    seed = param(params, "seed")
    cfg = measured_rig_config(
        base if base is not None else SimulateConfig(), f"measured {param(params, 'cluster.name', 'run')}",
        [m[f"step_ms.rank{r}"] for r in range(w)], [m[f"data_ms.rank{r}"] for r in range(w)],
        samples=int(picks) if isinstance(picks, int) and picks > 0 else int(m["samples"] / m["epochs"]),
        batch_size=batch, epochs=int(m["epochs"]), model_mb=model_mb, knobs=mode_knobs(params),
        guard=GuardConfig(**{**dataclasses.asdict(GuardConfig()), **_fields(params, "guard", GuardConfig)}),
        outer=OuterConfig(**{**dataclasses.asdict(OuterConfig()), **_fields(params, "outer", OuterConfig)}),
        seed=seed if isinstance(seed, int) else None)
    scheduler = param(params, "experiment.scheduler") or param(params, "experiment.scheduler._target_")
    cfg.lr_schedule = "cosine" if scheduler is not None and "cosine" in str(scheduler).lower() else "none"
    cfg.modes = [mode]
    if calibrate and m["syncs"] > 0 and m["sync_ms"] > 0:
        from flodl_exp.simulate.engine import simulate
        from flodl_exp.simulate.report import summarize
        from flodl_exp.simulate.topology import run_config

        run = run_config(cfg, mode, w)  # the link is not in it: one for every round
        fixed = 0.0
        for _ in range(CALIBRATION_ROUNDS):
            cfg.link.collective_fixed_ms = fixed
            miss = m["sync_ms"] - summarize(simulate(cfg, mode, run), 0)["sync_ms"]
            if abs(miss) <= CALIBRATION_TOLERANCE * m["sync_ms"] or (fixed == 0.0 and miss < 0):
                break
            fixed = max(0.0, fixed + miss)
        cfg.link.collective_fixed_ms = fixed
    return cfg


def predict(rig: SimulateConfig, mode: str) -> dict[str, float]:
    """``mode`` on ``rig``: ``predicted/samples_per_s``, ``predicted/syncs``, ``predicted/share.rank<r>`` (and
    ``predicted/wall_s``, ``predicted/sync_ms``)."""
    from flodl_exp.simulate.engine import simulate
    from flodl_exp.simulate.report import fastest_rank, summarize

    row = summarize(simulate(rig, mode), fastest_rank(rig))
    out = {f"{PREFIX}samples_per_s": float(row["samples_per_s"]), f"{PREFIX}syncs": float(row["syncs"]),
           f"{PREFIX}wall_s": float(row["wall_s"]), f"{PREFIX}sync_ms": float(row["sync_ms"])}
    out.update({f"{PREFIX}share.rank{r}": float(s) for r, s in enumerate(row["shares"])})
    return out


def error_pct(measured_sps: float, predicted_sps: float) -> float:
    """100 (measured - predicted) / predicted: positive when the run was faster than predicted."""
    return 100.0 * (measured_sps - predicted_sps) / predicted_sps if predicted_sps > 0 else float("nan")


def prediction_metrics(params: Mapping[str, str], history: History, result: Optional[Mapping[str, Any]] = None, *,
                       base: Optional[SimulateConfig] = None, model_mb: Optional[float] = None) -> dict[str, float]:
    """The run's own mode on its measured rig (:func:`predict`) and ``predicted/error_pct``."""
    rig = measured_rig(params, history, result, base=base, model_mb=model_mb)
    out = predict(rig, run_mode(params))
    out[f"{PREFIX}error_pct"] = error_pct(measured(history)["samples_per_s"], out[f"{PREFIX}samples_per_s"])
    return out


def base_config() -> SimulateConfig:
    """conf/simulate/config.yaml's values on the schema, without Hydra (the launcher runs inside a Hydra app)."""
    from omegaconf import OmegaConf

    from flodl_exp.package_conf import CONF_DIR

    raw = OmegaConf.load(os.path.join(CONF_DIR, "simulate", "config.yaml"))
    body = {k: v for k, v in OmegaConf.to_container(raw).items() if k not in ("defaults", "hydra")}  # type: ignore[union-attr]
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SimulateConfig), body))
    assert isinstance(obj, SimulateConfig)
    return obj


# -- the I/O edge: MLflow reads and writes -------------------------------------------------
def read_history(client: Any, run_id: str, keys: Sequence[str]) -> dict[str, list[tuple[int, float, int]]]:
    return {k: [(int(p.step), float(p.value), int(p.timestamp)) for p in client.get_metric_history(run_id, k)]
            for k in keys}


def read_run(client: Any, run_id: str, result: Optional[Mapping[str, Any]] = None
             ) -> tuple[dict[str, str], dict[str, list[tuple[int, float, int]]], Optional[dict[str, Any]],
                        Optional[float]]:
    """``(params, history, result, model_mb)`` of a run: its params, the metric histories a replay reads, its
    result.json (``result`` as given; else from the job folder its ``job_dir`` tag names, else its ``run/``
    artifact; None when neither is there) and its model's MB (the final bundle's size; None when not on disk)."""
    run = client.get_run(run_id)
    w = sum(1 for k in run.data.metrics if _RANK.match(k))
    keys = [k for k in (*RUN_KEYS, *(f"rank{r}/{x}" for r in range(w) for x in RANK_KEYS)) if k in run.data.metrics]
    history = read_history(client, run_id, keys)
    res: Optional[dict[str, Any]] = dict(result) if result is not None else None
    if res is None:
        res = _read_result(client, run_id, run.data.tags.get("job_dir"))
    model_mb = None
    stem = (res or {}).get("stem")
    if isinstance(stem, str) and os.path.isfile(f"{stem}.pt"):
        model_mb = os.path.getsize(f"{stem}.pt") / 1e6
    params = dict(run.data.params)
    adopt_auto_choice(params, run.data.tags.get("auto.choice"))
    return params, history, res, model_mb


def adopt_auto_choice(params: dict[str, str], chosen: Optional[str]) -> None:
    """mode=auto: the run trained in the mode it chose (its ``auto.choice`` tag, ``cpu_cadence+overlap`` included),
    not its params' fallback: ``params`` say so."""
    if chosen and "_" in chosen:
        name, overlap = variant_of(chosen)
        backend, policy = name.split("_", 1)
        params.update({"mode.name": name, "mode.backend": backend, "mode.policy": policy, "mode.overlap": str(overlap)})


def _read_result(client: Any, run_id: str, job_dir: Optional[str]) -> Optional[dict[str, Any]]:
    paths = [os.path.join(job_dir, "result.json")] if job_dir else []
    for path in paths:
        try:
            with open(path) as fh:
                return dict(json.load(fh))
        except (OSError, ValueError):
            pass
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            local = client.download_artifacts(run_id, "run/result.json", d)
            with open(local) as fh:
                return dict(json.load(fh))
    except Exception:  # no artifact (a run still going, a store without it): the picks come from the metrics
        return None


@contextlib.contextmanager
def quiet_core() -> Iterator[None]:
    """The simulated control core's log lines (``anchor 10 -> 20`` ...: logger ``flodl_exp.coordinator``) held back
    below ERROR: in the launching process they would read as the run's own, after its summary."""
    logger = logging.getLogger("flodl_exp.coordinator")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def log_prediction(client: Any, run_id: str, result: Optional[Mapping[str, Any]] = None) -> dict[str, float]:
    """Predict a finished run's own mode on its measured rig and log ``predicted/*`` (step = its last epoch);
    returns the metrics with ``measured/samples_per_s`` added (not logged: the run's own numbers are)."""
    from mlflow.entities import Metric

    params, history, res, model_mb = read_run(client, run_id, result)
    with quiet_core():
        out = prediction_metrics(params, history, res, base=base_config(), model_mb=model_mb)
    last = max(per_epoch(history, "epoch_time_s"))
    import time

    ts = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, ts, last) for k, v in out.items() if math.isfinite(v)])
    return {**out, "measured/samples_per_s": measured(history)["samples_per_s"]}
