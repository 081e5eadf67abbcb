"""The control core on its own: scripted rank messages in, commands out, no process, no socket, no file.

The same scripted ranks drive the core three ways: bare (``recording_core``: every output a command), as the
coordinator wires it (``Coordinator`` with a recording transport) and as the simulator wires it (``Engine``'s
core with its outbox); the last test checks the three send the ranks the same messages at every step."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import pytest
import torch
from control_fakes import FakeClock, FakeSink, FakeTransport, make_config, make_spec, sent_payloads
from omegaconf import OmegaConf

from flodl_exp.config import Config, RunShape, load_config
from flodl_exp.coordinator.coordinator import Coordinator
from flodl_exp.core.bundle_store import MemoryBundles
from flodl_exp.core.commands import (
    Broadcast,
    Command,
    Event,
    RankJoined,
    RankMessage,
    Record,
    Send,
    Tick,
    TrainingStarts,
)
from flodl_exp.core.control_core import ControlCore, recording_core
from flodl_exp.core.lifecycle import Phase, Status
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    CoordHeartbeat,
    EpochAggregated,
    EvalBroadcast,
    EvalResult,
    ExecuteEval,
    ExtendPartition,
    Payload,
    Regroup,
    RequestParams,
    RequestSession,
    Save,
    SaveResult,
    SessionReady,
    Shutdown,
    Snapshot,
    StartEpoch,
    SyncAck,
    SyncNow,
    Update,
)
from flodl_exp.simulate.engine import Engine
from flodl_exp.simulate.topology import LinkConfig, RankGroupConfig, SimulateConfig, run_config
from flodl_exp.torch_averager import TorchAverager

BATCH = 8


# -- three wirings of one core ---------------------------------------------------------
class Bare:
    """``recording_core``: the commands themselves, driven through ``handle`` (what a test's direct call on the
    core caused waits in ``commands`` too, in order)."""

    def __init__(self, cfg: Any, clock: FakeClock, store: Optional[MemoryBundles] = None) -> None:
        self.store = store or MemoryBundles()
        self.clock = clock
        averager = TorchAverager(RunShape.of(cfg).outer) if Mode.of(cfg).is_cpu else None
        self.core, self.commands = recording_core(cfg, clock, store=self.store, averager=averager)
        self.log: list[Command] = []

    def _handle(self, event: Event) -> None:
        self.commands.extend(self.core.handle(event))  # handle empties the core's list: put back what it returned

    def start(self, samples: int) -> None:
        for r in range(self.core.W):
            self._handle(RankJoined(r, 0.0))
        self._handle(TrainingStarts(samples, None, self.clock()))

    def send(self, r: int, p: Payload) -> None:
        self._handle(RankMessage(r, p, self.clock()))

    def tick(self) -> None:
        self._handle(Tick(self.clock()))

    def take(self) -> list[tuple[int, Payload]]:
        out = sent_payloads(self.commands)
        self.log += self.commands
        self.commands.clear()
        return out


class AsCoordinator:
    def __init__(self, cfg: Any, clock: FakeClock, tmp_path: Any) -> None:
        self.transport = FakeTransport()
        spec = make_spec(cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)), tmp_path)
        self.co = Coordinator(spec, self.transport, None, FakeSink(), str(tmp_path), clock=clock)  # type: ignore[arg-type]
        self.core = self.co.core

    def start(self, samples: int) -> None:
        for r in range(self.co.W):
            self.co.on_event(("join", r, Hello(rank=r, samples=samples, host="h", pid=100 + r)))
        self.co.start()

    def send(self, r: int, p: Payload) -> None:
        self.co.on_event(("msg", r, encode(p)))

    def tick(self) -> None:
        self.co.tick()

    def take(self) -> list[tuple[int, Payload]]:
        out: list[tuple[int, Payload]] = [(r, p) for r, p in self.transport.raw if not isinstance(p, CoordHeartbeat)]
        self.transport.take()
        return out


class AsSimulator:
    """The simulator's engine, its core driven through ``Engine.handle`` on the script's clock (the engine's own
    ranks and event queue unused)."""

    def __init__(self, sim: SimulateConfig, mode: str, clock: FakeClock) -> None:
        self.engine = Engine(sim, mode)
        self.core = self.engine.core
        self.clock = clock
        self.sent: list[tuple[int, Payload]] = []
        self.engine._to_rank = lambda r, p: self.sent.append((r, p))  # type: ignore[method-assign]

    def start(self, samples: int) -> None:
        self.engine.handle(TrainingStarts(samples, None, self.clock()))

    def send(self, r: int, p: Payload) -> None:
        self.engine.handle(RankMessage(r, p, self.clock()))

    def tick(self) -> None:
        self.engine.handle(Tick(self.clock()))

    def take(self) -> list[tuple[int, Payload]]:
        out, self.sent = self.sent, []
        return out


# -- scripted ranks ------------------------------------------------------------------------
@dataclass
class _Rank:
    plans: deque[tuple[int, int, int, int]] = field(default_factory=deque)
    chunk: Optional[list[int]] = None
    """[epoch, chunk id, offset, batches, done]"""
    steps: int = 0
    blocked: bool = False
    evals: list[ExecuteEval] = field(default_factory=list)


class Ranks:
    """Ranks that train one batch at a time, round robin, and answer what the core sends at once: a
    collective completes as soon as it is asked for (each rank acks), a snapshot is sent on request."""

    def __init__(self, world: int, slow: Optional[dict[int, int]] = None, eval_ms: Optional[float] = None) -> None:
        self.r = [_Rank() for _ in range(world)]
        self.eval_ms = eval_ms
        """A periodic eval is answered at once, taking this long (None: left unanswered)."""
        self.dead: set[int] = set()
        self.hold_acks: set[int] = set()
        """Ranks whose collective has not completed (they answer nothing until released)."""
        self.slow = slow or {}
        """rank -> it trains a batch only every k turns (a straggler)."""
        self.pending: deque[tuple[int, Payload]] = deque()
        """Answers not yet delivered to the core."""
        self.turn = 0
        self.credit: dict[int, int] = {}
        self.final_evals: list[int] = []
        self.shutdown = False

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        """What the ranks answer at once to what the core sent."""
        answers: list[tuple[int, Payload]] = []
        for r, p in out:
            rk = self.r[r]
            if r in self.dead:
                continue
            if isinstance(p, (StartEpoch, ExtendPartition)):
                rk.plans.append((p.epoch, p.chunk, p.offset, p.size // BATCH))
            elif isinstance(p, SyncNow):
                if r in self.hold_acks:
                    rk.blocked = True
                    continue
                answers.append((r, SyncAck(n=rk.steps, d=0.0)))
                rk.steps = 0
            elif isinstance(p, RequestSession):
                answers.append((r, SessionReady(generation=p.generation, session=f"s{p.generation}")))
            elif isinstance(p, RequestParams):
                answers.append((r, Snapshot(n=rk.steps, tensors={"p0": torch.tensor([1.0, float(r)])})))
                rk.blocked = p.barrier
            elif isinstance(p, Update):
                rk.steps, rk.blocked = 0, False
            elif isinstance(p, ExecuteEval):
                if p.final:
                    self.final_evals.append(r)
                elif self.eval_ms is not None:
                    answers.append((r, EvalResult(epoch=p.epoch, metrics={"acc": 0.5}, elapsed_ms=self.eval_ms)))
                rk.evals.append(p)
            elif isinstance(p, Save):
                answers.append((r, SaveResult(stem=p.stem)))
            elif isinstance(p, Shutdown):
                self.shutdown = True
        return answers

    def next(self) -> Optional[tuple[int, Payload]]:
        """One rank's next report (a batch, or a finished chunk's metrics), or None when none has work. A slow
        rank (``slow[r] = k``) goes once in k turns while another rank can go."""
        ready = []
        for r, rk in enumerate(self.r):
            if r in self.dead:
                continue
            if rk.chunk is None and rk.plans and not rk.blocked:
                e, cid, off, nb = rk.plans.popleft()
                rk.chunk = [e, cid, off, nb, 0]
            if rk.chunk is not None and not rk.blocked:
                ready.append(r)
        if not ready:
            return None
        fast = [r for r in ready if self.credit.get(r, 0) + 1 >= self.slow.get(r, 1)]
        for r in ready:
            if r not in fast or len(fast) == 0:
                self.credit[r] = self.credit.get(r, 0) + 1
        pick = fast or ready
        r = pick[self.turn % len(pick)]
        self.turn += 1
        self.credit[r] = 0
        rk = self.r[r]
        assert rk.chunk is not None
        e, cid, off, nb, done = rk.chunk
        if done < nb:
            rk.chunk[4] += 1
            rk.steps += 1
            return r, Batch(ms=10.0, data_ms=1.0, chunk=cid, loss=0.5, lr=0.01)
        rk.chunk = None
        return r, ChunkMetrics(epoch=e, chunk=cid, avg_loss=0.5, batches=done, samples=done * BATCH,
                               epoch_ms=10.0 * done, share_complete_ms=11.0 * done, compute_only_ms=10.0 * done,
                               data_starve_ms=1.0 * done, ranges=[[off, done * BATCH]] if done else [],
                               loss_batches=done)


def play(wiring: Any, ranks: Ranks, clock: FakeClock, *, samples: int = 96, max_steps: int = 5000,
         until: Callable[[], bool] = lambda: False, trace: Optional[list[Any]] = None) -> None:
    """Start (unless started), then feed the ranks' reports and answers one at a time, ticking after each,
    until the core shuts the run down, ``until`` holds, or nothing moves."""
    if wiring.core.life.is_(Phase.CONNECTING):
        wiring.start(samples)
    pending = ranks.pending  # kept across calls: a play that stopped on ``until`` left answers to deliver
    pending.extend(ranks.hear(_logged(wiring.take(), trace)))
    for _ in range(max_steps):
        if ranks.shutdown or until():
            return
        msg = pending.popleft() if pending else ranks.next()
        if msg is None:
            if ranks.final_evals:  # the final eval: reported once asked for
                r = ranks.final_evals.pop()
                msg = (r, EvalResult(epoch=wiring.core.epochs - 1, metrics={"acc": 0.9}, final=True, elapsed_ms=5.0))
            else:
                wiring.tick()
                out = wiring.take()
                if not out:
                    raise AssertionError(f"nothing moves in phase {wiring.core.life.phase}")
                pending.extend(ranks.hear(_logged(out, trace)))
                continue
        clock.advance(0.01)
        if trace is not None:
            trace.append(("in", msg[0], _key(msg[1])))
        wiring.send(*msg)
        wiring.tick()
        pending.extend(ranks.hear(_logged(wiring.take(), trace)))
    raise AssertionError("the script did not end")


def _logged(out: list[tuple[int, Payload]], trace: Optional[list[Any]]) -> list[tuple[int, Payload]]:
    if trace is not None:
        trace.append(("out", sorted((r, _key(p)) for r, p in out)))
    return out


def _key(p: Payload) -> tuple[Any, ...]:
    """What identifies a message (tensors, wall-clock readings and wire-only folding left out)."""
    if isinstance(p, Update):
        return ("Update", p.n, p.alpha, p.skip)
    if isinstance(p, EpochAggregated):
        return ("EpochAggregated", p.epoch, tuple(sorted(k for k in p.metrics)))
    if isinstance(p, (Snapshot, Batch, ChunkMetrics, SyncAck, EvalResult)):
        return (type(p).__name__, *(getattr(p, f) for f in ("n", "chunk", "epoch") if hasattr(p, f)))
    return (type(p).__name__, *sorted((k, repr(v)) for k, v in vars(p).items()))


def _final_eval_asked(ranks: Ranks) -> Callable[[], bool]:
    return lambda: bool(ranks.final_evals)


def cfg_of(mode: str, world: int, epochs: int = 2, **overrides: Any) -> Config:
    return load_config(make_config(mode, world, epochs, **overrides))


def sent(log: list[Command], kind: type) -> list[Any]:
    """The sends and broadcasts of one payload type (``.payload`` is that type; ``.rank`` or ``.to``)."""
    return [c for c in log if isinstance(c, (Send, Broadcast)) and isinstance(c.payload, kind)]


def emitted(log: list[Command], event: str) -> list[dict[str, Any]]:
    """The JSON of every event of kind ``event`` the core emitted (what events.jsonl would hold, less the times)."""
    return [c.args[0].record() for c in log if isinstance(c, Record) and c.kind == "emit" and c.args[0].EVENT == event]


# -- the reduce gate -----------------------------------------------------------------------
def test_the_gate_fires_once_every_rank_stepped_and_never_twice() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 2), clock)
    w.start(96)
    ranks = Ranks(2)
    ranks.hear(w.take())
    first = ranks.next()
    assert first is not None
    w.send(*first)  # rank 0's first batch
    w.tick()
    assert sent(w.commands, SyncNow) == [], "rank 1 has not stepped: no reduce"
    second = ranks.next()
    assert second is not None
    w.send(*second)  # rank 1's
    w.tick()
    (fired,) = sent(w.commands, SyncNow)
    assert isinstance(fired, Broadcast) and fired.to == (0, 1)
    w.take()
    w.tick()
    assert sent(w.commands, SyncNow) == [] and w.core.fire_reduce() is False, "one reduce at a time"
    with pytest.raises(RuntimeError, match="already in flight"):
        w.core.cycle.trigger([0, 1])


def test_handle_returns_the_commands_of_one_event() -> None:
    core, commands = recording_core(cfg_of("nccl_sync", 2))  # no clock: the core runs on its events' time
    for r in range(2):
        assert core.handle(RankJoined(r, 0.0)) == []
    starts = core.handle(TrainingStarts(96, None, 0.0)) + core.handle(Tick(0.5))
    assert {c.rank for c in starts if isinstance(c, Send) and isinstance(c.payload, StartEpoch)} == {0, 1}
    assert commands == []
    chunk = next(c.payload.chunk for c in starts if isinstance(c, Send) and isinstance(c.payload, StartEpoch) and c.rank == 0)
    out = core.handle(RankMessage(0, Batch(ms=10.0, data_ms=1.0, chunk=chunk, loss=0.5, lr=0.01), 1.0))
    assert [c for c in out if isinstance(c, (Send, Broadcast))] == []
    assert emitted(out, "first_batch") == [{"event": "first_batch", "rank": 0}]
    assert core.view.global_step == 0 and core.view.alive_ranks() == [0, 1]


# -- aggregation -----------------------------------------------------------------------------
def test_an_epoch_aggregates_only_after_the_stragglers_report() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_sync", 2), clock)
    ranks = Ranks(2, slow={1: 4})
    agg: list[int] = []

    def rank0_done_rank1_not() -> bool:
        return ranks.r[0].chunk is None and not ranks.r[0].plans and ranks.r[1].chunk is not None

    play(w, ranks, clock, until=rank0_done_rank1_not)
    agg = [c.payload.epoch for c in sent(w.log + w.commands, EpochAggregated)]
    assert agg == [], "the straggler's share is not in: no epoch may aggregate"
    play(w, ranks, clock)
    log = w.log + w.commands
    assert [c.payload.epoch for c in sent(log, EpochAggregated)] == [0, 1]
    epochs = emitted(log, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and all(e["samples"] == 96 for e in epochs)


# -- the end of the run ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence", "cpu_cadence", "cpu_async"])
def test_the_run_ends_in_consensus_then_the_final_eval(mode: str) -> None:
    """Every epoch aggregated: a last consensus reduce when replicas may differ (steps since the last reduce;
    always under EASGD's blend, cpu_async), then the final eval on the primary rank, then the shutdown."""
    clock = FakeClock()
    w = Bare(cfg_of(mode, 2), clock)
    steps_at_drain: list[bool] = []

    def drained() -> bool:
        if w.core.life.is_(Phase.DRAINING) and not steps_at_drain:
            steps_at_drain.append(w.core.cycle.any_steps([0, 1]))
        return False

    play(w, Ranks(2, slow={1: 3}), clock, until=drained)
    log = w.log + w.commands
    kinds = [type(c.payload).__name__ for c in log if isinstance(c, (Send, Broadcast))]
    last_agg = max(i for i, k in enumerate(kinds) if k == "EpochAggregated")
    final_eval = kinds.index("ExecuteEval", last_agg)
    between = kinds[last_agg:final_eval]
    reduced = ("SyncNow" in between) or ("RequestParams" in between)
    assert reduced == (mode == "cpu_async" or steps_at_drain == [True]), (between, steps_at_drain)
    if mode == "cpu_async":
        assert [c.payload.barrier for c in sent(log, RequestParams)][-1] is True, "the final overwrite waits"
    assert not w.core.cycle.any_steps([0, 1]), "the final eval sees replicas in consensus"
    assert kinds[-1] == "Shutdown" and w.core.life.status is Status.FINISHED
    assert w.core.outcome()["final_eval"] == {"eval/acc": 0.9}


def test_a_nccl_eval_holds_the_next_collective_until_it_answers() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 2, **{"eval.every": 1}), clock)
    ranks = Ranks(2)
    play(w, ranks, clock, until=lambda: any(not e.final for rk in ranks.r for e in rk.evals))
    assert w.core.view.eval_pending is not None and w.core.eval_holds_sync()
    # every rank steps once more: the gate would fire, but the eval runs
    for _ in range(4):
        msg = ranks.next()
        assert msg is not None
        w.send(*msg)
        w.tick()
    assert sent(w.commands, SyncNow) == []
    w.send(w.core.view.eval_pending, EvalResult(epoch=0, metrics={"acc": 0.5}, elapsed_ms=30.0))
    (told,) = sent(w.commands, EvalBroadcast)
    assert told.to == (0, 1) and told.payload.epoch == 0 and told.payload.metrics == {"acc": 0.5}, "every rank hears it"
    w.tick()
    assert len(sent(w.commands, SyncNow)) == 1


