"""A policy is one object: a toy policy defined and registered here, in the test file, runs through the control
core (bare, as the coordinator wires it, as the simulator wires it) and through the simulator's whole run, with
no change anywhere in the package (issue 50, item 3).

The toy, ``pairs``: every rank steps twice, then the replicas are averaged (sync's rhythm at two steps). It
differs from every built-in policy in the gate's target, so a core that still asked "is this sync?" somewhere
instead of the policy object would average at the wrong step and the assertions on the snapshots' step counts
would fail."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from control_fakes import FakeClock
from test_control_core import BATCH, AsCoordinator, AsSimulator, Bare, Ranks, _final_eval_asked, play

from flodl_exp.config import ConfigError, is_progressive
from flodl_exp.core.lifecycle import Phase
from flodl_exp.policy.base import AveragingPolicy
from flodl_exp.policy.mode import Backend, Mode, known_modes
from flodl_exp.policy.registry import policy_names, register_policy, unregister_policy
from flodl_exp.protocol.messages import Snapshot
from flodl_exp.simulate.engine import simulate
from flodl_exp.simulate.report import summarize
from flodl_exp.simulate.topology import LinkConfig, RankGroupConfig, SimulateConfig, run_config

PAIR = 2


class PairsPolicy(AveragingPolicy):
    """Every rank steps twice, then the replicas are averaged."""

    name = "pairs"
    window_grows = False
    progressive_by_default = False

    def window_target(self, count: int) -> int:
        return PAIR

    def reduce_budget(self, count: int, overshoot: int) -> int:
        return PAIR if count else 0

    def unavailable_with(self, backend: Backend) -> str | None:
        return "the toy averages through the coordinator only" if backend is Backend.NCCL else None

    def guard_capable(self, backend: Backend) -> bool:
        return False


@pytest.fixture
def pairs() -> Iterator[AveragingPolicy]:
    policy = register_policy(PairsPolicy())
    try:
        yield policy
    finally:
        unregister_policy("pairs")


def rig(epochs: int = 2) -> SimulateConfig:
    return SimulateConfig(ranks=[RankGroupConfig(count=1, speed=1.0), RankGroupConfig(count=1, speed=0.5)],
                          samples=160, batch_size=BATCH, epochs=epochs, link=LinkConfig())


def test_a_registered_policy_is_a_mode_like_the_built_in_ones(pairs: AveragingPolicy) -> None:
    assert "pairs" in policy_names() and "cpu_pairs" in known_modes() and "nccl_pairs" not in known_modes()
    run = run_config(rig(), "cpu_pairs", 2)  # through the real validation
    assert Mode.of(run).policy is pairs and not is_progressive(run)
    with pytest.raises(ConfigError, match="mode=nccl_pairs .*does not exist: the toy averages through the coordinator"):
        run_config(rig(), "nccl_pairs", 2)


def test_a_policy_name_is_refused_once_unregistered() -> None:
    assert "pairs" not in policy_names()
    with pytest.raises(ValueError, match="not allowed: one of"):
        run_config(rig(), "cpu_pairs", 2)
    with pytest.raises(ValueError, match="taken by"):
        register_policy(type("Clash", (AveragingPolicy,), {"name": "sync"})())
    with pytest.raises(ValueError, match="built in"):
        unregister_policy("cadence")


def test_the_toy_policy_drives_the_core_the_same_in_every_wiring(pairs: AveragingPolicy, tmp_path: Any) -> None:
    sim = rig()
    run = run_config(sim, "cpu_pairs", 2)
    traces = []
    for make in (lambda c: Bare(run, c), lambda c: AsCoordinator(run, c, tmp_path),
                 lambda c: AsSimulator(sim, "cpu_pairs", c)):
        clock = FakeClock()
        trace: list[Any] = []
        wiring = make(clock)
        ranks = Ranks(2, slow={1: 2})
        play(wiring, ranks, clock, samples=160, trace=trace, until=_final_eval_asked(ranks))
        assert wiring.core.life.is_(Phase.FINISHING), "the run trained every epoch and asked for the final eval"
        traces.append([(t[0], [m for m in t[1] if m[1][0] not in ("Save", "FormGroup")]) if t[0] == "out" else t
                       for t in trace])
    bare, coord, simulated = traces
    assert coord == bare and simulated == bare, "a wiring decided otherwise than the bare core"

    # The policy's gate, not sync's or cadence's: each reduce holds two steps of every rank (the final consensus
    # reduce at the end of training may hold fewer).
    entries: list[Any] = bare
    asked = [t for t in entries if t[0] == "out" and any(m[1][0] == "RequestParams" for m in t[1])]
    steps = [t[2][1] for t in entries if t[0] == "in" and t[2][0] == Snapshot.__name__]
    reduces = 160 // BATCH * 2 // (2 * PAIR)  # batches of the run / (ranks x steps each)
    assert len(asked) >= reduces and steps[:2 * reduces] == [PAIR] * (2 * reduces), steps


def test_the_simulator_runs_the_toy_policy_at_its_own_rhythm(pairs: AveragingPolicy) -> None:
    sim = rig(epochs=3)
    rows = {m: summarize(simulate(sim, m), 0) for m in ("cpu_pairs", "cpu_sync")}
    batches = 3 * 160 // BATCH
    assert rows["cpu_pairs"]["samples"] == rows["cpu_sync"]["samples"] == 3 * 160
    # The gate opens at two steps of each rank (ranks train on while a cpu reduce's request travels, so a
    # reduce may hold more): at most one reduce per 2 x PAIR batches, and fewer than sync's (one step each).
    pairs_syncs, sync_syncs = rows["cpu_pairs"]["syncs"], rows["cpu_sync"]["syncs"]
    assert 1 <= pairs_syncs <= batches // (2 * PAIR) + 1 and pairs_syncs < sync_syncs, (pairs_syncs, sync_syncs)
