"""A convergence guard of the user's (issue 53, item 2): ``guard._target_`` names a class implementing the Guard
protocol, built with ``guard.args``; the core consults it after each reduce, bundles keep its state under its path,
and a wrong verdict or path is one clear error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flodl_exp.config import ConfigError
from flodl_exp.config_rules import validate
from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, ConvergenceAction
from flodl_exp.policy.controllers import build_run_guard, guard_name
from flodl_exp.policy.guards import DivergenceReport, Guard, UserGuard
from flodl_exp.zoo.guards import PatienceGuard

from conftest import compose

ZOO = "flodl_exp.zoo.guards.PatienceGuard"


def _cfg_guard(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(kind="trend", **kw)


def test_the_zoo_guard_implements_the_protocol_and_is_built_with_its_args() -> None:
    assert isinstance(PatienceGuard(), Guard)
    g = build_run_guard(_cfg_guard(_target_=ZOO, args={"patience": 2, "ceiling": 9.0}), None)
    assert isinstance(g, UserGuard) and isinstance(g.inner, PatienceGuard) and g.inner.patience == 2
    verdicts = [g.report(DivergenceReport(deltas=[d, d / 2]), 10, 5) for d in (0.1, 0.2, 0.3, 0.4)]
    assert verdicts == [STABLE, STABLE, SUPPRESS_GROWTH, SUPPRESS_GROWTH]
    state = g.state_dict()
    assert json.loads(json.dumps(state)) == {"last": 0.4, "streak": 3}
    fresh = build_run_guard(_cfg_guard(_target_=ZOO, args={"patience": 2}), None)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state, "a resumed run goes on with the guard's history"
    assert guard_name(_cfg_guard(_target_=ZOO)) == ZOO and guard_name(_cfg_guard()) == "trend"


def test_a_verdict_that_is_not_an_action_names_the_class() -> None:
    class Bad:
        def report(self, report: DivergenceReport, k_used: int, k_max: int) -> object:
            return "stable"

    g = UserGuard(Bad(), "my.Bad")
    with pytest.raises(TypeError, match=r"guard._target_='my.Bad': report\(\) returned 'stable', not a ConvergenceAction"):
        g.report(DivergenceReport(deltas=[0.1]), 1, 1)
    with pytest.raises(TypeError, match="no report"):
        UserGuard(object(), "my.Nothing")
    minimal = UserGuard(SimpleNamespace(report=lambda r, k, m: ConvergenceAction("stable")), "my.Min")
    minimal.reset()
    assert minimal.state_dict() == {} and minimal.telemetry() == []


def test_the_config_refuses_a_target_that_is_not_a_dotted_path_and_args_without_one() -> None:
    with pytest.raises(ConfigError, match=r"guard._target_='PatienceGuard' is not allowed"):
        validate(compose(["guard._target_=PatienceGuard"]))
    with pytest.raises(ConfigError, match=r"guard.args=.* set guard._target_ too"):
        validate(compose(["+guard.args.patience=2"]))
    validate(compose([f"guard._target_={ZOO}", "+guard.args.patience=2"]))


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_run_with_the_users_guard_trains_and_bundles_its_state(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FLODL_")) or k == "FLODL_DATA_CACHE"}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "flodl_exp", "run.progress=plain", "experiment.epochs=2",
                          "cluster.ranks_per_node=2", "mode=cpu_cadence", f"guard._target_={ZOO}",
                          "+guard.args.patience=1", f"run.job_root={tmp_path / 'jobs'}",
                          f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metas = list((tmp_path / "jobs").rglob("*.meta.json"))
    assert metas, "no bundle written"
    meta = json.loads(metas[0].read_text())
    assert meta["guard_kind"] == ZOO and set(meta["guard_state"]) == {"last", "streak"}


def test_a_user_class_that_cannot_be_built_is_one_config_error_line_before_anything_starts(tmp_path: Path) -> None:
    from flodl_exp.preflight import build_user_classes

    with pytest.raises(ConfigError) as e:
        build_user_classes({"guard": {"_target_": ZOO, "args": {"patienc": 2}}}, [str(tmp_path)])
    line = str(e.value)
    assert line.startswith(f"config error: guard._target_='{ZOO}' with guard.args={{'patienc': 2}} cannot be built: "
                           "TypeError:") and "\n" not in line
    with pytest.raises(ConfigError, match=r"patience=0: at least 1"):
        build_user_classes({"guard": {"_target_": ZOO, "args": {"patience": 0}}}, [str(tmp_path)])
    with pytest.raises(ConfigError, match=r"outer._target_='flodl_exp.zoo.guards.PatienceGuard': the object has no step"):
        build_user_classes({"outer": {"_target_": ZOO}}, [str(tmp_path)])
    build_user_classes({"guard": {"_target_": ZOO, "args": {"patience": 2}}, "outer": {"_target_": None}}, [str(tmp_path)])


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_cli_refuses_a_guard_it_cannot_build_with_one_line_and_makes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("MLFLOW_", "FLODL_"))}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "flodl_exp", f"guard._target_={ZOO}", "+guard.args.patienc=2",
                          "cluster.ranks_per_node=2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        f"config error: guard._target_='{ZOO}' with guard.args={{'patienc': 2}} cannot be built: TypeError: "
        "PatienceGuard.__init__() got an unexpected keyword argument 'patienc'"]
    assert not (tmp_path / "outputs").exists()
