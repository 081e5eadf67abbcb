"""Runs the suite's entries (up to ``parallel`` flodl_exp runs in flight), each an MLflow child of the parent run.

* flodl_exp runs go through :func:`flodl_exp.jobs.launcher.launch` in this process (the app's config composed
  from ``conf/`` with the run's overrides, exactly as ``python -m flodl_exp`` would), then ``wait()``;
* ``ddp`` (and ``solo=torch``) go through :func:`flodl_exp.bench.ddp.run_torch` on the same composed
  ``experiment`` node, so both sides train the same preset with the same overrides.

Every child carries the tags ``bench.model``, ``bench.run``, ``bench.kind`` and ``job_dir`` (where its
``events.jsonl`` and ``timeline/timeline.json`` are), which is all the report needs besides the metrics.
A failed run is recorded (FAILED, with its reason) and the suite goes on.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.bench.suite import BenchConfig, RunSpec, experiment_overrides
from flodl_exp.package_conf import CONF_DIR as CONF


@dataclass
class RunRecord:
    spec: RunSpec
    run_id: Optional[str]
    status: str
    dir: str
    process_s: float
    """Wall of the whole run as the bench saw it (start-up, training, eval, teardown)."""
    error: str = ""


@contextlib.contextmanager
def app_hydra() -> Iterator[None]:
    """Hydra initialised on the main app's ``conf/`` for :func:`compose_app`, whatever Hydra app (the bench's)
    is running; the previous global state is restored on exit."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF, version_base="1.3", job_name="flodl_exp"):
            yield
    finally:
        restore_gh_from_backup(backup)


def compose_app(overrides: list[str]) -> Any:
    """The main app's config for ``overrides`` (``python -m flodl_exp <overrides>`` would run this)."""
    from hydra import compose

    from flodl_exp.config import register_configs

    register_configs()
    with app_hydra():
        return compose(config_name="config", overrides=overrides)


def _store_overrides(cfg: BenchConfig, spec: RunSpec, out: str) -> list[str]:
    t = cfg.tracking
    ovr = [f"tracking.experiment_name={t.experiment_name}", f"tracking.run_name=bench/{spec.model}/{spec.name}",
           f"run.job_root={os.path.join(out, 'runs', spec.model, spec.name)}", "run.progress=off",
           f"run.timeout_min={max(1, math.ceil(cfg.run_timeout_s / 60) + 1)}", f"seed={cfg.seed}"]
    if t.uri:
        ovr.append(f"tracking.uri={t.uri}")
    if t.artifact_location:
        ovr.append(f"tracking.artifact_location={t.artifact_location}")
    return ovr


def flodl_overrides(cfg: BenchConfig, spec: RunSpec, out: str) -> list[str]:
    return [*experiment_overrides(cfg, spec.model), *spec.overrides, *cfg.run_overrides, *_store_overrides(cfg, spec, out)]