# -- bundles the core decides on ------------------------------------------------------------------
def test_an_epoch_boundary_bundle_holds_the_next_epoch_until_it_is_written() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_sync", 2, epochs=3, **{"checkpoint.every": 1}), clock)
    ranks = Ranks(2)
    play(w, ranks, clock, until=lambda: w.core.life.is_(Phase.CHECKPOINTING))
    assert {c.payload.epoch for c in sent(w.log + w.commands, StartEpoch)} == {0}, "epoch 1 waits for the bundle"
    play(w, ranks, clock)
    stems = list(w.store.metas)
    assert stems == ["bundle_epoch1", "bundle_epoch2", "bundle"], stems
    assert [w.store.metas[s].save_reason for s in stems] == ["periodic", "periodic", "completed"]
    assert w.core.life.status is Status.FINISHED


def test_an_at_epoch_bundle_records_the_coverage_of_the_open_epochs() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_cadence", 2, epochs=3, **{"checkpoint.at_epoch": 1}), clock)
    play(w, Ranks(2, slow={1: 3}), clock)
    meta = w.store.metas["bundle_at1"]
    assert meta.save_reason == "at_epoch" and meta.epoch <= 1 and meta.coverage is not None
    covered = {p["epoch"] for p in meta.coverage.per_epoch}
    assert covered and max(covered) <= 1
    assert emitted(w.log, "checkpoint")[0]["reason"] == "at_epoch"
    assert w.core.life.status is Status.FINISHED


