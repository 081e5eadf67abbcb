"""Overlapped averaging (``mode.overlap``, issue 51) in the control core: scripted ranks, no process, no socket.

A reduce asks the ranks to train on (cpu: ``RequestParams.overlap``, no barrier; nccl: ``SyncNow.overlap``, the ack
comes once the rank's all-reduce landed) and hands each idle rank its next window's chunk with the request; what a rank reports past its answer is its next window's; a consensus reduce (the end of
training) still waits; a rank that dies with a reduce in flight loses no trained pick; every pick is trained once."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from control_fakes import FakeClock, ScriptedRun, make_config

from flodl_exp.config import RunShape, load_config
from flodl_exp.core.commands import RankDeath, RankJoined, TrainingStarts
from flodl_exp.core.control_core import recording_core
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
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
from flodl_exp.torch_averager import TorchAverager

BATCH = 8
SAMPLES = 192
WORLD = 3
TURNS = (0, 0, 0, 1, 2)
"""Whose batch comes next, cycled: rank 0 trains three batches for every one of ranks 1 and 2 (a 3:1 rig)."""


class OverlapRanks:
    """Ranks as rank/control.py runs them: a RequestParams is answered at once with the steps since the last answer
    (``hold``: that rank's snapshot waits until :meth:`release`), and with ``overlap`` the rank trains on; its update is
    then a correction (its steps since the answer are kept). nccl: a SyncNow's all-reduce lands at once (``hold``: that
    rank's lands, and it acks, only at :meth:`release`; with ``overlap`` it trains on meanwhile)."""

    def __init__(self) -> None:
        self.plans: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(WORLD)}
        self.chunk: dict[int, Optional[list[int]]] = {r: None for r in range(WORLD)}
        self.since = {r: 0 for r in range(WORLD)}
        """Steps since the last answer (or the last full adoption): a snapshot's ``n``."""
        self.blocked = {r: False for r in range(WORLD)}
        self.sent: dict[int, int] = {}
        """Rank -> the overlapped reduce it answered and awaits the update of."""
        self.requests: list[tuple[int, RequestParams | SyncNow]] = []
        self.log: list[tuple[int, Payload]] = []
        """Every message to a rank, in order."""
        self.trained: dict[int, list[tuple[int, int]]] = {r: [] for r in range(WORLD)}
        """Each rank's trained batches in order, as (epoch, first pick)."""
        self.answered_at: dict[int, dict[int, int]] = {r: {} for r in range(WORLD)}
        """Rank -> reduce version -> how many of its trained batches its answer to it held."""
        self.trained_in_flight = {r: 0 for r in range(WORLD)}
        """Batches each rank trained while it awaited an overlapped reduce's update."""
        self.hold: set[int] = set()
        self.held: dict[int, Snapshot | SyncAck] = {}
        self.dead: set[int] = set()
        self.final_evals: list[int] = []
        self.shutdown = False
        self.turn = 0
        self.generation = 0
        self.answer_after: dict[int, int] = {}
        """Rank -> batches it trains before it reads its next request (it travels while the rank trains)."""
        self.late: dict[int, tuple[RequestParams | SyncNow, int]] = {}
        """Rank -> the request it has not read yet and the batches it trains first."""
        self.held_ms: dict[int, float] = {}
        """Rank -> the ``held_ms`` its overlapped answers carry (none: they carry none)."""

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        answers: list[tuple[int, Payload]] = []
        for r, p in out:
            if r in self.dead:
                continue
            self.log.append((r, p))
            if isinstance(p, (StartEpoch, ExtendPartition)):
                self.plans[r].append((p.epoch, p.chunk, p.offset, p.size // BATCH))
            elif isinstance(p, (RequestParams, SyncNow)) and r in self.answer_after:
                self.late[r] = (p, self.answer_after.pop(r))  # it trains on a little before it reads the request
            elif isinstance(p, (RequestParams, SyncNow)):
                answer = self._answer(r, p)
                if r in self.hold:
                    self.held[r] = answer
                else:
                    answers.append((r, answer))
            elif isinstance(p, RequestSession):
                answers.append((r, SessionReady(generation=p.generation, session="s")))
            elif isinstance(p, Regroup):
                self.generation = p.generation
            elif isinstance(p, Update):
                if self.sent.pop(r, None) is None:
                    self.since[r] = 0  # a full adoption resets the window
                self.blocked[r] = False
                if p.next_plan is not None:
                    e, off, size, cid = p.next_plan
                    self.plans[r].append((e, cid, off, size // BATCH))
            elif isinstance(p, ExecuteEval) and p.final:
                self.final_evals.append(r)
            elif isinstance(p, Save):
                answers.append((r, SaveResult(stem=p.stem)))
            elif isinstance(p, Shutdown):
                self.shutdown = True
        return answers

    def _answer(self, r: int, p: RequestParams | SyncNow) -> Snapshot | SyncAck:
        """cpu: the snapshot (with ``overlap`` the rank trains on); nccl: the ack once its all-reduce landed (a held
        one lands at :meth:`release`: meanwhile the rank trains on with ``overlap``, else it waits in it)."""
        assert r not in self.sent, "a second reduce reached a rank with one in flight"
        self.requests.append((r, p))
        self.answered_at[r][p.version] = len(self.trained[r])
        n, self.since[r] = self.since[r], (0 if p.overlap or isinstance(p, SyncNow) else self.since[r])
        held = self.held_ms.get(r) if p.overlap else None
        if isinstance(p, SyncNow):
            if r in self.hold:
                self.sent[r] = p.version
                self.blocked[r] = not p.overlap
            return SyncAck(n=n, d=0.01, version=p.version, generation=self.generation, held_ms=held)
        if p.overlap:
            self.sent[r] = p.version
        self.blocked[r] = p.barrier
        return Snapshot(n=n, version=p.version, tensors={"p0": torch.full((4,), float(r + p.version)),
                                                         "b0": torch.zeros(2)}, held_ms=held)

    def past(self, r: int, version: int) -> int:
        """Batches ``r`` trained after its answer to reduce ``version``."""
        return len(self.trained[r]) - self.answered_at[r][version]

    def release(self, r: int) -> list[tuple[int, Payload]]:
        self.hold.discard(r)
        snap = self.held.pop(r, None)
        if isinstance(snap, SyncAck):  # the all-reduce landed: the rank acks and is done with it
            self.sent.pop(r, None)
            self.blocked[r] = False
        return [] if snap is None else [(r, snap)]

    def next(self) -> Optional[tuple[int, Payload]]:
        for _ in range(len(TURNS)):
            r = TURNS[self.turn % len(TURNS)]
            self.turn += 1
            if r in self.dead or self.blocked[r]:
                continue
            if r in self.late and self.late[r][1] <= 0:
                return r, self._answer(r, self.late.pop(r)[0])
            if self.chunk[r] is None and self.plans[r]:
                e, cid, off, nb = self.plans[r].pop(0)
                self.chunk[r] = [e, cid, off, nb, 0]
            ch = self.chunk[r]
            if ch is None:
                continue
            e, cid, off, nb, done = ch
            if done < nb:
                ch[4] += 1
                self.since[r] += 1
                if r in self.late:
                    self.late[r] = (self.late[r][0], self.late[r][1] - 1)
                self.trained[r].append((e, off + done * BATCH))
                if r in self.sent:
                    self.trained_in_flight[r] += 1
                return r, Batch(ms=30.0 if r else 10.0, data_ms=1.0, chunk=cid, loss=0.5, lr=0.01)
            self.chunk[r] = None
            return r, ChunkMetrics(epoch=e, chunk=cid, avg_loss=0.5, batches=done, samples=done * BATCH,
                                   epoch_ms=10.0 * done, share_complete_ms=11.0 * done, compute_only_ms=10.0 * done,
                                   data_starve_ms=1.0 * done, ranges=[[off, done * BATCH]] if done else [],
                                   loss_batches=done)
        return None


class Run(ScriptedRun):
    def __init__(self, mode: str = "cpu_cadence", epochs: int = 2, overrides: Optional[dict[str, Any]] = None) -> None:
        cfg = load_config(make_config(mode, WORLD, epochs, **{"mode.overlap": True, **(overrides or {})}))
        clock = FakeClock()
        core, commands = recording_core(cfg, clock, averager=TorchAverager(RunShape.of(cfg).outer))
        self.ranks: OverlapRanks
        super().__init__(core, commands, clock, OverlapRanks())

    def start(self) -> None:
        for r in range(WORLD):
            self.handle(RankJoined(r, 0.0))
        self.handle(TrainingStarts(SAMPLES, None, self.clock()))

    def finish(self) -> None:
        """Play to the end: FINISHED, every pick of every epoch trained exactly once."""
        self.play()
        assert self.core.life.status.name == "FINISHED"
        assert self.core.dispatch.lost_picks == 0
        cov = self.core.dispatch.coverage
        assert sorted(cov) == list(range(self.core.epochs))
        for e, ranges in cov.items():
            hits = [0] * SAMPLES
            for off, size in ranges:
                for i in range(off, off + size):
                    hits[i] += 1
            assert set(hits) == {1}, f"epoch {e}: picks trained {sorted(set(hits))} times"
        # every batch in exactly one reduce (cpu_async without overlap counts its post-snapshot batches in none)
        assert self.core.cycle.global_step == self.core.epochs * SAMPLES // BATCH


MODES = ["cpu_cadence", "cpu_async", "nccl_cadence", "nccl_sync"]


@pytest.mark.parametrize("mode", MODES)
def test_an_overlapped_run_trains_through_its_reduces_and_covers_every_pick_once(mode: str) -> None:
    run = Run(mode)
    run.start()
    run.finish()
    reqs = [p for _, p in run.ranks.requests]
    overlapped = [p for p in reqs if p.overlap]
    assert overlapped, "the window reduces let the ranks train on"
    assert all(isinstance(p, SyncNow) == mode.startswith("nccl") for p in reqs)
    assert all(not p.barrier for p in overlapped if isinstance(p, RequestParams))
    assert all(p.barrier for p in reqs if isinstance(p, RequestParams) and not p.overlap), (
        "a consensus reduce (the end of training) still waits")


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_a_rank_gets_its_next_window_while_the_reduce_is_in_flight(mode: str) -> None:
    run = Run(mode)
    run.ranks.hold = {1}  # the slow rank's answer waits: the reduce stays in flight
    run.start()
    run.play(until=lambda: 1 in run.ranks.held)
    v = run.core.syncs
    req = next(p for r, p in run.ranks.requests if r == 0 and p.version == v)
    at = run.ranks.log.index((0, req))
    run.play(until=lambda: any(isinstance(p, StartEpoch) for q, p in run.ranks.log[at:] if q == 0))
    assert run.core.syncs == v and not any(isinstance(p, Update) for q, p in run.ranks.log[at:] if q == 0)
    run.pending += run.ranks.release(1)
    run.finish()


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_steps_past_the_answer_count_toward_the_next_window(mode: str) -> None:
    run = Run(mode)
    run.ranks.hold = {1}  # the slow rank's answer waits: ranks 0 and 2 train on meanwhile
    run.start()
    run.play(until=lambda: 1 in run.ranks.held)
    v = run.core.syncs
    run.play(until=lambda: run.ranks.past(0, v) >= 3)
    trained = run.ranks.past(0, v)
    assert run.core.cycle.window_steps(0) == trained, "its steps past its answer are its next window's"
    assert run.core.syncs == v, "the reduce waits for rank 1"
    run.pending += run.ranks.release(1)
    run.play(until=lambda: run.core.syncs > v)
    assert run.core.cycle.steps(0) >= trained, "the finish keeps them (a cpu reduce without overlap resets to 0)"
    run.finish()


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_dead_with_an_overlapped_reduce_in_flight_loses_no_pick(mode: str) -> None:
    run = Run(mode, overrides={"cluster.max_failure": 2})
    run.ranks.hold = {1}
    run.start()
    run.play(until=lambda: 1 in run.ranks.held)
    v = run.core.syncs
    run.play(until=lambda: run.ranks.past(2, v) >= 1)  # rank 2 answered and trained on
    run.ranks.dead.add(2)
    run.handle(RankDeath(2, "killed", run.clock()))
    run.pending += run.ranks.release(1)
    run.finish()


@pytest.mark.parametrize(("mode", "late_ack"), [("cpu_cadence", False), ("nccl_cadence", False),
                                               ("nccl_cadence", True)])
def test_what_a_rank_trained_past_its_answer_is_trained_again_when_it_dies_after_the_finish(mode: str,
                                                                                           late_ack: bool) -> None:
    """Rank 2 answers, trains its next window's chunk to its end while the reduce is in flight, and dies right after
    the reduce finished: that chunk is in no consensus, so each of its picks is handed to a survivor again.
    ``late_ack`` (nccl): rank 2's all-reduce lands, and it acks, only after that chunk ended (its ack comes long after
    the replica it sent: the chunk finished before the ack still holds the next window's batches)."""
    run = Run(mode, overrides={"cluster.max_failure": 2})
    run.ranks.hold = {1, 2} if late_ack else {1}
    run.start()
    run.play(until=lambda: 1 in run.ranks.held)
    v = run.core.syncs
    ranks = run.ranks
    run.play(until=lambda: ranks.past(2, v) > 0 and ranks.chunk[2] is None and not ranks.plans[2])
    run.pending += ranks.release(2)
    run.pending += ranks.release(1)
    run.play(until=lambda: run.core.syncs > v)
    past = ranks.trained[2][ranks.answered_at[2][v]:]
    assert past, "rank 2 trained past its answer"
    ranks.dead.add(2)
    at = len(ranks.log)
    run.handle(RankDeath(2, "killed", run.clock()))
    run.finish()
    again = [(p.epoch, p.offset, p.size) for q, p in ranks.log[at:] if isinstance(p, (StartEpoch, ExtendPartition))]
    for e, first in past:
        assert any(e == oe and oo <= first < oo + size for oe, oo, size in again), (
            f"pick {first} of epoch {e}, trained by the dead rank past its answer, was not handed out again")


def test_without_overlap_a_cadence_reduce_is_a_barrier() -> None:
    run = Run(overrides={"mode.overlap": False})
    run.start()
    run.finish()
    assert all(isinstance(p, RequestParams) and p.barrier and not p.overlap for _, p in run.ranks.requests)
    assert sum(run.ranks.trained_in_flight.values()) == 0


def _spy_in_flight(run: Run, obj: Any, name: str) -> list[tuple[dict[int, int], bool]]:
    """Wrap ``obj.name``: each call records the ranks with an overlapped answer in flight and whether the last request
    was an overlapped one (a bundle must see neither)."""
    seen: list[tuple[dict[int, int], bool]] = []
    real = getattr(obj, name)

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append((dict(run.ranks.sent), run.ranks.requests[-1][1].overlap))
        return real(*a, **kw)

    setattr(obj, name, spy)
    return seen


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async", "nccl_cadence"])
def test_a_coverage_bundle_waits_for_a_barrier_reduce(mode: str) -> None:
    """A bundle's coverage must match its consensus: at an overlapped reduce's finish the ranks hold picks trained past
    their answers that the consensus lacks, so a due bundle is taken at the finish of a barrier reduce fired at once
    (every rank answered it with all it trained, none trains on), never at the overlapped one's."""
    run = Run(mode, epochs=4, overrides={"checkpoint.every": 1})
    taken = _spy_in_flight(run, run.core.checkpoints, "_take")
    run.start()
    run.finish()
    assert len(taken) >= 2, "a bundle every epoch"
    for sent, overlapped in taken:
        assert not sent and not overlapped, "a bundle taken while ranks trained past an overlapped answer"
    assert any(p.overlap for _, p in run.ranks.requests), "the window reduces still overlap"


def test_an_epoch_boundary_bundle_of_overlapped_nccl_sync_follows_a_consensus_reduce() -> None:
    """nccl_sync (not progressive) takes its bundle at an epoch boundary, held there: the overlapped reduce in flight
    finishes, a consensus reduce (no overlap) takes in what the ranks trained past their answers, then the saves."""
    run = Run("nccl_sync", epochs=4, overrides={"checkpoint.every": 1})
    saves = _spy_in_flight(run, run.core.checkpoints._writer, "send_saves")
    run.start()
    run.finish()
    assert len(saves) >= 3, "a bundle at each boundary but the last (and the final one)"
    for sent, overlapped in saves:
        assert not sent and not overlapped, "a bundle saved while ranks trained past an overlapped answer"
    assert any(p.overlap for _, p in run.ranks.requests), "the step reduces overlap"


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_an_answer_that_came_after_more_steps_sizes_the_next_window_from_its_n(mode: str) -> None:
    """A rank trains on while the request travels: its answer holds more steps than it had at the trigger, and only
    the steps past its answer are its next window's (the snapshot's or the ack's ``n``)."""
    run = Run(mode)
    ranks = run.ranks
    ranks.hold = {1}  # the reduce stays in flight
    ranks.answer_after = {0: 2}
    run.start()
    run.play(until=lambda: 1 in ranks.held)
    v = run.core.syncs
    run.play(until=lambda: v in ranks.answered_at[0] and ranks.past(0, v) >= 1)
    assert run.core.cycle.window_steps(0) == ranks.past(0, v), "the steps its answer holds are not its next window's"
    run.pending += ranks.release(1)
    run.finish()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("said", [True, False])
def test_elche_takes_an_overlapped_reduce_s_cost_from_the_ranks_answers(mode: str, said: bool) -> None:
    """With overlap the ranks train through a reduce: ElChe's overhead (``sync_ms``) is the most any rank says its
    training stood still for it (``held_ms``), not the reduce's length; when no answer says, the length as before."""
    run = Run(mode)
    if said:
        run.ranks.held_ms = {0: 1.5, 1: 4.0, 2: 2.5}
    fed: list[float] = []
    elche = run.core.cycle._elche
    assert elche is not None
    report = elche.report_window

    def spy(rep: Any) -> None:
        fed.append(rep.sync_ms)
        report(rep)

    elche.report_window = spy

    def reduce_runs_on() -> bool:
        red = run.core.cycle._in_flight
        if red is not None and red.overlap:
            run.clock.advance(0.01)  # each step of an overlapped reduce takes 10 ms of the scripted clock
        return False

    run.start()
    run.play(until=reduce_runs_on)
    run.finish()
    overlapped = [p.version for r, p in run.ranks.requests if r == 0 and p.overlap]
    assert len(overlapped) >= 2 and len(fed) >= len(overlapped)
    for v in overlapped:
        if said:
            assert fed[v] == 4.0, f"reduce {v}: ElChe was fed {fed[v]} ms, not the most any rank was held"
        else:
            assert fed[v] >= 20.0, f"reduce {v}: no rank said, so its length is the cost (fed {fed[v]} ms)"
    assert all(x >= 0.0 for x in fed)