def _tag(c: Any, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    c.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def bench_tags(spec: RunSpec, parent_id: str) -> dict[str, str]:
    return {"bench.model": spec.model, "bench.run": spec.name, "bench.kind": spec.kind, "bench.parent": parent_id}


@dataclass
class Pending:
    """A flodl_exp run in flight (``launch`` returned; the job trains in its own processes)."""

    spec: RunSpec
    handle: Any
    t0: float
    deadline: float

    def done(self) -> bool:
        return bool(self.handle.done()) or time.monotonic() > self.deadline


def start_flodl(cfg: BenchConfig, spec: RunSpec, parent_id: str, out: str) -> Pending:
    from flodl_exp.jobs.launcher import launch

    t0 = time.monotonic()
    app_cfg = compose_app(flodl_overrides(cfg, spec, out))
    handle = launch(app_cfg, root=os.getcwd(), parent_run_id=parent_id)
    _tag(handle.client(), handle.run_id, bench_tags(spec, parent_id))  # the handle holds the store's credentials
    return Pending(spec, handle, t0, t0 + cfg.run_timeout_s)


def finish_flodl(p: Pending, timeout_s: float) -> RunRecord:
    """End a run that is done (or past its time: then it is cancelled, KILLED)."""
    from flodl_exp.jobs.launcher import RunFailed

    h = p.handle
    if not h.done():
        h.shutdown()
        return RunRecord(p.spec, h.run_id, "KILLED", h.job_dir, time.monotonic() - p.t0,
                         f"past run_timeout_s={timeout_s:g}: cancelled")
    try:
        h.wait()
        status, err = "FINISHED", ""
    except RunFailed as e:
        status, err = "FAILED", str(e)
    return RunRecord(p.spec, h.run_id, status, h.job_dir, time.monotonic() - p.t0, err)


def run_torch_entry(cfg: BenchConfig, spec: RunSpec, parent_id: str, out: str) -> RunRecord:
    from omegaconf import OmegaConf

    from flodl_exp.bench.ddp import run_torch
    from flodl_exp.tracking import resolve_tracking

    t0 = time.monotonic()
    app_cfg = compose_app(experiment_overrides(cfg, spec.model))
    exp = OmegaConf.to_container(app_cfg.experiment, resolve=True)
    assert isinstance(exp, dict)
    uri, art = resolve_tracking(_tracking_node(cfg), os.getcwd())
    run_dir = os.path.join(out, "runs", spec.model, spec.name)
    res = run_torch(exp=exp, rank_speeds=spec.speeds, seed=cfg.seed, lr_scale_ratio=cfg.lr_scale_ratio,
                    sleep_basis=cfg.ddp_sleep_basis, out=run_dir, tracking_uri=uri,
                    experiment_name=cfg.tracking.experiment_name, artifact_location=art,
                    run_name=f"bench/{spec.model}/{spec.name}", parent_run_id=parent_id,
                    tags={**bench_tags(spec, parent_id), "job_dir": run_dir}, start_method=cfg.ddp_start_method,
                    timeout_s=cfg.run_timeout_s)
    return RunRecord(spec, res.get("run_id"), str(res.get("status", "FAILED")), run_dir, time.monotonic() - t0,
                     str(res.get("failure") or ""))


def _tracking_node(cfg: BenchConfig) -> Any:
    """The bench's tracking section in the shape ``tracking.resolve_tracking`` reads."""
    from types import SimpleNamespace

    t = cfg.tracking
    return SimpleNamespace(uri=t.uri, artifact_location=t.artifact_location, experiment_name=t.experiment_name)


def _failed(spec: RunSpec, t0: float, e: Exception) -> RunRecord:
    return RunRecord(spec, None, "FAILED", "", time.monotonic() - t0, f"{type(e).__name__}: {e}")


def run_all(cfg: BenchConfig, specs: list[RunSpec], parent_id: str, out: str,
            report: Callable[[int, RunRecord], None] = lambda i, r: None) -> list[RunRecord]:
    """Every spec, in order, with at most ``cfg.parallel`` flodl_exp runs in flight (with more than one, torch
    runs train in this process meanwhile; with one, nothing overlaps). A run that raises or fails is a FAILED
    record and the others still run. Records come back in the plan's order; ``report(i, record)`` is called as
    each one ends."""
    records: dict[int, RunRecord] = {}
    pending: dict[int, Pending] = {}

    def settle(block: bool) -> None:
        while pending:
            done = [i for i, p in pending.items() if p.done()]
            for i in done:
                p = pending.pop(i)
                try:
                    records[i] = finish_flodl(p, cfg.run_timeout_s)
                except Exception as e:  # the store or the job folder failed under us: recorded, go on
                    records[i] = _failed(p.spec, p.t0, e)
                report(i, records[i])
            if not block or done:
                return
            time.sleep(0.1)

    for i, spec in enumerate(specs):
        t0 = time.monotonic()
        if spec.kind == "flodl":
            while len(pending) >= max(1, cfg.parallel):
                settle(block=True)
            try:
                pending[i] = start_flodl(cfg, spec, parent_id, out)
            except Exception as e:  # a config or launch error of one run
                records[i] = _failed(spec, t0, e)
                report(i, records[i])
        else:
            while cfg.parallel <= 1 and pending:  # one run on the machine at a time: the torch run waits too
                settle(block=True)
            try:
                records[i] = run_torch_entry(cfg, spec, parent_id, out)
            except Exception as e:
                records[i] = _failed(spec, t0, e)
            report(i, records[i])
            settle(block=False)
    while pending:
        settle(block=True)
    return [records[i] for i in range(len(specs))]