# -- deaths ----------------------------------------------------------------------------------------------
def coverage_is_exact(core: ControlCore, total: int) -> bool:
    for ranges in core.dispatch.coverage.values():
        picks = sorted(x for off, n in ranges for x in range(off, off + n))
        if picks != list(range(total // BATCH * BATCH)):
            return False
    return len(core.dispatch.coverage) == core.epochs


def test_a_death_during_a_reduce_finishes_it_without_the_dead_and_retrains_its_picks() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 3), clock)
    ranks = Ranks(3)
    ranks.hold_acks = {2}
    play(w, ranks, clock, samples=120, until=lambda: w.core.cycle.in_flight is not None
         and set(w.core.cycle.in_flight.acks) == {0, 1})
    w.take()
    ranks.dead.add(2)
    w.core.on_death(2, "connection closed")
    out = w.commands
    assert w.core.cycle.in_flight is None, "the survivors' answers finish the reduce"
    assert [c.rank for c in sent(out, RequestSession)] == [0], "a regroup: the lowest survivor makes the session"
    assert emitted(out, "rank_dead")[0]["rank"] == 2
    play(w, ranks, clock, samples=120)
    regroups = [c.payload for c in sent(w.log, Regroup)]
    assert {tuple(p.ranks) for p in regroups} == {(0, 1)}
    assert w.core.life.status is Status.FINISHED and coverage_is_exact(w.core, 120)
    assert w.core.dispatch.lost_picks == 0


