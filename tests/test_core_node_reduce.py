"""Hierarchical cpu averaging (``cluster.node_reduce``, issue 52 item 2) in the control core: scripted ranks on two
nodes, their leaders answering with node partials; no process, no socket.

The consensus the core sends the leaders is the flat reduce's to the bit; a reduce finishes only once every leader's
drift read-out is in (the guard reads every rank's); a leader that dies holding the consensus leaves its members
their update sent directly; a member that died after its leader summed it is in the consensus, and its picks are
not trained again."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from control_fakes import FakeClock, ScriptedRun, make_config

from flodl_exp.averaging import weighted_average
from flodl_exp.config import RunShape, load_config
from flodl_exp.core.commands import RankDeath, RankJoined, RankMessage, TrainingStarts
from flodl_exp.core.control_core import recording_core
from flodl_exp.core.node_groups import node_groups, relay_prefix
from flodl_exp.node_average import member_update, node_drift, node_partial
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    ExecuteEval,
    ExtendPartition,
    NodeDrift,
    NodeDrop,
    NodeGroup,
    NodeUpdate,
    Payload,
    RequestParams,
    Save,
    SaveResult,
    Shutdown,
    Snapshot,
    StartEpoch,
    Update,
)
from flodl_exp.torch_averager import TorchAverager

BATCH = 8
HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}


def test_node_groups_follow_the_hosts_and_leave_single_ranks_out() -> None:
    g = node_groups({0: "a", 1: "b", 2: "a", 3: "c", 4: "unknown", 5: "unknown"})
    assert g.members == {0: [0, 2]}
    assert g.leader_of(2) == 0 and g.leader_of(1) is None
    msgs = g.messages("p")
    assert [(r, m.leader, m.members, m.address) for r, m in msgs] == [(0, 0, [0, 2], "p-0"), (2, 0, [0, 2], "p-0")]
    assert relay_prefix("/jobs/a", 0) != relay_prefix("/jobs/a", 1) != relay_prefix("/jobs/b", 0)


class NodeRanks:
    """Four ranks on two nodes (leaders 0 and 2) that train one batch a turn and answer at once: each leader sums
    its node's snapshots into a partial (the real arithmetic), hands its members the update and reports their
    drift. ``hold_drift``: leaders that keep their drift (and their members' updates) until released."""

    def __init__(self) -> None:
        self.plans: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in HOSTS}
        self.chunk: dict[int, Optional[list[int]]] = {r: None for r in HOSTS}
        self.steps = {r: 0 for r in HOSTS}
        self.blocked = {r: False for r in HOSTS}
        self.groups: dict[int, list[int]] = {}
        self.snaps: dict[int, dict[int, Snapshot]] = {}
        self.sent_snaps: dict[int, list[Snapshot]] = {}
        self.dead: set[int] = set()
        self.hold_drift: set[int] = set()
        self.drops: list[tuple[int, int]] = []
        """NodeDrop as (to, dead rank)."""
        self.hold_partial: set[int] = set()
        """Leaders whose partial waits (each member's snapshot in) until the test sends it (:meth:`send_partial`)."""
        self.held: list[tuple[int, NodeUpdate]] = []
        self.node_updates: list[tuple[int, NodeUpdate]] = []
        self.direct_updates: list[tuple[int, Update]] = []
        self.partials: list[tuple[int, Any]] = []
        self.final_evals: list[int] = []
        self.offered: dict[int, int] = {}
        """Picks handed out per epoch (chunks and extensions): each epoch's once, unless some are trained again."""
        self.shutdown = False
        self.turn = 0
        self.sent: set[int] = set()
        """Ranks that answered an overlapped reduce (``mode.overlap``) and train on: their update keeps their steps."""
        self.trained: dict[int, list[tuple[int, int]]] = {r: [] for r in HOSTS}
        """Each rank's trained batches in order, as (epoch, first pick)."""
        self.answered_at: dict[int, dict[int, int]] = {r: {} for r in HOSTS}
        """Rank -> reduce version -> how many of its trained batches its answer held."""
        self.handed: list[tuple[int, int, int, int]] = []
        """Every chunk and extension handed out, in order: (rank, epoch, offset, size)."""

    def snapshot(self, r: int, version: int) -> Snapshot:
        g = torch.Generator().manual_seed(1000 * version + r)
        return Snapshot(n=self.steps[r], version=version,
                        tensors={"p0": torch.randn(5, 3, generator=g), "p1": torch.randn(3, generator=g),
                                 "b0": torch.randn(3, generator=g)})

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        answers: list[tuple[int, Payload]] = []
        for r, p in out:
            if r in self.dead:
                continue
            if isinstance(p, NodeGroup):
                self.groups[p.leader] = list(p.members)
            elif isinstance(p, NodeDrop):
                self.drops.append((r, p.rank))
            elif isinstance(p, (StartEpoch, ExtendPartition)):
                self.plans[r].append((p.epoch, p.chunk, p.offset, p.size // BATCH))
                self.offered[p.epoch] = self.offered.get(p.epoch, 0) + p.size
                self.handed.append((r, p.epoch, p.offset, p.size))
            elif isinstance(p, RequestParams):
                answers += self.answer(r, p)
            elif isinstance(p, NodeUpdate):
                self.node_updates.append((r, p))
                if r in self.hold_drift:
                    self.held.append((r, p))
                else:
                    answers += self.hand_on(r, p)
            elif isinstance(p, Update):
                self.direct_updates.append((r, p))
                self.adopt(r)
            elif isinstance(p, ExecuteEval) and p.final:
                self.final_evals.append(r)
            elif isinstance(p, Save):
                answers.append((r, SaveResult(stem=p.stem)))
            elif isinstance(p, Shutdown):
                self.shutdown = True
        return answers

    def answer(self, r: int, p: RequestParams) -> list[tuple[int, Payload]]:
        """A snapshot for ``p``: to the node's leader (its partial once every live member's is in), or directly."""
        self.blocked[r] = p.barrier
        leader = next((q for q, ms in self.groups.items() if r in ms), None)
        snap = self.snapshot(r, p.version)
        self.answered_at[r][p.version] = len(self.trained[r])
        if p.overlap:  # trains on: its steps from here are its next window's
            self.steps[r] = 0
            self.sent.add(r)
        if leader is None or leader in self.dead:  # no group, or its relay broke: answer directly
            return [(r, snap)]
        got = self.snaps.setdefault(leader, {})
        got[r] = snap
        members = [q for q in self.groups[leader] if q not in self.dead]
        if not (set(members) <= set(got) and leader not in self.dead and leader not in self.hold_partial):
            return []
        ranks = sorted(got)
        snaps = [got[q] for q in ranks]
        self.sent_snaps[leader] = snaps
        self.snaps[leader] = {}
        part = node_partial(p.version, ranks, snaps, 1.0)
        self.partials.append((leader, part))
        return [(leader, part)]

    def adopt(self, r: int) -> None:
        """An update adopted: the window restarts, or (overlapped) goes on from the answer."""
        if r in self.sent:
            self.sent.discard(r)
        else:
            self.steps[r] = 0
        self.blocked[r] = False

    def send_partial(self, leader: int, without: tuple[int, ...] = ()) -> list[tuple[int, Payload]]:
        """A held partial of ``leader``'s node, leaving ``without`` out (a member its relay dropped)."""
        got = {r: s for r, s in self.snaps[leader].items() if r not in without}
        ranks = sorted(got)
        snaps = [got[q] for q in ranks]
        self.sent_snaps[leader] = snaps
        self.snaps[leader] = {}
        part = node_partial(snaps[0].version or 0, ranks, snaps, 1.0)
        self.partials.append((leader, part))
        return [(leader, part)]

    def hand_on(self, leader: int, p: NodeUpdate) -> list[tuple[int, Payload]]:
        for q in p.ranks:
            if q not in self.dead:
                member_update(p, q)
                self.adopt(q)
        snaps = [s for s in self.sent_snaps[leader] if s is not None]
        ranks = [q for q in sorted(self.groups[leader]) if q in p.ranks]
        snaps = snaps[:len(ranks)]
        return [(leader, NodeDrift(version=p.version, ranks=list(p.ranks), drift=node_drift(snaps, p)))]

    def next(self) -> Optional[tuple[int, Payload]]:
        ready = []
        for r in HOSTS:
            if r in self.dead or self.blocked[r]:
                continue
            if self.chunk[r] is None and self.plans[r]:
                e, cid, off, nb = self.plans[r].pop(0)
                self.chunk[r] = [e, cid, off, nb, 0]
            if self.chunk[r] is not None:
                ready.append(r)
        if not ready:
            return None
        r = ready[self.turn % len(ready)]
        self.turn += 1
        ch = self.chunk[r]
        assert ch is not None
        e, cid, off, nb, done = ch
        if done < nb:
            ch[4] += 1
            self.steps[r] += 1
            self.trained[r].append((e, off + done * BATCH))
            return r, Batch(ms=10.0, data_ms=1.0, chunk=cid, loss=0.5, lr=0.01)
        self.chunk[r] = None
        return r, ChunkMetrics(epoch=e, chunk=cid, avg_loss=0.5, batches=done, samples=done * BATCH,
                               epoch_ms=10.0 * done, share_complete_ms=11.0 * done, compute_only_ms=10.0 * done,
                               data_starve_ms=1.0 * done, ranges=[[off, done * BATCH]] if done else [],
                               loss_batches=done)


class Run(ScriptedRun):
    def __init__(self, epochs: int = 2, **overrides: Any) -> None:
        cfg = load_config(make_config("cpu_cadence", 4, epochs, **{"cluster.node_reduce": True, **overrides}))
        clock = FakeClock()
        core, commands = recording_core(cfg, clock, averager=TorchAverager(RunShape.of(cfg).outer))
        self.ranks: NodeRanks
        super().__init__(core, commands, clock, NodeRanks())

    def start(self, samples: int = 192) -> None:
        for r, host in HOSTS.items():
            self.handle(RankJoined(r, 0.0, host))
        self.handle(TrainingStarts(samples, None, self.clock()))

    def held_at_drift(self, leader: int) -> int:
        """Start and play until ``leader`` holds a consensus (its drift kept back); the reduce's version."""
        self.ranks.hold_drift = {leader}
        self.start()
        self.play(until=lambda: bool(self.ranks.held))
        return self.core.syncs

    def release_drift(self) -> None:
        leader, upd = self.ranks.held.pop()
        self.ranks.hold_drift.clear()
        self.pending += self.ranks.hand_on(leader, upd)

    def finish(self) -> None:
        """Play to the end: FINISHED, every pick handed out once."""
        self.play()
        assert self.core.life.status.name == "FINISHED"
        assert self.core.dispatch.lost_picks == 0
        assert self.ranks.offered == {0: 192, 1: 192}, "every pick handed out once"


def test_a_run_on_two_nodes_reduces_through_the_leaders_with_the_flat_consensus() -> None:
    run = Run()
    run.start()
    run.play()
    assert run.ranks.shutdown and run.core.life.status.name == "FINISHED"
    assert run.ranks.groups == {0: [0, 1], 2: [2, 3]}
    assert run.ranks.node_updates, "the reduces went through the leaders"
    assert {r for r, _ in run.ranks.node_updates} == {0, 2}
    assert not run.ranks.direct_updates, "no rank was sent an update of its own"
    assert run.core.syncs == len(run.ranks.node_updates) // 2
    # Each reduce's consensus is the flat reduce's of the same snapshots, to the bit.
    checked = 0
    for v in sorted({p.version for _, p in run.ranks.partials}):
        snaps = [run.ranks.snapshot(r, v) for r in sorted(HOSTS)]
        ns = {r: n for _, p in run.ranks.partials if p.version == v for r, n in zip(p.ranks, p.ns)}
        for r, s in zip(sorted(HOSTS), snaps):
            s.n = ns[r]
        flat = weighted_average([s.n for s in snaps], [[s.tensors["p0"], s.tensors["p1"]] for s in snaps],
                                [[s.tensors["b0"]] for s in snaps], 1.0)
        ups = [u for _, u in run.ranks.node_updates if u.version == v]
        if flat is None:
            assert all(u.skip for u in ups)
            continue
        for u in ups:
            assert torch.equal(u.tensors["p0"], flat[0][0]) and torch.equal(u.tensors["p1"], flat[0][1])
            assert torch.equal(u.tensors["b0"], flat[1][0])
        checked += 1
    assert checked >= 2


def test_a_reduce_finishes_only_with_every_leaders_drift() -> None:
    run = Run()
    v = run.held_at_drift(2)
    with pytest.raises(AssertionError, match="nothing moves"):
        run.play()  # every answer delivered, the clock running: the reduce waits for node b's drift
    assert run.core.syncs == v, "no finish without node b's drift"
    run.release_drift()
    run.play(until=lambda: run.core.syncs > v)
    assert run.core.syncs == v + 1
    run.finish()


def test_a_member_dead_after_its_leader_summed_it_is_in_the_consensus() -> None:
    run = Run(**{"cluster.max_failure": 2})
    run.held_at_drift(0)
    run.ranks.dead.add(1)
    run.handle(RankDeath(1, "killed", run.clock()))
    run.release_drift()
    run.finish()  # its summed picks are not handed out again


def test_a_leader_dead_with_the_consensus_leaves_its_members_their_update() -> None:
    run = Run(**{"cluster.max_failure": 2})
    v = run.held_at_drift(2)
    run.ranks.dead.add(2)
    run.handle(RankDeath(2, "killed", run.clock()))
    assert any(r == 3 and u.version == v for r, u in run.ranks.direct_updates), "rank 3 got its update directly"
    run.play(until=lambda: run.core.syncs > v)
    assert run.core.syncs == v + 1
    run.finish()


def test_a_member_whose_relay_broke_after_the_partial_gets_its_update_directly() -> None:
    run = Run()
    v = run.held_at_drift(0)
    before = len(run.ranks.direct_updates)
    run.handle(RankMessage(1, run.ranks.snapshot(1, v), run.clock()))  # its snapshot again, directly
    assert [(r, u.version) for r, u in run.ranks.direct_updates[before:]] == [(1, v)]
    assert run.core.syncs == v, "the partial still answers for it: no second share"


def test_reports_a_partial_overtook_count_toward_no_later_window() -> None:
    from flodl_exp.core.cycle import Ledger

    led = Ledger(late=2)
    for _ in range(3):
        led.add(10.0, 1.0, 0.5)
    assert (led.steps, led.window_batches, led.late) == (1, 1, 0)


@pytest.mark.parametrize("summed", [True, False])
def test_a_member_dead_before_its_leaders_partial_is_held_until_it_shows(summed: bool) -> None:
    """The death reaches the coordinator before the partial: its picks wait for it. Summed: in the consensus, not
    handed out again; left out (its leader's relay dropped it): trained again by the survivors, once."""
    run = Run(**{"cluster.max_failure": 2})
    run.ranks.hold_partial = {0}
    run.start()
    run.play(until=lambda: len(run.ranks.snaps.get(0, {})) == 2)
    v = run.core.syncs
    steps = run.ranks.snaps[0][1].n
    run.ranks.dead.add(1)
    run.handle(RankDeath(1, "killed", run.clock()))
    assert run.ranks.drops == [(0, 1)], "its leader is told not to wait for it"
    run.ranks.hold_partial.clear()
    run.pending += run.ranks.send_partial(0, without=() if summed else (1,))
    run.play(until=lambda: run.core.syncs > v)
    run.play()
    assert run.core.life.status.name == "FINISHED"
    extra = 0 if summed else steps * BATCH
    assert sum(run.ranks.offered.values()) == 2 * 192 + extra


def test_overlapped_a_member_dead_before_the_partial_keeps_only_what_it_answered() -> None:
    """``mode.overlap``: member 1 hands its answer to its leader and trains on; its reports of those batches reach the
    coordinator, then it dies before the partial arrives. The partial sums its answer (it is in the consensus), but
    what it trained past the answer is in none: those picks are handed out again, the answered ones are not."""
    run = Run(**{"cluster.max_failure": 2, "mode.overlap": True})
    ranks = run.ranks
    ranks.hold_partial = {0}
    run.start()
    run.play(until=lambda: set(ranks.snaps.get(0, {})) == {0, 1})
    v = run.core.syncs
    run.play(until=lambda: len(ranks.trained[1]) - ranks.answered_at[1][v] >= 2)
    answered = ranks.trained[1][:ranks.answered_at[1][v]]
    past = ranks.trained[1][ranks.answered_at[1][v]:]
    ranks.dead.add(1)
    at = len(ranks.handed)
    run.handle(RankDeath(1, "killed", run.clock()))
    ranks.hold_partial.clear()
    run.pending += ranks.send_partial(0)
    run.play(until=lambda: run.core.syncs > v)
    run.play()
    assert run.core.life.status.name == "FINISHED" and run.core.dispatch.lost_picks == 0
    again = [(e, off, size) for q, e, off, size in ranks.handed[at:] if q != 1]

    def handed_again(e: int, first: int) -> bool:
        return any(e == oe and oo <= first < oo + size for oe, oo, size in again)

    assert past and all(handed_again(e, f) for e, f in past), "rank 1's picks past its answer were not trained again"
    answered_this_window = answered[-1:]  # its last answered batch: in the consensus, never handed out again
    assert not any(handed_again(e, f) for e, f in answered_this_window)


def test_a_rank_that_answered_directly_and_dies_while_the_drift_is_due_stays_in_the_consensus() -> None:
    """Leader 2 is gone, so rank 3 answers the coordinator itself; it dies after the consensus went out, while leader 0's
    drift is still due: its share is in the consensus, so its picks of that window are not handed out again."""
    run = Run(**{"cluster.max_failure": 3})
    ranks = run.ranks
    run.start()
    run.play(until=lambda: run.core.syncs >= 1)
    ranks.dead.add(2)
    run.handle(RankDeath(2, "killed", run.clock()))
    ranks.hold_drift = {0}
    run.play(until=lambda: bool(ranks.held))
    v = run.core.syncs
    n3 = next(u.n for r, u in ranks.direct_updates if r == 3 and u.version == v)
    window = ranks.trained[3][ranks.answered_at[3][v] - n3:ranks.answered_at[3][v]]
    assert window, "rank 3 answered with batches of its own"
    ranks.dead.add(3)
    at = len(ranks.handed)
    run.handle(RankDeath(3, "killed", run.clock()))
    run.release_drift()
    run.play()
    assert run.core.life.status.name == "FINISHED"
    again = [(e, off, size) for q, e, off, size in ranks.handed[at:]]
    assert not any(e == oe and oo <= f < oo + size for e, f in window for oe, oo, size in again), (
        "rank 3's picks in the consensus were handed out again")
