"""Hydra sweeps as MLflow parent/child runs, and Optuna studies on top of them.

``python -m flodl_exp -m ...`` runs this callback (registered in conf/config.yaml):
on_multirun_start creates one parent run (tags: sweep dir, overrides) and
exports its id; every job's run is created as a child (``mlflow.parentRunId``);
on_multirun_end ends the parent (FAILED when a child failed) and logs the
mode-comparison report as its artifact. A single run stays top-level.

With ``hydra/sweeper=optuna`` the sweep is a study (docs/how-to/optuna.md): each job (a trial) returns the final
value of ``sweep.objective`` in its finished run to the sweeper (:func:`finish_trial`), its run is tagged with its
trial number and overrides, and the parent gets ``report/trials.md``, the trials ranked by that objective. A trial
that fails (its run FAILED, a config error, the metric missing) raises: the sweeper records it as a FAIL trial and,
``hydra.sweeper.max_failure_rate`` being 1.0 unless set, the study goes on.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from flodl_exp.config import DIRECTIONS, ConfigError
from flodl_exp.constants import PARENT_ENV
from flodl_exp.report import OBJECTIVE_METRIC, TRIAL_ERROR_TAG, TRIAL_OVERRIDES_TAG, TRIAL_TAG

log = logging.getLogger(__name__)

STUDY_FAILURE_RATE = 1.0
"""``hydra.sweeper.max_failure_rate`` of a study unless the command sets it: a failed trial never ends the study
(the plugin's own default, 0.0, ends it at the first batch with a failed trial)."""


# -- what kind of sweep ---------------------------------------------------------------------------------------
def is_study(sweeper: Any) -> bool:
    """The sweeper (``hydra.sweeper``) is Optuna's: each job is a trial that returns an objective."""
    try:
        target = sweeper.get("_target_") if sweeper is not None else None
    except Exception:
        return False
    return "optuna" in str(target or "").lower()


def redacted_overrides(overrides: Sequence[str]) -> list[str]:
    """Hydra overrides with a tracking URI's credentials replaced (what tags and reports may show)."""
    from flodl_exp.tracking import redact_uri

    out = []
    for o in overrides:
        key, sep, value = str(o).partition("=")
        out.append(f"{key}={redact_uri(value)}" if sep and key.lstrip("+~") == "tracking.uri" else str(o))
    return out


def swept_keys(overrides: Sequence[str]) -> list[str]:
    """The keys (or config groups) the overrides sweep: ``choice(...)``, ``interval(...)``, ``range(...)``, ``a,b``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys = []
    for o in overrides:
        try:
            parsed = parser.parse_override(str(o))
        except Exception:  # Hydra refused it already when it mattered; a ranking column is not worth a failure
            continue
        if parsed.is_sweep_override():
            keys.append(parsed.key_or_group)
    return list(dict.fromkeys(keys))


# -- before a study starts -------------------------------------------------------------------------------------
def _explicit(hydra_overrides: Sequence[str], key: str) -> Optional[str]:
    """The value the command gives ``key`` (``key=v``, ``+key=v``, ``++key=v``), None when it does not."""
    found = None
    for o in hydra_overrides:
        k, sep, v = str(o).partition("=")
        if sep and k.lstrip("+") == key:
            found = v
    return found


def prepare_study(config: DictConfig) -> None:
    """Check a study's settings and align the Optuna sweeper with them, before the sweeper is built from
    ``config.hydra.sweeper`` (Hydra calls on_multirun_start first). Raises ConfigError (one line).

    ``hydra.sweeper.direction`` follows ``sweep.direction`` (the plugin's default, minimize, would minimize an
    accuracy); set on the command line too, it must agree. ``hydra.sweeper.max_failure_rate`` becomes
    :data:`STUDY_FAILURE_RATE` unless the command sets it."""
    from omegaconf import open_dict, read_write

    direction = config.sweep.direction
    if direction not in DIRECTIONS:
        raise ConfigError(f"config error: sweep.direction={direction!r} is not allowed: one of {', '.join(DIRECTIONS)}")
    objective = config.sweep.objective
    if not isinstance(objective, str) or not objective.strip():
        raise ConfigError(f"config error: sweep.objective={objective!r} is not allowed: the name of a metric the run "
                          "logs (eval/accuracy, eval/loss, loss, ...)")
    if not config.run.wait:
        raise ConfigError("config error: run.wait=False is not allowed: true in an Optuna study (the sweeper needs each "
                          "trial's objective, read from its finished run)")
    hydra_overrides = list(config.hydra.overrides.hydra)
    given = _explicit(hydra_overrides, "hydra.sweeper.direction")
    if given is not None and given.strip() != direction:
        raise ConfigError(f"config error: hydra.sweeper.direction={given.strip()!r} is not allowed: {direction!r}, "
                          f"the value of sweep.direction (set sweep.direction={given.strip()} alone: the sweeper's "
                          "direction follows it)")
    current = config.hydra.sweeper.get("direction")
    if current is not None and not isinstance(current, (str, bytes)) and hasattr(current, "__len__"):
        raise ConfigError(f"config error: hydra.sweeper.direction={list(current)!r} is not allowed: one direction "
                          f"(a study optimizes the single metric sweep.objective={objective})")
    with read_write(config.hydra.sweeper), open_dict(config.hydra.sweeper):
        config.hydra.sweeper.direction = direction
        if _explicit(hydra_overrides, "hydra.sweeper.max_failure_rate") is None:
            config.hydra.sweeper.max_failure_rate = STUDY_FAILURE_RATE


# -- in a trial (the job, in the sweeper's process) ---------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """The job being run as a trial of a study: its number (``hydra.job.num``) and its overrides."""

    number: int
    overrides: tuple[str, ...]


def current_trial() -> Optional[Trial]:
    """The running job as a study's trial; None outside a multirun or under another sweeper (a grid)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or not is_study(hc.sweeper):
            return None
        return Trial(number=int(hc.job.num), overrides=tuple(redacted_overrides(list(hc.overrides.task))))
    except Exception:
        return None


def trial_tags(trial: Trial, objective: str) -> dict[str, str]:
    return {TRIAL_TAG: str(trial.number), TRIAL_OVERRIDES_TAG: " ".join(trial.overrides)[:5000],
            "sweep.objective": objective, "flodl.sweep": "trial"}


def tag_trial(client: Any, run_id: str, trial: Trial, objective: str) -> None:
    """Mark a trial's run with its number and overrides as soon as it exists (a crashed trial keeps them)."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in trial_tags(trial, objective).items()])


def record_failed_trial(cfg: Any, parent_run_id: Optional[str], trial: Trial, error: str) -> Optional[str]:
    """A FAILED child run for a trial refused before its run existed (a config error), so that every trial of
    the study shows under the parent; returns its id (None when the store could not take it: the error stands)."""
    from flodl_exp.tracking import create_run, end_run, resolve_tracking

    try:
        uri, art = resolve_tracking(cfg.tracking, os.getcwd())
        run_id = create_run(uri, cfg.tracking.experiment_name, art, f"trial {trial.number} (refused)", {},
                            trial_tags(trial, str(cfg.sweep.objective)), parent_run_id)
        end_run(uri, run_id, "FAILED", error=error)
        return run_id
    except Exception as e:
        log.warning("the failed trial %s has no MLflow run: %s", trial.number, e)
        return None


def _metric_names(metrics: Mapping[str, float], limit: int = 40) -> str:
    """The logged metric names for an error line, per-rank ones folded (``rank<n>/batch_share``)."""
    names = sorted({re.sub(r"^rank\d+/", "rank<n>/", k) for k in metrics})
    if not names:
        return "no metrics"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def objective_value(metrics: Mapping[str, float], key: str) -> float:
    """The final value of metric ``key`` among a finished run's metrics (MLflow keeps each metric's last value).
    Raises ConfigError naming the key and the metrics the run has."""
    if key not in metrics:
        raise ConfigError(f"config error: sweep.objective={key!r} is not allowed: a metric the finished run logged "
                          f"(it logged {_metric_names(metrics)})")
    return float(metrics[key])


def finish_trial(client: Any, run_id: str, objective: str) -> float:
    """A finished trial's objective: read from its run, logged on it as metric ``objective``; the metric missing
    is a ConfigError, also tagged on the run (``sweep.error``) for the ranking."""
    try:
        value = objective_value(client.get_run(run_id).data.metrics, objective)
    except ConfigError as e:
        client.set_tag(run_id, TRIAL_ERROR_TAG, str(e)[:5000])
        raise
    client.log_metric(run_id, OBJECTIVE_METRIC, value)
    return value


SWEEP_EXPERIMENT = "flodl_exp"
"""The MLflow experiment of a sweep over ``experiment`` when ``tracking.experiment_name`` is not set: its parent and
every child in one experiment (each child's default, its own experiment's name, would scatter them)."""


def pin_sweep_experiment(config: DictConfig) -> Optional[str]:
    """A sweep over ``experiment`` (or ``experiment.name``) without ``tracking.experiment_name`` set: pins it to
    :data:`SWEEP_EXPERIMENT` for the parent and, through the sweep's overrides, for every child; returns the
    override added (None: nothing swept there, or the name set by the command)."""
    from omegaconf import open_dict, read_write

    task = [str(o) for o in config.hydra.overrides.task]
    params = config.hydra.get("sweeper", {}).get("params") or {}
    given = {o.partition("=")[0].lstrip("+~") for o in task} | {str(k) for k in params}
    if "tracking.experiment_name" in given:
        return None
    swept = set(swept_keys([*(f"{k}={v}" for k, v in params.items()), *task]))
    if not swept & {"experiment", "experiment.name"}:
        return None
    override = f"tracking.experiment_name={SWEEP_EXPERIMENT}"
    with read_write(config), open_dict(config):
        config.hydra.overrides.task.append(override)
        config.tracking.experiment_name = SWEEP_EXPERIMENT
    return override


# -- the parent run -------------------------------------------------------------------------------------------
class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_id: str | None = None
        self.uri: str | None = None
        self.experiment: str | None = None
        self.study = False
        self.swept: list[str] = []
        self._config: Optional[DictConfig] = None
        self._tags: dict[str, str] = {}
        self._ended = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.study = is_study(config.hydra.get("sweeper"))
        tags = {}
        if self.study:
            try:
                prepare_study(config)
            except ConfigError as e:
                print(str(e), file=sys.stderr, flush=True)
                sys.exit(2)
            params = config.hydra.sweeper.get("params") or {}
            self.swept = swept_keys([*(f"{k}={v}" for k, v in params.items()), *config.hydra.overrides.task])
            tags = {"sweep.sweeper": "optuna", "sweep.objective": str(config.sweep.objective),
                    "sweep.direction": str(config.sweep.direction)}
        pin_sweep_experiment(config)
        self._config, self._tags = config, tags
        # The sweeper may raise past on_multirun_end (a failed grid job, a study whose trials all failed or
        # exceeded max_failure_rate, Ctrl-C): the parent is then ended at exit instead of left RUNNING.
        atexit.register(self._ended_early)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The parent run is made as the first job starts, once Hydra composed it: a sweep whose overrides do not
        compose (``mode=nccl_cadense``) ends with its one ``config error:`` line and leaves no empty parent run,
        no store and no "sweep report not written" line behind it."""
        if self.parent_id is None and self._config is not None:
            self._create_parent(self._config)

    def _create_parent(self, config: DictConfig) -> None:
        from flodl_exp.tracking import client, get_or_create_experiment, resolve_tracking

        uri, art = resolve_tracking(config.tracking, os.getcwd())
        c = client(uri)
        exp_id = get_or_create_experiment(c, config.tracking.experiment_name, art)
        overrides = redacted_overrides(list(config.hydra.overrides.task))
        run = c.create_run(exp_id, run_name=f"{'study' if self.study else 'sweep'} {' '.join(overrides)}"[:250],
                           tags={"sweep_dir": str(config.hydra.sweep.dir), "overrides": " ".join(overrides)[:5000],
                                 "flodl.sweep": "parent", **self._tags})
        self.parent_id, self.uri, self.experiment = run.info.run_id, uri, config.tracking.experiment_name
        os.environ[PARENT_ENV] = self.parent_id
        print(f"MLflow sweep parent run {self.parent_id}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config, early=False)

    def _ended_early(self) -> None:
        if self._config is not None:
            self._finish(self._config, early=True)

    def _finish(self, config: DictConfig, early: bool) -> None:
        if self._ended:
            return
        self._ended = True
        atexit.unregister(self._ended_early)
        os.environ.pop(PARENT_ENV, None)
        if not self.parent_id or self.uri is None or self.experiment is None:  # all three are set together
            return
        from flodl_exp.tracking import client

        c = client(self.uri)
        exp = c.get_experiment_by_name(self.experiment)  # None: deleted while the sweep ran (no children then)
        children = [] if exp is None else c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_id}'")
        failed = [r for r in children if r.info.status != "FINISHED"]
        out = os.path.join(str(config.hydra.sweep.dir), "report")
        try:
            from flodl_exp.report import generate_report

            path = generate_report(self.experiment, self.uri, out, parent_run_id=self.parent_id)
            print(f"sweep report: {path}", flush=True)
        except Exception as e:  # a report problem must not hide the sweep's result
            log.warning("sweep report not written: %s", e)
        complete = 0
        if self.study:
            complete = self._rank_trials(c, children, out, config)
        c.set_tag(self.parent_id, "children", str(len(children)))
        if early:
            c.set_tag(self.parent_id, "error", "the sweeper stopped before the end of the sweep (a failed job of a grid "
                      "sweep; a study whose trials all failed or exceeded hydra.sweeper.max_failure_rate; Ctrl-C): "
                      "see its output")
        if self.study:  # a study is done when a trial completed: its failed trials are part of the search
            status = "FINISHED" if complete and not early else "FAILED"
        else:
            status = "FAILED" if failed or not children or early else "FINISHED"
        if early and any(r.info.status == "KILLED" for r in children):
            status = "KILLED"
        c.set_terminated(self.parent_id, status=status)

    def _rank_trials(self, c: Any, children: Sequence[Any], out: str, config: DictConfig) -> int:
        """report/trials.md on the parent and on stdout; returns how many trials completed."""
        from flodl_exp.report import generate_trials_report

        objective, direction = str(config.sweep.objective), str(config.sweep.direction)
        try:
            path, ranked = generate_trials_report(c, str(self.parent_id), children, out, str(self.experiment),
                                                  objective, direction, self.swept)
        except Exception as e:
            log.warning("study ranking not written: %s", e)
            return 0
        with open(path) as fh:
            print(fh.read(), flush=True)
        print(f"study ranking: {path}", flush=True)
        done = [r for r in ranked if r.status == "COMPLETE"]
        c.set_tag(self.parent_id, "sweep.failed_trials", str(len(ranked) - len(done)))
        if done:
            c.set_tag(self.parent_id, "sweep.best_trial", str(done[0].trial))
            c.log_metric(self.parent_id, "best_objective", float(done[0].objective or 0.0))
        return len(done)