def test_a_node_loss_two_deaths_apart_regroups_once_with_the_survivors() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_cadence", 4), clock)
    ranks = Ranks(4)
    play(w, ranks, clock, samples=192, until=lambda: w.core.cohort.batches[3] >= 3)
    ranks.dead |= {2, 3}
    w.core.on_death(2, "connection closed")
    clock.advance(0.2)
    w.core.on_death(3, "connection closed")
    (ask,) = sent(w.commands, RequestSession)
    play(w, ranks, clock, samples=192)
    regroups = {tuple(c.payload.ranks) for c in sent(w.log, Regroup)}
    assert regroups == {(0, 1)}, "the second death is folded into the pending regroup"
    assert w.core.cohort.generation == 1
    assert w.core.life.status is Status.FINISHED and coverage_is_exact(w.core, 192)


def test_losing_more_ranks_than_max_failure_ends_in_a_failure_bundle() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_cadence", 3, **{"cluster.max_failure": 1}), clock)
    ranks = Ranks(3)
    play(w, ranks, clock, until=lambda: w.core.cohort.batches[2] >= 2)
    ranks.dead.add(2)
    w.core.on_death(2, "connection closed")
    assert w.core.life.is_(Phase.SAVING)
    assert {c.rank for c in sent(w.commands, Save)} == {0, 1}
    play(w, ranks, clock)
    assert w.store.metas["bundle_failure"].save_reason == "max_failure_exceeded"
    assert w.core.life.status is Status.FAILED and "max_failure_exceeded" in (w.core.life.failure or "")


