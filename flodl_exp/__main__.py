"""``python -m flodl_exp [overrides]``: the Hydra app (``-m`` for sweeps)."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Optional

import hydra
from omegaconf import DictConfig

from flodl_exp.config import ConfigError, register_configs
from flodl_exp.constants import PARENT_ENV

register_configs()


def _is_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    """One run; in an Optuna study (``hydra/sweeper=optuna``) it returns the trial's objective to the sweeper."""
    from flodl_exp.sweep import current_trial

    trial = current_trial()  # None unless this job is a trial of an Optuna study
    try:
        from flodl_exp.jobs.launcher import RunFailed, launch
        from flodl_exp.progress import follow, summary

        t0 = time.monotonic()
        multirun = _is_multirun()
        # own_sigint: Ctrl-C is the launcher's to answer (it cancels the whole job); the job's processes ignore it
        handle = launch(cfg, parent_run_id=os.environ.get(PARENT_ENV) if multirun else None, own_sigint=True)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        if _is_multirun():
            if trial is not None:  # refused before its run existed: a FAILED child run shows it under the study
                from flodl_exp.sweep import record_failed_trial

                record_failed_trial(cfg, os.environ.get(PARENT_ENV), trial, str(e))
            raise  # a failing job must not end the whole sweep (a study records a FAIL trial and goes on)
        sys.exit(2)
    except Exception as e:
        from flodl_exp.jobs.launcher import SubmitFailed

        if not isinstance(e, SubmitFailed):
            raise
        print(str(e), file=sys.stderr)  # one line: the scheduler's message and what to check (the run is FAILED)
        if _is_multirun():
            raise
        sys.exit(e.exit_code)
    print(f"MLflow run {handle.run_id}  job {handle.job_id}  folder {handle.job_dir}", flush=True)
    if trial is not None:
        from flodl_exp.sweep import tag_trial

        tag_trial(handle.client(), handle.run_id, trial, str(cfg.sweep.objective))
    if not cfg.run.wait:
        _detached(handle, time.monotonic() - t0)
        if not multirun:
            _leave(0)
        return None
    try:
        follow(handle, cfg.run.progress)
        result = handle.wait()
    except KeyboardInterrupt:
        _interrupted(handle, multirun)
    except RunFailed as e:
        # one line: the first cause in the user's terms; the framework's frames and the task's traceback only when
        # asked (run.verbose=true), the traceback file's path being in the line
        headline = getattr(e, "headline", None) or str(e)
        print(summary(handle, handle.result, time.monotonic() - t0, headline))
        if cfg.run.get("verbose", False):
            print(f"\n{e}", file=sys.stderr)
        print(f"\nrun failed:\n{headline}", file=sys.stderr)
        if multirun:
            raise  # Hydra records the failed job and goes on with the sweep
        _leave(1)
    print(summary(handle, result, time.monotonic() - t0))
    if not multirun:
        _leave(0)
    handle.wait_model()  # a sweep's next job starts after this one's model export, not beside it
    # a grid sweep's job returns None (Hydra's basic sweeper ignores it); a study's trial its objective
    return None if trial is None else _objective(handle, cfg, trial.number)


def _detached(handle: Any, submit_s: float) -> None:
    """run.wait=false: where the job is and how to follow it. The job ends the MLflow run itself (FINISHED /
    FAILED / KILLED; a time limit requeues)."""
    where = "SLURM job" if handle.on_slurm else "local job (controller pid)"
    print(f"submitted {where} {handle.job_id} in {submit_s:.1f}s; not waiting (run.wait=false)")
    for name, path in handle.log_paths().items():
        print(f"  {name:<13} {path}")
    if handle.on_slurm:
        print(f"  follow        squeue -j {handle.job_id}; tail -f {handle.log_paths()['coordinator']}")
        print(f"  cancel        scancel {handle.job_id}")
    print(f"  MLflow UI     mlflow ui --host 127.0.0.1 --backend-store-uri {handle.tracking_uri}", flush=True)


def _objective(handle: Any, cfg: DictConfig, number: int) -> float:
    """A finished trial's objective (the final value of ``sweep.objective`` in its run), for the Optuna sweeper.
    The metric missing raises ConfigError (one line): the trial fails, the study goes on."""
    from flodl_exp.sweep import finish_trial

    try:
        value = finish_trial(handle.client(), handle.run_id, str(cfg.sweep.objective))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        raise
    print(f"trial {number}: {cfg.sweep.objective} = {value:.6g} ({cfg.sweep.direction})", flush=True)
    return value


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
    flag would print Hydra's), anything else is the Hydra app, whose composition errors (a misspelt option, key or
    group, a value of the wrong type) end in one ``config error:`` line and exit 2 as the validation's do."""
    if sys.argv[1:2] in (["--version"], ["-V"]):
        from flodl_exp import __version__

        print(f"flodl_exp {__version__} (hydra-core {hydra.__version__}, python {sys.version.split()[0]})")
        return
    from flodl_exp.config_errors import one_line_config_errors

    with one_line_config_errors():
        main()


if __name__ == "__main__":
    cli()
