"""Hierarchical cpu averaging's rank side (rank/node_relay.py): a node leader and its members in one process, over
real abstract unix sockets (a fresh name per test), with a recorder for what the leader sends the coordinator.

What is pinned: the leader's NodePartial is node_partial of its node's snapshots and, divided at the coordinator,
gives the flat reduce's float32 consensus bit for bit; each member gets its Update, the coordinator the drift;
a member that leaves is not waited for (and re-sends its snapshot directly when the leader leaves it mid-reduce);
a wrong token or a rank outside the group is refused. Every wait has a deadline (a condition polled, bounded)."""
from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from rank_fakes import rank_control

from flodl_exp.averaging import divide_sums, weighted_average
from flodl_exp.node_average import member_update, node_drift, node_partial, partial_sums
from flodl_exp.protocol import wire
from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.messages import NodeDrift, NodeGroup, NodePartial, NodeUpdate, Payload, RequestParams, Snapshot, Update
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.node_relay import LeaderRelay, MemberRelay, open_relay

DEADLINE_S = 10.0
GAMMA = 0.5


def _address() -> str:
    return f"flodl-test-{uuid.uuid4().hex}"


def wait_for(cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    """Poll ``cond`` until it holds; fail after ``timeout`` (bounded in time and in count)."""
    end = time.monotonic() + timeout
    for _ in range(int(timeout / 0.005) + 1):
        if cond():
            return
        if time.monotonic() > end:
            break
        time.sleep(0.005)
    if not cond():
        pytest.fail(f"timed out waiting for {what}")


class Recorder:
    """A fake ``send``: the payloads, each through the wire's encoding and back (so each one is sendable)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self._lock = threading.Lock()

    def __call__(self, p: Payload) -> None:
        q = decode(encode(p))
        with self._lock:
            self.sent.append(q)

    def of(self, kind: type) -> list[Any]:
        with self._lock:
            return [p for p in self.sent if isinstance(p, kind)]


class Member:
    """A member's relay with the frames it was handed (its inbox) and what it sent the coordinator directly."""

    def __init__(self, address: str, rank: int, token: str, *, leader: int = 0, connect_timeout_s: float = DEADLINE_S) -> None:
        self.frames: queue.Queue[wire.Message] = queue.Queue()
        self.direct = Recorder()
        self.relay = MemberRelay(address, rank=rank, leader=leader, token=token, deliver=self.frames.put, send=self.direct,
                                 connect_timeout_s=connect_timeout_s)

    def next_update(self) -> Update:
        msg = self.frames.get(timeout=DEADLINE_S)
        u = decode(msg)
        assert isinstance(u, Update)
        return u


def _snapshot(seed: int, n: int, version: int) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    return Snapshot(n=n, version=version, tensors={"p0": torch.randn(3, 4, generator=g), "p1": torch.randn(5, generator=g),
                                                   "b0": torch.randn(2, generator=g)})


@pytest.fixture
def node() -> Iterator[SimpleNamespace]:
    """Leader 0 and members 1, 2 of one node, connected."""
    address, token = _address(), wire.new_token()
    out = Recorder()
    leader = LeaderRelay(address, rank=0, members=[0, 1, 2], token=token, send=out, gamma=GAMMA).start()
    members = {r: Member(address, r, token) for r in (1, 2)}
    try:
        for m in members.values():
            assert m.relay.connect(), "a member of the group connects"
        wait_for(lambda: leader.connected() == [1, 2], "both members connected")
        yield SimpleNamespace(address=address, token=token, out=out, leader=leader, members=members)
    finally:
        for m in members.values():
            m.relay.close()
        leader.close()


def test_the_partial_is_node_partial_of_the_snapshots_and_divides_to_the_flat_consensus(node):
    snaps = {0: _snapshot(0, 3, 7), 1: _snapshot(1, 5, 7), 2: _snapshot(2, 0, 7)}  # rank 2 did not move: no buffers from it
    assert node.members[1].relay.submit(snaps[1]) and node.members[2].relay.submit(snaps[2])
    assert node.leader.contribute(snaps[0])
    wait_for(lambda: bool(node.out.of(NodePartial)), "the node partial")
    [got] = node.out.of(NodePartial)
    want = node_partial(7, [0, 1, 2], [snaps[0], snaps[1], snaps[2]], GAMMA)
    assert (got.version, got.ranks, got.ns, got.pre, got.weighted) == (want.version, want.ranks, want.ns, want.pre, want.weighted)
    assert sorted(got.tensors) == sorted(want.tensors)
    assert all(got.tensors[k].dtype == torch.float64 and torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    divided = divide_sums([partial_sums(got)], GAMMA)
    flat = weighted_average([s.n for s in snaps.values()], [[s.tensors["p0"], s.tensors["p1"]] for s in snaps.values()],
                            [[s.tensors["b0"]] for s in snaps.values()], GAMMA)
    assert divided is not None and flat is not None
    for a, b in zip(divided[0] + divided[1], flat[0] + flat[1]):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), "bitwise the flat reduce's consensus"
    assert not node.members[1].direct.sent and not node.members[2].direct.sent, "members answered through the relay"


def test_the_leader_hands_each_member_its_update_and_answers_the_drift(node):
    snaps = {0: _snapshot(10, 2, 3), 1: _snapshot(11, 4, 3), 2: _snapshot(12, 6, 3)}
    for r in (1, 2):
        assert node.members[r].relay.submit(snaps[r])
    assert node.leader.contribute(snaps[0])
    wait_for(lambda: bool(node.out.of(NodePartial)), "the node partial")
    g = torch.Generator().manual_seed(99)
    consensus = {"p0": torch.randn(3, 4, generator=g), "p1": torch.randn(5, generator=g), "b0": torch.randn(2, generator=g),
                 "c0": torch.randn(3, 4, generator=g), "c1": torch.randn(5, generator=g)}  # an outer step: drift vs c<i>
    m = NodeUpdate(version=3, ranks=[0, 1, 2], ns=[2, 4, 6], alpha=0.25, tensors=consensus)
    own = node.leader.on_node_update(m)
    assert own is not None and (own.n, own.alpha, own.version) == (2, 0.25, 3) and sorted(own.tensors) == ["b0", "p0", "p1"]
    for r in (1, 2):
        u = node.members[r].next_update()
        want = member_update(m, r)
        assert (u.n, u.alpha, u.skip, u.version) == (want.n, 0.25, False, 3)
        assert sorted(u.tensors) == sorted(want.tensors) == ["b0", "p0", "p1"]
        assert all(torch.equal(u.tensors[k], want.tensors[k]) for k in want.tensors)
    wait_for(lambda: bool(node.out.of(NodeDrift)), "the drift")
    [drift] = node.out.of(NodeDrift)
    assert drift.version == 3 and drift.ranks == [0, 1, 2]
    assert drift.drift == node_drift([snaps[0], snaps[1], snaps[2]], m)
    # the updates came back: a leader that leaves now makes no member re-send anything
    node.leader.close()
    wait_for(lambda: node.members[1].relay.down and node.members[2].relay.down, "the members see the relay end")
    assert not node.members[1].direct.sent and not node.members[2].direct.sent


def test_a_skip_update_is_handed_on_as_skip(node):
    for r, relay in ((1, node.members[1].relay), (2, node.members[2].relay)):
        assert relay.submit(_snapshot(r, 0, 0))
    assert node.leader.contribute(_snapshot(0, 0, 0))
    wait_for(lambda: bool(node.out.of(NodePartial)), "the node partial")
    own = node.leader.on_node_update(NodeUpdate(version=0, ranks=[0, 1, 2], ns=[0, 0, 0], skip=True))
    assert own is not None and own.skip and own.version == 0
    assert all(node.members[r].next_update().skip for r in (1, 2))
    wait_for(lambda: bool(node.out.of(NodeDrift)), "the drift")
    assert node.out.of(NodeDrift)[0].drift == [0.0, 0.0, 0.0]


def test_a_member_whose_relay_closes_before_answering_is_not_waited_for(node):
    node.members[2].relay.close()
    snaps = {0: _snapshot(20, 1, 5), 1: _snapshot(21, 2, 5)}
    assert node.members[1].relay.submit(snaps[1])
    assert node.leader.contribute(snaps[0])
    wait_for(lambda: bool(node.out.of(NodePartial)), "the partial without rank 2")
    [got] = node.out.of(NodePartial)
    assert got.ranks == [0, 1] and got.ns == [1, 2]
    want = node_partial(5, [0, 1], [snaps[0], snaps[1]], GAMMA)
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    assert not node.leader.down, "rank 1 still answers through it"
    node.members[1].relay.close()
    wait_for(lambda: node.leader.down, "the leader sees no member left")
    assert not node.leader.contribute(_snapshot(0, 1, 6)), "a relay with no member left: the leader answers directly"


def test_a_member_that_leaves_mid_reduce_is_dropped_from_the_waiting_partial(node):
    assert node.leader.contribute(_snapshot(30, 1, 2))
    assert node.members[1].relay.submit(_snapshot(31, 1, 2))
    assert not node.out.of(NodePartial), "rank 2 is still expected"
    node.members[2].relay.close()
    wait_for(lambda: bool(node.out.of(NodePartial)), "the partial once rank 2 left")
    assert node.out.of(NodePartial)[0].ranks == [0, 1]


def test_a_member_re_sends_its_snapshot_directly_when_the_leader_leaves_before_answering(node):
    snap = _snapshot(40, 3, 9)
    assert node.members[1].relay.submit(snap)
    node.leader.close()
    m1 = node.members[1]
    wait_for(lambda: bool(m1.direct.of(Snapshot)), "the snapshot re-sent to the coordinator")
    [again] = m1.direct.of(Snapshot)
    assert again.version == 9 and again.n == 3 and all(torch.equal(again.tensors[k], snap.tensors[k]) for k in snap.tensors)
    assert m1.relay.down and not m1.relay.submit(_snapshot(40, 1, 10)), "down for good: the rank answers directly"
    assert not node.members[2].direct.sent, "rank 2 had nothing pending"


def test_a_member_that_never_connects_is_waited_for_only_until_the_join_timeout():
    address, token, out = _address(), wire.new_token(), Recorder()
    leader = LeaderRelay(address, rank=4, members=[4, 5, 6], token=token, send=out, gamma=1.0, join_timeout_s=0.3).start()
    member = Member(address, 5, token, leader=4)
    try:
        assert member.relay.connect()
        assert leader.contribute(_snapshot(50, 1, 0)) and member.relay.submit(_snapshot(51, 2, 0))
        wait_for(lambda: bool(out.of(NodePartial)), "the partial after the join timeout")
        assert out.of(NodePartial)[0].ranks == [4, 5]
        late = Member(address, 6, token, leader=4, connect_timeout_s=0.5)
        assert not late.relay.connect() and late.relay.down, "a member written off is refused (or finds no listener)"
    finally:
        member.relay.close()
        leader.close()


def test_a_wrong_token_or_a_rank_outside_the_group_is_refused():
    address, token = _address(), wire.new_token()
    leader = LeaderRelay(address, rank=0, members=[0, 1, 2], token=token, send=Recorder(), gamma=1.0).start()
    honest = Member(address, 1, token)
    try:
        impostor = Member(address, 1, wire.new_token())
        assert not impostor.relay.connect() and impostor.relay.down
        stranger = Member(address, 7, token)
        assert not stranger.relay.connect() and stranger.relay.down
        itself = Member(address, 0, token)
        assert not itself.relay.connect(), "the leader's own rank is no member to connect"
        assert leader.connected() == []
        assert honest.relay.connect(), "the refusals wrote nobody off"
        twin = Member(address, 1, token)
        assert not twin.relay.connect(), "a second connection for a rank already connected"
        assert leader.connected() == [1]
        assert not impostor.frames.qsize() and not stranger.direct.sent
    finally:
        honest.relay.close()
        leader.close()


def test_a_duplicate_snapshot_for_a_version_drops_the_member(node):
    assert node.members[1].relay.submit(_snapshot(60, 1, 1))
    conn = node.members[1].relay._conn
    assert conn is not None
    conn.send(encode(_snapshot(60, 1, 1)))  # a member must answer a reduce once
    wait_for(lambda: node.leader.connected() == [2], "rank 1 dropped")
    wait_for(lambda: node.members[1].relay.down, "rank 1's relay ended")
    wait_for(lambda: bool(node.members[1].direct.of(Snapshot)), "rank 1 answers directly")


# -- the control loop over relays ------------------------------------------------------------------------------------
def _weight(ctl: RankControl) -> torch.Tensor:
    w = ctl.trainer.model.weight
    assert isinstance(w, torch.Tensor)
    return w


def _relay_down(ctl: RankControl) -> bool:
    return ctl.relay is not None and ctl.relay.down


def _ranks(address: str, token: str, senders: dict[int, Any]) -> dict[int, RankControl]:
    """Three rank controls (0 leads) whose NodeGroup handler opens real relays."""
    ctls: dict[int, RankControl] = {}
    for r in (0, 1, 2):
        torch.manual_seed(r)
        trainer = SimpleNamespace(steps_since_avg=r + 1, model=torch.nn.Linear(3, 2))
        holder: dict[str, Optional[RankControl]] = {"ctl": None}

        def opener(m: NodeGroup, gamma: float, r: int = r, holder: dict[str, Optional[RankControl]] = holder) -> Any:
            ctl = holder["ctl"]
            assert ctl is not None
            return open_relay(m, rank=r, token=token, send=ctl.send, deliver=ctl.inbox.put, gamma=gamma, timeout_s=DEADLINE_S)

        ctl, sent = rank_control(trainer, rank=r, world_size=3, gamma=GAMMA, open_relay=opener)
        holder["ctl"] = ctl
        senders[r] = sent
        ctls[r] = ctl
    return ctls


def test_the_control_loop_answers_through_the_relay_and_ignores_a_second_copy_of_an_update():
    address, token = _address(), wire.new_token()
    sent: dict[int, Any] = {}
    ctls = _ranks(address, token, sent)
    try:
        group = NodeGroup(leader=0, members=[0, 1, 2], address=address)
        for r in (0, 1, 2):  # the leader binds first; the members connect (a member first would retry, bounded)
            ctls[r].handle(group)
        assert isinstance(ctls[0].relay, LeaderRelay) and isinstance(ctls[1].relay, MemberRelay)
        wait_for(lambda: isinstance(ctls[0].relay, LeaderRelay) and ctls[0].relay.connected() == [1, 2], "members in")
        for r in (1, 2, 0):
            ctls[r].handle(RequestParams(version=4, barrier=False))
        assert not sent[1].of(Snapshot) and not sent[2].of(Snapshot) and not sent[0].of(Snapshot)
        wait_for(lambda: bool(sent[0].of(NodePartial)), "the leader's partial")
        [p] = sent[0].of(NodePartial)
        assert p.ranks == [0, 1, 2] and p.ns == [1, 2, 3]
        consensus = {"p0": torch.full((2, 3), 0.5), "p1": torch.full((2,), -1.0)}
        ctls[0].handle(NodeUpdate(version=4, ranks=[0, 1, 2], ns=[1, 2, 3], tensors=consensus))
        assert ctls[0].adopted_version == 4 and torch.equal(_weight(ctls[0]), consensus["p0"])
        assert sent[0].of(NodeDrift) and sent[0].of(NodeDrift)[0].ranks == [0, 1, 2]
        for r in (1, 2):
            inbox = ctls[r].inbox
            wait_for(inbox.has_waiting, f"rank {r}'s update")
            ctls[r].drain()
            assert ctls[r].adopted_version == 4 and ctls[r].trainer.steps_since_avg == 0
            assert torch.equal(_weight(ctls[r]), consensus["p0"])
        # the coordinator's own copy (sent when it thinks the leader died) changes nothing
        ctls[1].trainer.steps_since_avg = 5
        ctls[1].handle(Update(n=9, tensors={"p0": torch.zeros(2, 3), "p1": torch.zeros(2)}, version=4))
        assert ctls[1].trainer.steps_since_avg == 5 and torch.equal(_weight(ctls[1]), consensus["p0"])
        # the leader goes: its members answer the coordinator directly from the next reduce on
        ctls[0].close()
        wait_for(lambda: _relay_down(ctls[1]) and _relay_down(ctls[2]), "members see the leader go")
        ctls[1].handle(RequestParams(version=5, barrier=False))
        [direct] = sent[1].of(Snapshot)
        assert direct.version == 5 and direct.n == 5
    finally:
        for c in ctls.values():
            c.close()


def test_a_rank_without_a_relay_answers_directly_with_the_version():
    trainer = SimpleNamespace(steps_since_avg=2, model=torch.nn.Linear(2, 1))
    ctl, sent = rank_control(trainer)
    ctl.handle(NodeGroup(leader=0, members=[0, 1], address=_address()))  # no opener: ignored
    ctl.handle(RequestParams(version=3, barrier=False))
    [s] = sent.of(Snapshot)
    assert s.version == 3 and s.n == 2 and ctl.relay is None


def test_a_member_declared_dead_is_not_waited_for_though_its_socket_stays_open(node):
    """A frozen member (its relay socket open, its process stopped): the coordinator's NodeDrop lets the partial go."""
    assert node.leader.contribute(_snapshot(50, 1, 4))
    assert node.members[1].relay.submit(_snapshot(51, 2, 4))
    assert not node.out.of(NodePartial), "rank 2 is still expected"
    node.leader.drop(2)
    wait_for(lambda: bool(node.out.of(NodePartial)), "the partial without the dead rank")
    assert node.out.of(NodePartial)[0].ranks == [0, 1]


def test_a_member_whose_leader_is_declared_dead_answers_directly(node):
    """A frozen leader (its socket open): the member's pending snapshot goes to the coordinator at the NodeDrop."""
    snap = _snapshot(60, 3, 11)
    m1 = node.members[1]
    assert m1.relay.submit(snap)
    m1.relay.leader_gone()
    wait_for(lambda: bool(m1.direct.of(Snapshot)), "the snapshot re-sent to the coordinator")
    assert m1.direct.of(Snapshot)[0].version == 11 and m1.relay.down