# -- preemption at every stage ------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "when"), [("nccl_cadence", "training"), ("cpu_sync", "training"),
                                            ("cpu_sync", "checkpointing"), ("cpu_async", "draining"),
                                            ("nccl_cadence", "finishing")])
def test_preemption_at_every_stage(mode: str, when: str) -> None:
    clock = FakeClock()
    w = Bare(cfg_of(mode, 2, epochs=3, **({"checkpoint.every": 1} if when == "checkpointing" else {})), clock)
    ranks = Ranks(2)
    phase = {"training": Phase.TRAINING, "checkpointing": Phase.CHECKPOINTING, "draining": Phase.DRAINING,
             "finishing": Phase.FINISHING}[when]
    play(w, ranks, clock, until=lambda: w.core.life.is_(phase) and (when != "training" or w.core.cycle.version >= 2))
    w.core.request_preempt()
    play(w, ranks, clock)
    log = w.log + w.commands
    if when in ("draining", "finishing"):
        assert emitted(log, "preempt_ignored") and w.core.life.status is Status.FINISHED
        assert w.store.preempted is None
        return
    assert w.core.life.status is Status.PREEMPTED
    meta = w.store.metas["bundle_preempt0"]
    assert meta.save_reason == "preempted"
    assert w.store.preempted == {"attempt": 0, "stem": "bundle_preempt0", "epoch": meta.epoch,
                                 "global_step": w.core.cycle.global_step}
    if when == "checkpointing":
        assert "bundle_epoch1" in w.store.metas, "the bundle in progress is written first"
    if mode == "nccl_cadence":
        assert meta.coverage is not None and meta.coverage.per_epoch, "progressive: the coverage of the open epoch, no extra reduce"


