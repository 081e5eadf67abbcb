"""An outer optimizer of the user's (issue 53, item 2): ``outer._target_`` names a class implementing
``flodl_exp.outer.UserOuterProtocol``, built with ``outer.args``; it runs where the backend keeps the outer optimizer
(the coordinator's averager for cpu, every rank for nccl), bundles keep its state, and a wrong path or result is one
clear error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flodl_exp.config import ConfigError, OuterSpec, outer_spec
from flodl_exp.config_rules import validate
from flodl_exp.outer import OuterOptimizer, UserOuter, make_outer, resets_inner

from conftest import compose

ZOO = "flodl_exp.zoo.outers.HeavyBall"


def _spec(**args: float) -> OuterSpec:
    return OuterSpec(target=ZOO, args=tuple(sorted(args.items())))


def test_the_zoo_heavy_ball_matches_the_built_in_slowmo_step_for_step() -> None:
    user, built_in = make_outer(_spec(lr=1.0, mu=0.5)), make_outer(OuterSpec(kind="slowmo", lr=1.0, mu=0.5))
    assert isinstance(user, UserOuter) and type(built_in) is OuterOptimizer
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        c = [torch.randn(3, 2, generator=gen), torch.randn(5, generator=gen)]
        a, _ = user.step(c)
        b, _ = built_in.step(c)
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))
    assert user.momentum_norm() == pytest.approx(built_in.momentum_norm(), rel=1e-5)


def test_its_state_round_trips_through_the_sidecar_format_and_apply_writes_in_place(tmp_path: Path) -> None:
    o = make_outer(_spec(mu=0.5))
    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    o.apply(params)
    with torch.no_grad():
        for p in params:
            p.add_(0.25)
    rec = o.apply(params)
    assert rec is not None and rec.step_norm > 0
    path = tmp_path / "x.outer.pt"
    torch.save(o.state_dict(), path)
    fresh = make_outer(_spec(mu=0.5))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    c = [torch.full((2, 2), 2.0), torch.ones(3)]
    assert all(torch.equal(x, y) for x, y in zip(o.step(c)[0], fresh.step(c)[0])), "a resumed run goes on with it"
    assert o.state_buffer is None and not resets_inner(_spec())


def test_a_result_of_the_wrong_shape_names_the_class() -> None:
    o = make_outer(_spec())
    o.inner.step = lambda c: c[:1]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"outer._target_='flodl_exp.zoo.outers.HeavyBall': step\(\) returned 1 tensors"):
        o.step([torch.ones(2), torch.ones(3)])


def test_the_config_takes_a_target_alone_and_the_spec_carries_it() -> None:
    cfg = compose([f"outer._target_={ZOO}", "+outer.args.mu=0.25"])
    validate(cfg)
    spec = outer_spec(cfg)
    assert spec.target == ZOO and spec.args == (("mu", 0.25),) and spec.stateful and spec.describe() == "HeavyBall(mu=0.25)"
    with pytest.raises(ConfigError, match=r"outer._target_=.* alone"):
        validate(compose([f"outer._target_={ZOO}", "outer=slowmo"]))
    with pytest.raises(ConfigError, match=r"outer.args=.* set outer._target_ too"):
        validate(compose(["+outer.args.mu=0.25"]))


@pytest.mark.e2e
@pytest.mark.timeout(500)
@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_a_run_with_the_users_outer_optimizer_trains_and_bundles_its_state(tmp_path: Path, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FLODL_")) or k == "FLODL_DATA_CACHE"}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "flodl_exp", "run.progress=plain", "experiment.epochs=2",
                          "cluster.ranks_per_node=2", f"mode={mode}", f"outer._target_={ZOO}", "+outer.args.mu=0.5",
                          f"run.job_root={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sidecars = list((tmp_path / "jobs").rglob("*.outer.pt"))
    assert sidecars, "no outer sidecar written"
    state = torch.load(sidecars[0], weights_only=True)
    assert state["target"] == ZOO and len(state["state"]["v"]) == len(state["state"]["prev"]) > 0
    result = json.loads(next((tmp_path / "jobs").rglob("result.json")).read_text())
    assert result["status"] == "FINISHED"


def test_a_sidecar_of_another_outer_optimizer_is_not_handed_to_the_users_class() -> None:
    built_in = make_outer(OuterSpec(kind="slowmo", lr=1.0, mu=0.5))
    built_in.step([torch.ones(2)])
    built_in.step([torch.zeros(2)])
    o = make_outer(_spec())
    o.load_state_dict(built_in.state_dict())  # a built-in's sidecar: ignored, the state starts fresh
    assert o.state_dict()["state"] == {"prev": [], "v": []}
    other = {"format": 1, "kind": "user", "target": "my.Other", "state": {"prev": [torch.ones(2)], "v": [torch.ones(2)]}}
    o.load_state_dict(other)
    assert o.state_dict()["state"] == {"prev": [], "v": []}


def test_every_member_restarts_a_users_state_at_a_regroup() -> None:
    from flodl_exp.rank.control import RankControl

    o = make_outer(_spec())
    o.step([torch.ones(2)])
    assert o.state_dict()["state"]["prev"]
    fake = type("F", (), {"outer": o, "collective": object()})()
    RankControl._resync_outer(fake)
    assert o.state_dict()["state"] == {"prev": [], "v": []}


class ResettingOuter:
    """A user outer optimizer that asks for the inner optimizer's state to be cleared after each adoption."""

    resets_inner = True

    def step(self, consensus: list[torch.Tensor]) -> list[torch.Tensor]:
        return consensus


def test_a_user_class_says_whether_adoption_resets_the_inner_optimizer() -> None:
    assert resets_inner(OuterSpec(target="test_user_outer.ResettingOuter"))
    assert not resets_inner(_spec()) and resets_inner(OuterSpec(kind="diloco")) and not resets_inner(OuterSpec())
