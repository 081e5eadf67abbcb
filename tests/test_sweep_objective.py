"""Optuna studies without running one: the objective a trial returns, the study's direction, the trials' ranking.

The end-to-end study (a real 3-trial sweep) is tests/test_e2e_optuna.py."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from flodl_exp.config import Config, ConfigError
from flodl_exp.config_rules import validate
from flodl_exp.report import TrialRow, generate_trials_report, rank_trials, trial_row, trials_markdown
from flodl_exp.sweep import (
    STUDY_FAILURE_RATE,
    MlflowSweepCallback,
    Trial,
    current_trial,
    finish_trial,
    is_study,
    objective_value,
    prepare_study,
    redacted_overrides,
    swept_keys,
    trial_tags,
)

from conftest import ROOT, compose

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def sweep_config(*overrides: str) -> Any:
    """The config of ``python -m flodl_exp -m <overrides>`` as Hydra hands it to on_multirun_start (hydra node too)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from flodl_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        return hydra.compose_config("config", list(overrides), run_mode=RunMode.MULTIRUN)


# -- the objective ---------------------------------------------------------------------------------------------
def test_objective_is_the_final_value_of_the_metric():
    assert objective_value({"eval/accuracy": 0.91, "loss": 0.3}, "eval/accuracy") == pytest.approx(0.91)
    assert objective_value({"loss": 2}, "loss") == 2.0 and isinstance(objective_value({"loss": 2}, "loss"), float)


def test_a_missing_objective_is_one_line_naming_the_key_and_the_metrics_logged():
    metrics = {"eval/accuracy": 0.9, "loss": 0.2, **{f"rank{r}/batch_share": 0.5 for r in range(16)}}
    with pytest.raises(ConfigError) as e:
        objective_value(metrics, "eval/acc")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("config error: sweep.objective='eval/acc' is not allowed")
    assert "eval/accuracy" in msg and "loss" in msg
    assert "rank<n>/batch_share" in msg and "rank15" not in msg  # per-rank metrics folded: one name, not sixteen
    with pytest.raises(ConfigError, match="no metrics"):
        objective_value({}, "loss")


class FakeClient:
    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics
        self.tags: dict[str, str] = {}
        self.logged: dict[str, float] = {}
        self.artifacts: list[tuple[str, str, str]] = []

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(data=SimpleNamespace(metrics=dict(self.metrics)))

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags[key] = value

    def log_metric(self, run_id: str, key: str, value: float) -> None:
        self.logged[key] = value

    def log_artifact(self, run_id: str, path: str, artifact_path: str) -> None:
        self.artifacts.append((run_id, path, artifact_path))


def test_finish_trial_logs_the_objective_on_the_run_and_returns_it():
    c = FakeClient({"eval/loss": 0.25, "loss": 0.4})
    assert finish_trial(c, "r1", "eval/loss") == pytest.approx(0.25)
    assert c.logged == {"objective": pytest.approx(0.25)}


def test_finish_trial_without_the_metric_tags_the_run_and_raises():
    c = FakeClient({"loss": 0.4})
    with pytest.raises(ConfigError, match="sweep.objective='eval/accuracy'"):
        finish_trial(c, "r1", "eval/accuracy")
    assert c.tags["sweep.error"].startswith("config error: sweep.objective=") and not c.logged


def test_a_trial_is_tagged_with_its_number_and_overrides():
    tags = trial_tags(Trial(number=4, overrides=("mode=cpu_async", "experiment.optimizer.lr=0.003")), "eval/loss")
    assert tags == {"sweep.trial": "4", "sweep.overrides": "mode=cpu_async experiment.optimizer.lr=0.003",
                    "sweep.objective": "eval/loss", "flodl.sweep": "trial"}


def test_no_trial_outside_a_study():
    assert current_trial() is None  # no Hydra app running here