# -- callback slack ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "progressive"), [("nccl_cadence", True), ("nccl_cadence", False),
                                                   ("cpu_cadence", False)])
def test_callback_slack_gives_the_eval_rank_less_work_in_the_eval_window(mode: str, progressive: bool) -> None:
    """Progressive or not (issue 29: a non-progressive cadence run's eval rank made its peers wait)."""
    clock = FakeClock()
    w = Bare(cfg_of(mode, 2, epochs=4, **{"eval.every": 1, "eval.callback_slack": True,
                                          "mode.progressive_dispatch": progressive}), clock)
    assert w.core.shape.progressive is progressive
    play(w, Ranks(2, eval_ms=400.0), clock, samples=192)
    slack = emitted(w.log, "callback_slack")
    assert slack, "no window was shortened for an eval"
    cb = w.core.cohort.callback_rank
    assert {e["rank"] for e in slack} == {cb} and all(e["ms"] > 0 for e in slack)
    assert len({e["epoch"] for e in slack}) == len(slack), "once per epoch"
    assert w.core.life.status is Status.FINISHED


# -- one core, three wirings -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nccl_sync", "nccl_cadence", "cpu_cadence", "cpu_async"])
def test_the_coordinator_and_the_simulator_drive_the_core_to_the_same_commands(mode: str, tmp_path: Any) -> None:
    sim = SimulateConfig(ranks=[RankGroupConfig(count=1, speed=1.0), RankGroupConfig(count=1, speed=0.5)],
                         samples=160, batch_size=BATCH, epochs=2, link=LinkConfig())
    run = run_config(sim, mode, 2)
    traces = []
    for make in (lambda c: Bare(run, c), lambda c: AsCoordinator(run, c, tmp_path),
                 lambda c: AsSimulator(sim, mode, c)):
        clock = FakeClock()
        trace: list[Any] = []
        wiring = make(clock)
        ranks = Ranks(2, slow={1: 2})
        # to the final eval: what follows (the bundle's saves) is the shell's, which the simulator does not model
        play(wiring, ranks, clock, samples=160, trace=trace, until=_final_eval_asked(ranks))
        assert wiring.core.life.is_(Phase.FINISHING)
        shell = ("Save", "FormGroup")  # the shell's: the bundle's pieces, the collective chosen from the hellos
        traces.append([(t[0], [m for m in t[1] if m[1][0] not in shell]) if t[0] == "out" else t for t in trace])
    bare, coord, simulated = traces
    assert len(bare) > 60 and any(t[0] == "out" and any(m[1][0] == "EpochAggregated" for m in t[1]) for t in bare)
    assert coord == bare, "the coordinator's wiring decided otherwise than the bare core"
    assert simulated == bare, "the simulator's wiring decided otherwise than the bare core"


def test_the_simulator_keeps_no_copy_of_the_coordinators_glue() -> None:
    import inspect

    from flodl_exp.simulate import engine

    src = inspect.getsource(engine)
    for name in ("_after_reduce", "_aggregate(", "_drain_or_finish", "should_average", "try_finish", ".trigger(",
                 "pop_aggregated", "on_reduce_finished(out"):
        assert name not in src, f"simulate/engine.py has {name}: a decision belongs to the control core"
    assert isinstance(Engine(SimulateConfig(), "nccl_cadence").core, ControlCore)

