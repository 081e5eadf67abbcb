"""``python -m flodl_exp [overrides]``: the Hydra app (``-m`` for sweeps)."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import hydra
from omegaconf import DictConfig

from .config import ConfigError, register_configs
from .constants import PARENT_ENV

register_configs()


def _is_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        from .jobs.launcher import RunFailed, launch
        from .progress import follow, summary

        t0 = time.monotonic()
        multirun = _is_multirun()
        # own_sigint: Ctrl-C is the launcher's to answer (it cancels the whole job); the job's processes ignore it
        handle = launch(cfg, parent_run_id=os.environ.get(PARENT_ENV) if multirun else None, own_sigint=True)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        if _is_multirun():
            raise  # a failing job must not end the whole sweep
        sys.exit(2)
    except Exception as e:
        from .jobs.launcher import SubmitFailed

        if not isinstance(e, SubmitFailed):
            raise
        print(str(e), file=sys.stderr)  # one line: the scheduler's message and what to check (the run is FAILED)
        if _is_multirun():
            raise
        sys.exit(e.exit_code)
    print(f"MLflow run {handle.run_id}  job {handle.job_id}  folder {handle.job_dir}", flush=True)
    if not cfg.run.wait:
        # Detached: the job ends the MLflow run itself (FINISHED / FAILED / KILLED; a time limit requeues).
        where = "SLURM job" if handle.on_slurm else "local job (controller pid)"
        print(f"submitted {where} {handle.job_id} in {time.monotonic() - t0:.1f}s; not waiting (run.wait=false)")
        for name, path in handle.log_paths().items():
            print(f"  {name:<13} {path}")
        if handle.on_slurm:
            print(f"  follow        squeue -j {handle.job_id}; tail -f {handle.log_paths()['coordinator']}")
            print(f"  cancel        scancel {handle.job_id}")
        print(f"  MLflow UI     mlflow ui --host 127.0.0.1 --backend-store-uri {handle.tracking_uri}", flush=True)
        if not multirun:
            _leave(0)
        return
    try:
        follow(handle, cfg.run.progress)
        result = handle.wait()
    except KeyboardInterrupt:
        _interrupted(handle, multirun)
    except RunFailed as e:
        print(summary(handle, handle.result, time.monotonic() - t0, str(e)))
        print(f"\nrun failed:\n{e}", file=sys.stderr)
        if multirun:
            raise  # Hydra records the failed job and goes on with the sweep
        _leave(1)
    print(summary(handle, result, time.monotonic() - t0))
    if not multirun:
        _leave(0)


def _interrupted(handle: Any, multirun: bool) -> None:
    """Ctrl-C: cancel the job (every process of it), mark the run KILLED, say so in one line, leave with 130.

    A second Ctrl-C is ignored from here: the cancel is bounded (seconds), and cutting it short would leave
    processes running and the MLflow run RUNNING."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"\ninterrupted: cancelling job {handle.job_id} ...", end="", file=sys.stderr, flush=True)
    try:
        status = handle.shutdown()
        print(f" done; MLflow run {handle.run_id} {status or 'ended'}", file=sys.stderr, flush=True)
    except Exception as e:
        print(f" failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}", file=sys.stderr, flush=True)
    if multirun:
        sys.exit(130)
    _leave(130)


def _leave(code: int) -> None:
    """End a single run's command now: the run is complete (the job is done, the MLflow run ended, the summary
    printed), and tearing down the mlflow/sqlalchemy modules at interpreter exit costs ~1.3 s. A sweep goes
    on to its next job instead."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The ``flodl-exp`` command and ``python -m flodl_exp``: ``--version`` says this package's version (Hydra's own
    flag would print Hydra's), anything else is the Hydra app."""
    if sys.argv[1:2] in (["--version"], ["-V"]):
        from . import __version__

        print(f"flodl_exp {__version__} (hydra-core {hydra.__version__}, python {sys.version.split()[0]})")
        return
    main()


if __name__ == "__main__":
    cli()
