"""Overlapped averaging on the rank (``mode.overlap``, issue 51): the correction ``W <- W + a (W_avg - W_sent)`` and
the rank's control around it (it trains on after its answer, keeps its steps, waits for one update at a time)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rank_fakes import rank_control

from flodl_exp.averaging import adopt, adopt_correction, float_buffers
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.messages import (
    Regroup,
    RequestParams,
    Save,
    SaveResult,
    SetGlobalStep,
    Snapshot,
    SyncAck,
    SyncNow,
    Update,
)
from flodl_exp.rank.backends import CollectiveTimeout
from flodl_exp.rank.hold_clock import HoldClock


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _state(m: torch.nn.Sequential) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*m.parameters(), *float_buffers(m)]]


def _consensus(m: torch.nn.Sequential, shift: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [p.detach() + shift for p in m.parameters()], [b + shift for b in float_buffers(m)]


def test_a_correction_with_nothing_trained_since_is_the_plain_adoption() -> None:
    for alpha in (None, 0.5):
        a, b = _model(), _model()
        params, bufs = _consensus(a, 0.25)
        sent_p = [p.detach().clone() for p in a.parameters()]
        sent_b = [t.clone() for t in float_buffers(a)]
        adopt_correction(a, params, bufs, sent_p, sent_b, alpha)
        adopt(b, params, bufs, alpha)
        n = len(list(a.parameters()))
        for x, y in zip(_state(a)[:n], _state(b)[:n]):  # the parameters: overwrite, or EASGD's blend
            assert torch.allclose(x, y, atol=1e-7)
        if alpha is None:
            assert all(torch.allclose(x, y, atol=1e-7) for x, y in zip(_state(a), _state(b)))


def test_a_correction_keeps_what_the_replica_trained_since_its_snapshot() -> None:
    m = _model()
    sent_p = [p.detach().clone() for p in m.parameters()]
    sent_b = [t.clone() for t in float_buffers(m)]
    params, bufs = _consensus(m, 0.25)  # the average moved the sent state by +0.25
    with torch.no_grad():
        for p in m.parameters():
            p.add_(-0.5)  # what the rank trained meanwhile
    adopt_correction(m, params, bufs, sent_p, sent_b, None)
    for p, s in zip(m.parameters(), sent_p):
        assert torch.allclose(p, s - 0.25, atol=1e-6)
    m2 = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(-0.5)
    adopt_correction(m2, params, bufs, sent_p, sent_b, 0.5)
    for p, s in zip(m2.parameters(), sent_p):
        assert torch.allclose(p, s - 0.5 + 0.125, atol=1e-6)


def _trainer(steps: int) -> SimpleNamespace:
    return SimpleNamespace(steps_since_avg=steps, steps_in_flight=0, global_step=0, model=torch.nn.Linear(2, 1))


def _update(version: int, model: torch.nn.Module, value: float) -> Update:
    return Update(n=0, version=version, tensors={f"p{i}": torch.full_like(p, value) for i, p in enumerate(model.parameters())})


def test_an_overlapped_answer_trains_on_and_its_update_corrects_the_replica() -> None:
    tr = _trainer(5)
    ctl, sent = rank_control(tr)
    w0 = [p.detach().clone() for p in tr.model.parameters()]
    ctl.handle(RequestParams(version=3, barrier=False, overlap=True))
    [snap] = sent.of(Snapshot)
    assert snap.n == 5 and snap.version == 3
    assert tr.steps_since_avg == 0 and tr.steps_in_flight == 5, "the steps from here are the next window's"
    assert ctl.sent is not None and ctl.sent.version == 3
    with torch.no_grad():  # two steps trained while the reduce is in flight
        for p in tr.model.parameters():
            p.add_(1.0)
    tr.steps_since_avg = 2
    ctl.handle(_update(3, tr.model, 7.0))
    for p, w in zip(tr.model.parameters(), w0):
        assert torch.allclose(p, torch.full_like(p, 7.0) + 1.0), "the consensus plus what was trained since"
        assert not torch.equal(p, w)
    assert tr.steps_since_avg == 2 and ctl.sent is None, "the steps since the answer are kept"
    ctl.handle(SetGlobalStep(global_step=40))
    assert tr.global_step == 40 and tr.steps_in_flight == 0


def test_without_overlap_the_update_overwrites_and_resets_the_window() -> None:
    tr = _trainer(5)
    ctl, sent = rank_control(tr)
    ctl.handle(RequestParams(version=3, barrier=False))
    assert tr.steps_since_avg == 5 and ctl.sent is None
    ctl.handle(_update(3, tr.model, 7.0))
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in tr.model.parameters())
    assert tr.steps_since_avg == 0


def test_a_second_request_waits_for_the_first_reduces_update() -> None:
    """At most one reduce in flight per rank: a request that overtook the last update (a node leader hands updates
    on; the coordinator sends requests) is answered only after that update was applied."""
    tr = _trainer(4)
    model = tr.model
    ctl, sent = rank_control(tr, messages=[_update(3, model, 2.0)])
    ctl._on_request_params(RequestParams(version=3, barrier=False, overlap=True))  # answered; its update is queued
    ctl.handle(RequestParams(version=4, barrier=False, overlap=True))  # the queued update 3 is applied first
    snaps = sent.of(Snapshot)
    assert [s.version for s in snaps] == [3, 4]
    assert all(torch.allclose(t, torch.full_like(t, 2.0)) for k, t in snaps[1].tensors.items() if k.startswith("p"))
    assert ctl.sent is not None and ctl.sent.version == 4


def test_with_nothing_trained_since_the_answer_the_replica_is_the_consensus_to_the_bit() -> None:
    """Replicas that trained nothing past their answers must end equal (the run's end skips a reduce nobody needs):
    ``W + (avg - W)`` is not ``avg`` in floating point, so such an update is adopted as is."""
    tr = _trainer(5)
    torch.manual_seed(3)
    tr.model = torch.nn.Linear(64, 32)
    ctl, _ = rank_control(tr)
    ctl.handle(RequestParams(version=1, barrier=False, overlap=True))
    g = torch.Generator().manual_seed(4)
    consensus = {f"p{i}": torch.randn(p.shape, generator=g) * 3 for i, p in enumerate(tr.model.parameters())}
    ctl.handle(Update(n=5, version=1, tensors=consensus))
    assert all(torch.equal(p, consensus[f"p{i}"]) for i, p in enumerate(tr.model.parameters()))


def test_a_consensus_save_waits_only_for_the_update_of_a_finished_reduce(tmp_path: Any) -> None:
    """A bundle holds the last finished reduce's consensus: a rank whose update of it is still on its way adopts it
    first; the update of a reduce still in flight (a stalled reduce's ShutdownWithSave) is not waited for."""
    import threading

    tr = _trainer(3)
    tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=0.1)
    ctl, sent = rank_control(tr)
    ctl.handle(RequestParams(version=5, barrier=False, overlap=True))
    done = threading.Event()

    def save() -> None:
        ctl.handle(Save(stem=str(tmp_path / "b1"), primary=True, model=True, consensus=True, reduces=5))
        done.set()

    t = threading.Thread(target=save, daemon=True)
    t.start()
    assert done.wait(10.0), "a save waited for the update of a reduce still in flight"
    assert sent.of(SaveResult)[-1].error is None and ctl.sent is not None
    ctl2, sent2 = rank_control(tr, messages=[_update(5, tr.model, 2.0)])
    ctl2.handle(RequestParams(version=5, barrier=False, overlap=True))
    ctl2.handle(Save(stem=str(tmp_path / "b2"), primary=True, model=True, consensus=True, reduces=6))
    assert ctl2.sent is None and ctl2.adopted_version == 5, "the finished reduce's update was adopted first"
    assert sent2.of(SaveResult)[-1].error is None


# -- nccl: the all-reduce runs while the rank trains on ---------------------------------------------------------------

class _OverlapCollective:
    """An overlapped all-reduce the test finishes (``done``), fails or lets run past its deadline (``overdue``)."""

    op_timeout_s = 60.0

    def __init__(self) -> None:
        self.generation = 0
        self.reduced = True
        self.done = False
        self.overdue = False
        self.fail = False
        self.fail_rebuild = False
        self.log: list[Any] = []

    def start_overlapped(self, model: Any, n: int, gamma: float) -> None:
        self.log.append(("start", n))

    def relaunch_overlapped(self) -> None:
        self.log.append(("relaunch", self.generation))
        self.overdue = False  # its deadline runs from this launch

    def overlapped_done(self) -> bool:
        return self.done

    def overlapped_overdue(self) -> bool:
        return self.overdue

    def land_overlapped(self, model: Any, with_div: bool, *, keep_current: bool) -> tuple[float, float, float]:
        if self.fail:
            self.fail = False
            raise RuntimeError("connection reset by peer")
        self.log.append(("land", keep_current))
        return 0.1, 1.0, 1.0

    def apply_correction(self, model: Any) -> None:
        self.log.append(("correct",))

    def abort(self) -> None:
        self.log.append(("abort",))

    def rebuild(self, generation: int, rank: int, world_size: int, session: str = "") -> None:
        if self.fail_rebuild:
            self.fail_rebuild = False
            raise CollectiveTimeout("forming the group waited 60s for its members (cluster.collective_timeout_s)")
        self.generation = generation
        self.log.append(("rebuild", generation))


def _nccl_rank(steps: int, messages: tuple[Any, ...] = ()) -> tuple[Any, Any, _OverlapCollective]:
    tr = SimpleNamespace(steps_since_avg=steps, steps_in_flight=0, global_step=0, step_count=0,
                         model=torch.nn.Linear(2, 1))
    ctl, sent = rank_control(tr, messages=messages)
    coll = _OverlapCollective()
    ctl.collective = coll  # type: ignore[assignment]
    return ctl, sent, coll


def test_an_overlapped_all_reduce_acks_once_it_landed_with_the_steps_it_sent() -> None:
    ctl, sent, coll = _nccl_rank(5)
    ctl.handle(SyncNow(version=2, overlap=True))
    assert coll.log == [("start", 5)] and not sent.of(SyncAck), "launched; no ack before it lands"
    assert ctl.trainer.steps_since_avg == 0 and ctl.trainer.steps_in_flight == 5
    ctl.trainer.steps_since_avg = 3  # trained on meanwhile
    ctl._land_overlapped(block=False)
    assert not sent.of(SyncAck), "not finished: the rank trains on"
    coll.done = True
    ctl._land_overlapped(block=False)
    [ack] = sent.of(SyncAck)
    assert (ack.version, ack.n, ack.generation) == (2, 5, 0) and ctl.synced == 3
    assert coll.log[1:] == [("land", True), ("correct",)], "the steps trained since are kept"
    assert ctl.overlapped is None and ctl.trainer.steps_since_avg == 3


def test_a_paced_sync_lands_the_overlapped_one_first() -> None:
    ctl, sent, coll = _nccl_rank(4)
    ctl.handle(SyncNow(version=0, overlap=True))
    coll.done = True
    coll.sync = lambda *a, **kw: (0.0, 1.0, 1.0)  # type: ignore[attr-defined]
    ctl.handle(SyncNow(version=1, overlap=False))
    assert [(a.version, a.n) for a in sent.of(SyncAck)] == [(0, 4), (1, 0)], "one reduce in flight, in order"


def test_an_overdue_all_reduce_is_sent_again_in_the_regrouped_cohort() -> None:
    """A peer that never joins: past ``collective_timeout_s`` the rank gives the all-reduce up as a waited sync would,
    waits for the coordinator's regroup and sends the same replica again in the new group."""
    ctl, sent, coll = _nccl_rank(5, messages=(Regroup(generation=1, new_rank=0, world_size=2, ranks=[0, 2]),))
    ctl.handle(SyncNow(version=7, overlap=True))
    coll.overdue = True
    ctl._land_overlapped(block=False)
    assert ("abort",) in coll.log and ("rebuild", 1) in coll.log and coll.log[-1] == ("relaunch", 1)
    assert not sent.of(SyncAck)
    coll.done = True
    ctl._land_overlapped(block=False)
    [ack] = sent.of(SyncAck)
    assert (ack.version, ack.n, ack.generation) == (7, 5, 1)


def test_a_failed_all_reduce_or_a_regroup_mid_flight_sends_it_again() -> None:
    ctl, sent, coll = _nccl_rank(2, messages=(Regroup(generation=1, new_rank=0, world_size=2, ranks=[0, 1]),))
    ctl.handle(SyncNow(version=0, overlap=True))
    coll.done, coll.fail = True, True  # it ended with an error: landing it fails, the queued regroup re-forms
    ctl._land_overlapped(block=False)
    assert [a.generation for a in sent.of(SyncAck)] == [1] and ("relaunch", 1) in coll.log
    # a regroup that comes while the next one is still pending: formed, then the all-reduce goes again in it
    coll.done = False
    ctl.handle(SyncNow(version=1, overlap=True))
    ctl.handle(Regroup(generation=2, new_rank=0, world_size=2, ranks=[0, 1]))
    assert coll.log[-2:] == [("rebuild", 2), ("relaunch", 2)] and len(sent.of(SyncAck)) == 1


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_regroup_that_fails_to_form_waits_for_the_next_one(in_flight: bool) -> None:
    """A member vanished while the group formed (its death reaches the coordinator a little later): the rank waits for
    the next regroup instead of ending, and an overlapped all-reduce in flight goes again in the group that formed."""
    ctl, sent, coll = _nccl_rank(3, messages=(Regroup(generation=2, new_rank=0, world_size=2, ranks=[0, 1]),))
    if in_flight:
        ctl.handle(SyncNow(version=0, overlap=True))
    coll.fail_rebuild = True
    ctl.handle(Regroup(generation=1, new_rank=0, world_size=3, ranks=[0, 1, 2]))
    assert coll.generation == 2 and ("rebuild", 2) in coll.log
    assert (("relaunch", 2) in coll.log) == in_flight


def _taking(now: list[float], ms: float, fn: Any) -> Any:
    """``fn``, taking ``ms`` of the scripted clock ``now``."""
    def timed(*a: Any, **kw: Any) -> Any:
        now[0] += ms / 1e3
        return fn(*a, **kw)
    return timed


def test_an_overlapped_ack_says_how_long_the_reduce_held_the_rank_not_how_long_it_ran() -> None:
    """ElChe's overhead under overlap (core/cycle.py): the launch, the landing and the correction, not the training
    done while the all-reduce ran."""
    now = [0.0]
    ctl, sent, coll = _nccl_rank(5)
    ctl.hold = HoldClock(lambda: now[0])
    coll.start_overlapped = _taking(now, 2.0, coll.start_overlapped)  # type: ignore[method-assign]
    coll.land_overlapped = _taking(now, 3.0, coll.land_overlapped)  # type: ignore[method-assign]
    coll.apply_correction = _taking(now, 1.0, coll.apply_correction)  # type: ignore[method-assign]
    ctl.handle(SyncNow(version=2, overlap=True))
    now[0] += 0.5  # 500 ms of training while it runs
    ctl._land_overlapped(block=False)
    coll.done = True
    ctl._land_overlapped(block=False)
    [ack] = sent.of(SyncAck)
    assert ack.held_ms == pytest.approx(6.0)


def test_an_overlapped_snapshot_says_what_averaging_held_the_rank_since_its_last_answer() -> None:
    now = [0.0]
    tr = _trainer(5)
    ctl, sent = rank_control(tr)
    ctl.hold = HoldClock(lambda: now[0])
    ctl.cpu.snapshot = _taking(now, 4.0, ctl.cpu.snapshot)  # type: ignore[method-assign]
    ctl.cpu.adopt_correction = _taking(now, 2.0, ctl.cpu.adopt_correction)  # type: ignore[method-assign]
    ctl.handle(RequestParams(version=3, barrier=False, overlap=True))
    now[0] += 1.0  # training
    tr.steps_since_avg = 2
    ctl.handle(_update(3, tr.model, 7.0))  # the correction: 2 ms
    now[0] += 1.0
    ctl.handle(RequestParams(version=4, barrier=False, overlap=True))
    ctl.handle(_update(4, tr.model, 7.0))  # nothing trained since: the plain adoption (untimed here)
    ctl.handle(RequestParams(version=5, barrier=False))
    assert [s.held_ms for s in sent.of(Snapshot)] == [pytest.approx(4.0), pytest.approx(6.0), None], (
        "its snapshot, then the last update's correction and its snapshot; none when the reduce waits")


def test_idle_for_the_next_chunk_while_the_answer_is_unresolved_is_held_and_other_waits_are_not() -> None:
    """A rank that trained through its next window before the reduce finished waits for the chunk after, which
    comes with the finish: that idle is the reduce's cost to it. A wait with no answer unresolved is not."""
    now = [0.0]
    tr = _trainer(5)
    update = _update(3, tr.model, 7.0)
    update.next_plan = [0, 0, 16, 1]
    ctl, sent = rank_control(tr, messages=[update])
    ctl.hold = HoldClock(lambda: now[0])
    ctl.handle(RequestParams(version=3, barrier=False, overlap=True))
    ctl.inbox.next = _taking(now, 30.0, ctl.inbox.next)  # type: ignore[method-assign]  # the update comes 30 ms in
    ctl.wait_for_plans()
    assert ctl.plans and ctl.sent is None
    ctl.plans.clear()
    ctl.inbox.put(encode(_update(9, tr.model, 1.0)))  # a wait with nothing unresolved: not held
    ctl.wait_until(lambda: ctl.adopted_version == 9, held=True)
    ctl.handle(RequestParams(version=4, barrier=False, overlap=True))
    assert sent.of(Snapshot)[-1].held_ms == pytest.approx(30.0)