# -- the direction and the study's settings --------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["up", "Maximize", "max"])
def test_sweep_direction_is_validated_in_one_line(direction):
    cfg = compose([f"sweep.direction={direction}"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == f"config error: sweep.direction={direction!r} is not allowed: one of maximize, minimize"


def test_sweep_defaults_maximize_the_eval_accuracy_and_pass_validation():
    cfg = compose([])
    assert (cfg.sweep.objective, cfg.sweep.direction) == ("eval/accuracy", "maximize")
    validate(cfg)
    assert OmegaConf.structured(Config).sweep.direction == "maximize"
    cfg.sweep.objective = " "
    with pytest.raises(ConfigError, match=r"sweep.objective=' ' is not allowed"):
        validate(cfg)


def test_is_study_only_for_the_optuna_sweeper():
    assert is_study({"_target_": OPTUNA})
    assert not is_study({"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"})
    assert not is_study(None) and not is_study({})


def test_the_sweepers_direction_follows_sweep_direction():
    cfg = sweep_config("hydra/sweeper=optuna", "sweep.objective=eval/loss", "sweep.direction=minimize")
    prepare_study(cfg)
    assert cfg.hydra.sweeper.direction == "minimize"
    cfg = sweep_config("hydra/sweeper=optuna", "mode=choice(nccl_cadence,cpu_async)")
    assert cfg.hydra.sweeper.direction.name == "minimize"  # the plugin's default ...
    prepare_study(cfg)
    assert cfg.hydra.sweeper.direction == "maximize"  # ... replaced by ours (eval/accuracy: higher is better)
    assert cfg.hydra.sweeper.max_failure_rate == STUDY_FAILURE_RATE  # a failed trial does not end the study


def test_an_explicit_sweeper_direction_must_agree():
    prepare_study(sweep_config("hydra/sweeper=optuna", "hydra.sweeper.direction=maximize"))  # agrees: fine
    cfg = sweep_config("hydra/sweeper=optuna", "hydra.sweeper.direction=minimize")
    with pytest.raises(ConfigError) as e:
        prepare_study(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "hydra.sweeper.direction='minimize' is not allowed" in msg and "sweep.direction" in msg


def test_an_explicit_max_failure_rate_is_kept():
    cfg = sweep_config("hydra/sweeper=optuna", "hydra.sweeper.max_failure_rate=0.25")
    prepare_study(cfg)
    assert cfg.hydra.sweeper.max_failure_rate == 0.25


def test_a_study_needs_to_wait_for_its_trials():
    with pytest.raises(ConfigError, match="run.wait=False is not allowed: true in an Optuna study"):
        prepare_study(sweep_config("hydra/sweeper=optuna", "run.wait=false"))


def test_a_bad_study_ends_before_any_run_with_status_2(capsys):
    cb = MlflowSweepCallback()
    with pytest.raises(SystemExit) as e:
        cb.on_multirun_start(sweep_config("hydra/sweeper=optuna", "sweep.direction=upward"))
    assert e.value.code == 2 and cb.parent_id is None
    assert capsys.readouterr().err.strip() == ("config error: sweep.direction='upward' is not allowed: one of "
                                               "maximize, minimize")


def test_swept_keys_are_the_overrides_that_sweep():
    assert swept_keys(["experiment.optimizer.lr=interval(1e-4,1e-2)", "mode=choice(nccl_cadence,cpu_async)",
                       "experiment.epochs=1", "seed=1,2", "+x=range(1,3)", "tracking.uri=sqlite:////tmp/a.db",
                       "mode=choice(cpu_sync,cpu_async)"]) == ["experiment.optimizer.lr", "mode", "seed", "x"]


def test_overrides_shown_lose_the_tracking_password():
    out = redacted_overrides(["mode=cpu_async", "tracking.uri=postgresql://u:secret@db/mlflow"])
    assert out == ["mode=cpu_async", "tracking.uri=postgresql://u:***@db/mlflow"]


# -- the ranking -------------------------------------------------------------------------------------------------
def row(trial: int, value: float | None, status: str = "FINISHED", **tags: str) -> TrialRow:
    t = {"sweep.trial": str(trial), "sweep.overrides": f"experiment.optimizer.lr=0.00{trial + 1} mode=cpu_async "
                                                       "experiment.epochs=1", **tags}
    return trial_row(t, {} if value is None else {"objective": value}, status, f"run{trial:04d}abcdef",
                     ["experiment.optimizer.lr", "mode"])


def test_a_trial_row_takes_its_params_objective_and_outcome_from_the_run():
    r = row(2, 0.9)
    assert (r.trial, r.params, r.objective, r.status, r.note) == (
        2, {"experiment.optimizer.lr": "0.003", "mode": "cpu_async"}, 0.9, "COMPLETE", "")
    failed = row(3, None, "FAILED", error="RunFailed: rank 1 died\ntraceback ...")
    assert (failed.status, failed.note, failed.objective) == ("FAIL", "run FAILED: RunFailed: rank 1 died", None)
    missing = row(4, None, **{"sweep.error": "config error: sweep.objective='x' is not allowed: ..."})
    assert missing.status == "FAIL" and missing.note.startswith("config error: sweep.objective='x'")
    assert row(5, None).note == "no objective logged"
    nan = row(6, math.nan)
    assert (nan.status, nan.note, nan.objective) == ("FAIL", "objective is nan", None)
    assert trial_row({}, {}, "FINISHED", "r", ["mode"]).trial is None


@pytest.mark.parametrize(("direction", "order"), [("maximize", [1, 3, 0, 2, 4]), ("minimize", [0, 3, 1, 2, 4])])
def test_trials_rank_best_first_then_the_failed_ones(direction, order):
    rows = [row(0, 0.5), row(1, 0.9), row(2, None, "FAILED"), row(3, 0.7), row(4, math.nan)]
    assert [r.trial for r in rank_trials(rows, direction)] == order


def test_ties_go_to_the_earlier_trial_and_rows_without_a_number_go_last():
    rows = [row(3, 0.8), row(1, 0.8), trial_row({}, {}, "FAILED", "r", []), row(2, None, "KILLED")]
    assert [r.trial for r in rank_trials(rows, "maximize")] == [1, 3, 2, None]


def test_the_ranking_table_has_trial_params_objective_and_status():
    ranked = rank_trials([row(0, 0.5), row(1, 0.9), row(2, None, "FAILED", error="config error: mode=nccl_async x")],
                         "maximize")
    md = trials_markdown("digits", ranked, "eval/accuracy", "maximize", ["experiment.optimizer.lr", "mode"])
    lines = md.splitlines()
    assert lines[0] == "# Study `digits`: trials ranked by `eval/accuracy` (maximize)"
    assert ("3 trials: 2 complete, 1 failed. Best: trial 1, eval/accuracy 0.9 "
            "(experiment.optimizer.lr=0.002, mode=cpu_async).") in lines
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| Rank"))
    assert lines[header] == "| Rank | Trial | experiment.optimizer.lr | mode | eval/accuracy | Status | Run |"
    assert lines[header + 2] == "| 1 | 1 | 0.002 | cpu_async | 0.9 | COMPLETE | run0001a |"
    assert lines[header + 3] == "| 2 | 0 | 0.001 | cpu_async | 0.5 | COMPLETE | run0000a |"
    assert lines[header + 4] == "| — | 2 | 0.003 | cpu_async | — | FAIL: run FAILED: config error: mode=nccl_async x | run0002a |"


def test_a_study_with_no_complete_trial_says_so():
    md = trials_markdown("e", rank_trials([row(0, None, "FAILED")], "minimize"), "loss", "minimize", [])
    assert "1 trials: 0 complete, 1 failed." in md and "Best:" not in md


def test_the_trials_report_is_written_and_logged_to_the_parent(tmp_path):
    def run(trial: int, value: float | None, status: str) -> Any:
        tags = {"sweep.trial": str(trial), "sweep.overrides": f"mode=m{trial}"}
        return SimpleNamespace(info=SimpleNamespace(status=status, run_id=f"id{trial}"),
                               data=SimpleNamespace(tags=tags, metrics={} if value is None else {"objective": value}))

    c = FakeClient({})
    path, ranked = generate_trials_report(c, "parent1", [run(0, 0.2, "FINISHED"), run(1, None, "FAILED"),
                                                         run(2, 0.1, "FINISHED")],
                                          str(tmp_path / "report"), "exp", "loss", "minimize", ["mode"])
    assert [r.trial for r in ranked] == [2, 0, 1]
    assert path == str(tmp_path / "report" / "trials.md") and "| 1 | 2 | m2 | 0.1 | COMPLETE | id2 |" in open(path).read()
    assert c.artifacts == [("parent1", path, "report")]
