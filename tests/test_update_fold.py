"""cpu cadence (algorithms.md 5.6): each rank's next chunk rides in its Update, so the next window starts
with no separate StartEpoch; everything else keeps its order behind the update."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from control_fakes import BATCH, Harness
from rank_fakes import rank_control

from flodl_exp.coordinator.wire_outbox import WireOutbox as Outbox
from flodl_exp.protocol.codec import decode, unbundle
from flodl_exp.protocol.messages import ExtendPartition, Payload, RequestParams, Save, SetGlobalStep, StartEpoch, Update
from flodl_exp.protocol.wire import Message


class _Transport:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Optional[Payload]]] = []
        self.frames: list[int] = []

    def send(self, r: int, msg: Message) -> bool:
        self.frames.append(r)
        self.sent.extend((r, decode(m)) for m in unbundle(msg))
        return True


def test_the_outbox_folds_the_first_chunk_into_the_held_update_and_keeps_the_order():
    t = _Transport()
    out = Outbox(t, SimpleNamespace(alive_ranks=lambda: [0, 1]))  # type: ignore[arg-type]
    with out.folding_updates():
        out.send(0, Update(n=3, tensors={"p0": torch.zeros(2)}))
        out.broadcast(SetGlobalStep(global_step=7))  # rank 1 has no held update: sent at once
        out.send(0, Save(stem="s", primary=True, model=True))
        out.send(0, StartEpoch(epoch=1, offset=64, size=32, chunk=9))
        out.send(0, StartEpoch(epoch=1, offset=96, size=32, chunk=10))  # only the first one rides along
        assert [r for r, _ in t.sent] == [1], "rank 0's messages wait behind its update"
    kinds = [(r, type(p).__name__) for r, p in t.sent]
    assert kinds == [(1, "SetGlobalStep"), (0, "Update"), (0, "SetGlobalStep"), (0, "Save"), (0, "StartEpoch")]
    assert t.frames == [1, 0], "rank 0's update and what follows it: one frame (a bundle)"
    upd, last = t.sent[1][1], t.sent[-1][1]
    assert isinstance(upd, Update) and upd.next_plan == [1, 64, 32, 9]
    assert isinstance(last, StartEpoch) and last.chunk == 10
    out.send(0, StartEpoch(epoch=2, offset=0, size=32, chunk=11))  # outside the block: straight through
    assert isinstance(t.sent[-1][1], StartEpoch)


def test_the_held_updates_of_one_consensus_share_one_encoding_of_it():
    """At a thousand ranks the flush sends one consensus a thousand times: its tensors are encoded once."""
    msgs: list[tuple[int, Message]] = []

    class _Raw:
        def send(self, r: int, msg: Message) -> bool:
            msgs.append((r, msg))
            return True

    out = Outbox(_Raw(), SimpleNamespace(alive_ranks=lambda: [0, 1, 2]))  # type: ignore[arg-type]
    consensus = {"p0": torch.arange(6.0)}
    with out.folding_updates():
        for r in range(3):
            out.send(r, Update(n=r + 1, tensors=consensus))
        out.send(1, StartEpoch(epoch=1, offset=64, size=32, chunk=9))
    assert [r for r, _ in msgs] == [0, 1, 2]
    parts = {id(m.tensor_part) for _, m in msgs}
    assert len(parts) == 1 and None not in {m.tensor_part for _, m in msgs}
    got = [decode(m) for _, m in msgs]
    assert [u.n for u in got] == [1, 2, 3] and got[1].next_plan == [1, 64, 32, 9]  # type: ignore[union-attr]
    assert all(torch.equal(u.tensors["p0"], consensus["p0"]) for u in got)  # type: ignore[union-attr]
    out.send(0, Update(n=1, tensors=consensus))  # outside a block: encoded on its own
    assert msgs[-1][1].tensor_part is None


def test_a_bundle_that_does_not_go_is_sent_again_message_by_message():
    """A bundle refused by the send (its header over the wire's cap, say) must not take the update with it."""
    t = _Transport()
    refused: list[str] = []

    def send(r: int, msg: Message) -> bool:
        if msg.kind == "bundle":
            refused.append(msg.kind)
            return False
        return _Transport.send(t, r, msg)

    t.send = send  # type: ignore[method-assign]
    out = Outbox(t, SimpleNamespace(alive_ranks=lambda: [0]))  # type: ignore[arg-type]
    with out.folding_updates():
        out.send(0, Update(n=3, tensors={"p0": torch.zeros(2)}))
        out.send(0, SetGlobalStep(global_step=7))
    assert refused == ["bundle"]
    assert [type(p).__name__ for _, p in t.sent] == ["Update", "SetGlobalStep"]


def test_an_extension_queued_behind_the_update_stops_the_folding():
    t = _Transport()
    out = Outbox(t, SimpleNamespace(alive_ranks=lambda: [0]))  # type: ignore[arg-type]
    with out.folding_updates():
        out.send(0, Update(n=3, tensors={"p0": torch.zeros(2)}))
        out.send(0, ExtendPartition(epoch=1, offset=0, size=8, chunk=4))
        out.send(0, StartEpoch(epoch=1, offset=64, size=32, chunk=9))
    assert [type(p).__name__ for _, p in t.sent] == ["Update", "ExtendPartition", "StartEpoch"]
    first = t.sent[0][1]
    assert isinstance(first, Update) and first.next_plan is None


def test_a_cpu_cadence_reduce_sends_each_rank_one_update_carrying_its_next_chunk(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=3)
    plans = h.start(samples=960)  # the first chunks leave most of the epoch in the pool
    h.batches(1, plans[1][0].chunk, 3)  # rank 1's probe steps land before rank 0 reaches its count (else rank 0
    h.finish_chunk(0, plans[0][0])      # trains on while the probe is open, and has that chunk out at the reduce)
    h.finish_chunk(1, plans[1][0], sent=3)
    h.tick()
    assert [r for r, _ in h.transport.take(RequestParams)] == [0, 1]
    h.snapshot(0, plans[0][0].size // BATCH, 1.0)
    h.snapshot(1, plans[1][0].size // BATCH, 3.0)
    sent = list(h.transport.raw)
    h.transport.take()
    ups = {r: p for r, p in sent if isinstance(p, Update)}
    assert sorted(ups) == [0, 1] and all(u.next_plan is not None for u in ups.values())
    assert not [p for _, p in sent if isinstance(p, StartEpoch)], "no separate StartEpoch"
    for r, u in ups.items():  # the folded chunk is a real one: the dispatcher tracks it
        assert u.next_plan is not None
        assert h.co.core.dispatch.chunks[u.next_plan[3]].rank == r


def test_the_rank_takes_the_folded_chunk_as_its_next_plan():
    ctl, _ = rank_control(SimpleNamespace(steps_since_avg=4))
    ctl.awaiting_update = True
    ctl.handle(Update(n=4, skip=True, next_plan=[2, 128, 64, 5]))
    assert list(ctl.plans) == [StartEpoch(epoch=2, offset=128, size=64, chunk=5)] and not ctl.awaiting_update
    ctl.handle(Update(n=0, skip=True, next_plan=[1, "x", 3, 4]))  # type: ignore[list-item]
    assert len(ctl.plans) == 1, "a malformed folded plan is dropped"
