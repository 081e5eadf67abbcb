"""The user's ``experiment.checkpoint_fn(version, model)`` (algorithms.md 3.15, 8.3): the coordinator's role
(one rank runs it, an error or a death moves it to the lowest live untried rank, none left gives the version
up), the core's periodic bundle that runs it on its model-piece rank and holds until it reported, and the
rank's handler (its error reported, the cpu backend's consensus on a copy, never the replica)."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Optional

import torch
from control_fakes import FakeClock
from rank_fakes import rank_control
from test_control_core import Bare, Ranks, cfg_of, emitted, play, sent
from torch import nn

from flodl_exp.core.checkpoint_fn import CheckpointFnRole
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.commands import Command, CommandOutbox, Record, RecordingObserver, Send
from flodl_exp.core.lifecycle import Phase, Status
from flodl_exp.protocol.messages import Checkpoint, CheckpointResult, Payload, Save, StartEpoch

FN = {"experiment.checkpoint_fn": "flodl_exp.zoo.digits.export_checkpoint"}


# -- the coordinator's role ------------------------------------------------------------------------------
def _role(world: int = 3, *, consensus: bool = False) -> tuple[CheckpointFnRole, Cohort, list[Command]]:
    cohort = Cohort(world, None, 0.0)
    for r in range(world):
        cohort.join(r, 0.0)
    commands: list[Command] = []
    role = CheckpointFnRole(cohort=cohort, outbox=CommandOutbox(cohort, commands), obs=RecordingObserver(commands),
                            consensus=consensus)
    return role, cohort, commands


def _asked(commands: list[Command]) -> list[tuple[int, int]]:
    """(rank, version) of every Checkpoint sent, then forgotten."""
    out = [(c.rank, c.payload.version) for c in commands if isinstance(c, Send) and isinstance(c.payload, Checkpoint)]
    commands[:] = [c for c in commands if not (isinstance(c, Send) and isinstance(c.payload, Checkpoint))]
    return out


def _records(commands: list[Command], kind: str) -> list[tuple[Any, ...]]:
    return [c.args for c in commands if isinstance(c, Record) and c.kind == kind]


def test_the_role_runs_one_version_on_one_rank_and_settles_on_its_result() -> None:
    role, _, commands = _role(consensus=True)
    assert role.settled
    role.fire(2, 1)
    (sent_,) = [c.payload for c in commands if isinstance(c, Send)]
    assert sent_ == Checkpoint(version=2, consensus=True)
    assert not role.settled
    assert role.on_result(0, CheckpointResult(version=2, elapsed_ms=1.0)) is False, "not the rank that owes it"
    assert role.on_result(1, CheckpointResult(version=1, elapsed_ms=1.0)) is False, "another version"
    assert not role.settled
    assert role.on_result(1, CheckpointResult(version=2, elapsed_ms=7.5)) is True
    assert role.settled and role.done == {2: 1}
    assert _records(commands, "log_metrics") == [({"checkpoint_fn/elapsed_ms": 7.5}, 2)]
    (event,) = [a[0].record() for a in _records(commands, "emit")]
    assert event == {"event": "checkpoint_fn", "version": 2, "rank": 1, "elapsed_ms": 7.5, "error": None}


def test_an_error_moves_the_version_to_the_lowest_live_untried_rank() -> None:
    role, _, commands = _role(4)
    role.fire(4, 2)
    assert _asked(commands) == [(2, 4)]
    role.on_result(2, CheckpointResult(version=4, elapsed_ms=1.0, error="OSError: disk full"))
    assert _asked(commands) == [(0, 4)] and not role.settled
    role.on_result(0, CheckpointResult(version=4, elapsed_ms=1.0, error="OSError: disk full"))
    assert _asked(commands) == [(1, 4)], "rank 2 was tried already"
    role.on_result(1, CheckpointResult(version=4, elapsed_ms=3.0))
    assert role.settled and role.done == {4: 1}
    assert any("checkpoint_fn_error" in a[0] for a in _records(commands, "set_tags"))


def test_a_death_while_owing_the_result_fails_over_and_other_deaths_do_not() -> None:
    role, cohort, commands = _role(3)
    role.fire(2, 0)
    _asked(commands)
    cohort.mark_dead(2, "killed", epoch=1, global_step=0)
    assert role.on_rank_dead(2) is False and _asked(commands) == [], "rank 2 owed nothing"
    cohort.mark_dead(0, "killed", epoch=1, global_step=0)
    assert role.on_rank_dead(0) is True
    assert _asked(commands) == [(1, 2)] and not role.settled
    role.on_result(1, CheckpointResult(version=2, elapsed_ms=1.0))
    assert role.settled and role.done == {2: 1}


def test_with_no_live_rank_left_the_version_is_given_up_never_failing_anything(caplog: Any) -> None:
    role, cohort, commands = _role(2)
    role.fire(6, 1)
    role.on_result(1, CheckpointResult(version=6, elapsed_ms=1.0, error="ValueError: bad"))
    assert _asked(commands) == [(1, 6), (0, 6)]
    cohort.mark_dead(0, "killed", epoch=5, global_step=0)
    with caplog.at_level(logging.ERROR, logger="flodl_exp.coordinator"):
        assert role.on_rank_dead(0) is True
    assert role.settled and role.done == {6: None} and _asked(commands) == []
    assert "given up" in caplog.text
    (tags,) = [a[0] for a in _records(commands, "set_tags") if "checkpoint_fn_failed.v6" in a[0]]
    assert "ValueError: bad" in tags["checkpoint_fn_failed.v6"] and "died" in tags["checkpoint_fn_failed.v6"]
    gave_up = [a[0].record() for a in _records(commands, "emit") if a[0].gave_up]
    assert gave_up == [{"event": "checkpoint_fn", "version": 6, "rank": None, "error": tags["checkpoint_fn_failed.v6"],
                        "gave_up": True, "tried": [1, 0]}]


def test_a_dead_target_is_skipped_at_once() -> None:
    role, cohort, commands = _role(3)
    cohort.mark_dead(0, "killed", epoch=0, global_step=0)
    role.fire(2, 0)
    assert _asked(commands) == [(1, 2)]


# -- the core: a periodic bundle runs it on its model-piece rank and waits for it --------------------------------
class CheckpointRanks(Ranks):
    """Scripted ranks that also answer Checkpoint: an error on the ranks of ``failing``; nothing (yet) while
    ``hold`` is set, so a test can look at the core while the result is owed."""

    def __init__(self, world: int, failing: frozenset[int] = frozenset()) -> None:
        super().__init__(world)
        self.failing = failing
        self.hold = False
        self.held: list[tuple[int, Payload]] = []
        self.asked: list[tuple[int, int]] = []

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        answers = super().hear(out)
        for r, p in out:
            if isinstance(p, Checkpoint) and r not in self.dead:
                self.asked.append((r, p.version))
                err = f"RuntimeError: rank {r} fails" if r in self.failing else None
                res = (r, CheckpointResult(version=p.version, elapsed_ms=2.0, error=err))
                (self.held if self.hold else answers).append(res)
        return answers


def _model_rank_of(log: list[Command], stem: str) -> int:
    (r,) = [c.rank for c in log if isinstance(c, Send) and isinstance(c.payload, Save) and c.payload.stem == stem
            and c.payload.model]
    return r


def test_a_periodic_bundle_runs_the_fn_on_its_model_rank_and_holds_the_next_epoch_until_it_reports() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_sync", 2, epochs=3, **{"checkpoint.every": 2, **FN}), clock)
    ranks = CheckpointRanks(2)
    ranks.hold = True
    play(w, ranks, clock, until=lambda: bool(ranks.held))
    log = w.log + w.commands
    model_rank = _model_rank_of(log, "bundle_epoch2")
    assert ranks.asked == [(model_rank, 2)], "version = the bundle's epoch, on the rank writing its model piece"
    (at, ck) = [(i, c.payload) for i, c in enumerate(log) if isinstance(c, Send) and isinstance(c.payload, Checkpoint)][0]
    saved = max(i for i, c in enumerate(log) if isinstance(c, Send) and isinstance(c.payload, Save))
    assert at > saved and ck.consensus is True, "after the saves, on the consensus (cpu backend)"
    for _ in range(6):  # every save answered: the meta is written, training still holds for the result
        w.tick()
        ranks.pending.extend(ranks.hear(w.take()))
        while ranks.pending:
            w.send(*ranks.pending.popleft())
    assert "bundle_epoch2" in w.store.metas and w.core.life.is_(Phase.CHECKPOINTING)
    assert not [c for c in w.log + w.commands if isinstance(c, (Send,)) and isinstance(c.payload, StartEpoch)
                and c.payload.epoch == 2], "epoch 2 waits for the checkpoint_fn"
    ranks.hold = False
    ranks.pending.extend(ranks.held)
    play(w, ranks, clock)
    log = w.log + w.commands
    assert w.core.life.status is Status.FINISHED
    assert {c.payload.epoch for c in sent(log, StartEpoch)} == {0, 1, 2}
    assert [e["version"] for e in emitted(log, "checkpoint_fn")] == [2]
    assert w.core.checkpoint_fn.done == {2: model_rank}


def test_a_failing_fn_fails_over_on_the_same_boundary_and_training_goes_on() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_cadence", 3, epochs=3, **{"checkpoint.every": 1, **FN}), clock)
    ranks = CheckpointRanks(3, failing=frozenset({0, 1}))
    play(w, ranks, clock, samples=144)
    log = w.log + w.commands
    assert w.core.life.status is Status.FINISHED
    by_version: dict[int, list[int]] = {}
    for r, v in ranks.asked:
        by_version.setdefault(v, []).append(r)
    assert sorted(by_version) == [1, 2]
    for v, tried in by_version.items():
        first = _model_rank_of(log, f"bundle_epoch{v}")
        assert tried[0] == first and tried == [first, *sorted({0, 1, 2} - {first})][:len(tried)], tried
        assert tried[-1] == 2, "the first rank that does not fail writes it"
    assert w.core.checkpoint_fn.done == {1: 2, 2: 2}
    assert [e for e in emitted(log, "checkpoint_fn") if e.get("gave_up")] == []
    assert set(w.store.metas) == {"bundle_epoch1", "bundle_epoch2", "bundle"}, "the bundles do not depend on it"


def test_without_checkpoint_fn_no_checkpoint_is_sent_and_at_epoch_bundles_never_run_it() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_cadence", 2, epochs=3, **{"checkpoint.every": 1}), clock)
    ranks = CheckpointRanks(2)
    play(w, ranks, clock)
    assert ranks.asked == [] and w.core.life.status is Status.FINISHED
    w = Bare(cfg_of("nccl_cadence", 2, epochs=3, **{"checkpoint.at_epoch": 1, **FN}), clock)
    ranks = CheckpointRanks(2)
    play(w, ranks, clock)
    assert ranks.asked == [] and "bundle_at1" in w.store.metas


def test_a_progressive_periodic_bundle_runs_it_with_the_asked_epoch() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_cadence", 2, epochs=4, **{"checkpoint.every": 2, **FN}), clock)
    ranks = CheckpointRanks(2, failing=frozenset({0}))
    play(w, ranks, clock, samples=192)
    assert w.core.life.status is Status.FINISHED
    assert [v for _, v in ranks.asked][-1] == 2 and {v for _, v in ranks.asked} == {2}
    assert w.core.checkpoint_fn.done == {2: 1}
    assert "bundle_epoch2" in w.store.metas


def test_a_warning_when_it_can_never_run(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="flodl_exp.coordinator"):
        Bare(cfg_of("cpu_sync", 2, epochs=3, **FN), FakeClock())
    assert "experiment.checkpoint_fn is set but will not run" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flodl_exp.coordinator"):
        Bare(cfg_of("cpu_sync", 2, epochs=3, **{"checkpoint.every": 1, **FN}), FakeClock())
    assert "checkpoint_fn" not in caplog.text


# -- the rank's handler ----------------------------------------------------------------------------------------
def _rank(fn: Optional[Any], model: Optional[nn.Module] = None, rank: int = 1) -> Any:
    trainer = SimpleNamespace(exp=SimpleNamespace(checkpoint_fn=fn), model=model or nn.Linear(2, 1))
    return rank_control(trainer, rank=rank)


def test_the_rank_runs_the_fn_on_its_replica_and_reports_its_time() -> None:
    calls: list[tuple[int, Any]] = []
    model = nn.Linear(2, 1)
    w, sent_ = _rank(lambda v, m: calls.append((v, m)), model)
    w.handle(Checkpoint(version=4))
    assert calls == [(4, model)]
    (res,) = sent_
    assert isinstance(res, CheckpointResult) and res.version == 4 and res.error is None
    assert res.elapsed_ms >= 0 and w.callback_ms >= res.elapsed_ms


def test_a_failing_fn_is_reported_never_fatal_and_a_missing_one_says_so() -> None:
    def boom(v: int, m: Any) -> None:
        raise OSError("disk full")

    w, sent_ = _rank(boom)
    w.handle(Checkpoint(version=2))
    (res,) = sent_
    assert res.error == "OSError: disk full" and res.version == 2
    w, sent_ = _rank(None)
    w.handle(Checkpoint(version=2))
    (res,) = sent_
    assert res.error is not None and "no experiment.checkpoint_fn" in res.error


def test_the_cpu_backend_hands_the_fn_the_consensus_on_a_copy_never_the_replica() -> None:
    model = nn.Linear(2, 1)
    replica = {k: v.clone() for k, v in model.state_dict().items()}
    seen: dict[str, torch.Tensor] = {}

    def fn(v: int, m: nn.Module) -> None:
        assert m is not model
        seen.update({k: t.clone() for k, t in m.state_dict().items()})
        with torch.no_grad():
            for p in m.parameters():
                p.add_(100.0)  # what the fn does to its copy stays there

    w, sent_ = _rank(fn, model)
    w.last_consensus = {"p0": torch.full((1, 2), 3.0), "p1": torch.full((1,), -1.0)}
    w.handle(Checkpoint(version=2, consensus=True))
    assert sent_[0].error is None
    assert torch.equal(seen["weight"], torch.full((1, 2), 3.0)) and torch.equal(seen["bias"], torch.full((1,), -1.0))
    for k, v in model.state_dict().items():
        assert torch.equal(v, replica[k]), "the training replica is untouched"


def test_export_checkpoint_writes_the_state_dict_and_fails_on_the_named_rank(tmp_path: Any, monkeypatch: Any) -> None:
    import pytest

    from flodl_exp.zoo.digits import export_checkpoint

    model = nn.Linear(3, 2)
    monkeypatch.setenv("FLODL_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("FLODL_RANK", "1")
    monkeypatch.setenv("FLODL_TEST_CHECKPOINT_FN_FAIL_RANK", "0")
    export_checkpoint(2, model)
    state = torch.load(tmp_path / "checkpoint_exports" / "model_v2.pt", weights_only=True)
    assert state.keys() == model.state_dict().keys() and torch.equal(state["weight"], model.weight.detach())
    monkeypatch.setenv("FLODL_RANK", "0")
    with pytest.raises(RuntimeError, match="on purpose"):
        export_checkpoint(4, model)
    assert sorted(p.name for p in (tmp_path / "checkpoint_exports").iterdir()) == ["model_v2.pt"], "no temp file left"
