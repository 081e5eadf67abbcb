"""nccl_sync without a round trip per step (``mode.lockstep_ahead``, issue 30 item 3).

The coordinator licenses the ranks to all-reduce after every step on their own (Lockstep); it opens each such
reduce itself and books the answers as they come, early ones included, extends the license within the steps
every rank's chunk has left, and lets it run out before anything that needs the cohort held. Tested here: the
rank's side (a reduce per step while licensed, the run-out at a chunk's end), the head check that refuses to
pair two different reduces, and the core's side on scripted ranks that reduce on their own: the run ends with a
reduce per step and the same books as the paced one, a sync_now is never sent below the license, the license
never reaches past a rank's chunk, and a preemption or a death lets it run out.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from control_fakes import FakeClock
from rank_fakes import rank_control
from test_control_core import Bare, Ranks, cfg_of, coverage_is_exact, play, sent

from flodl_exp.protocol.messages import Batch, Lockstep, Payload, SyncAck, SyncNow
from flodl_exp.rank.backends import lockstep_aligned

# -- the rank's side ------------------------------------------------------------------------------------------------

class _Collective:
    """Records each sync's (n, lockstep version); completes at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Optional[int]]] = []
        self.generation = 0
        self.reduced = True
        self.realigned_to: Optional[int] = None

    def sync(self, model: Any, n: int, gamma: float, with_div: bool = True,
             lockstep_version: Optional[int] = None) -> tuple[float, float, float]:
        self.calls.append((n, lockstep_version))
        return 0.0, 1.0, 1.0


class _Step:
    def ready(self) -> bool:
        return True

    def resolve(self) -> tuple[float, float]:
        return 0.5, 10.0


def _rank(picks: int = 10, bs: int = 1) -> tuple[Any, Any, _Collective]:
    trainer = SimpleNamespace(model=torch.nn.Linear(2, 1), steps_since_avg=0, step_count=0, batch_size=bs,
                              current_lr=lambda: 0.1)

    def record_step(st: Any, batch: Any, step: Any) -> None:
        st.cursor += bs
        trainer.steps_since_avg += 1

    trainer.record_step = record_step
    ctl, out = rank_control(trainer)
    coll = _Collective()
    ctl.collective = coll  # type: ignore[assignment]
    ctl.chunk = SimpleNamespace(picks=list(range(picks)), cursor=0)  # type: ignore[assignment]
    return ctl, out, coll


def test_a_licensed_rank_reduces_after_every_step_and_stops_at_the_license() -> None:
    ctl, out, coll = _rank()
    ctl.handle(Lockstep(until=3))
    for _ in range(5):
        ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)
    assert coll.calls == [(1, 0), (1, 1), (1, 2)]  # one step each, started on its own, in version order
    acks = out.of(SyncAck)
    assert [(a.version, a.n, a.left) for a in acks] == [(0, 1, 9), (1, 1, 8), (2, 1, 7)]
    assert ctl.synced == 3 and ctl.trainer.steps_since_avg == 2  # the two steps past the license wait for a sync_now
    assert len(out.of(Batch)) == 5
    order = [type(m).__name__ for m in out if isinstance(m, (Batch, SyncAck))]
    assert order[:2] == ["Batch", "SyncAck"]  # every step's report goes before the answer that counts it


def test_a_license_that_finds_the_rank_between_chunks_is_run_out_at_once() -> None:
    """A fast rank trained its whole share while the license was on its way (the coordinator sized it from the
    steps it had left when it answered): the license reaches it waiting for the next chunk, and it takes part
    in every licensed reduce there, its unaveraged steps in the first, or its peers would wait in them for good."""
    ctl, out, coll = _rank(picks=3)
    for _ in range(3):
        ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)
    ctl.chunk = None  # the chunk ended, its metrics sent
    ctl.handle(Lockstep(until=2))
    assert coll.calls == [(3, 0), (0, 1)] and ctl.synced == 2
    assert [a.left for a in out.of(SyncAck)] == [0, 0]


def test_a_rank_behind_its_peers_after_a_regroup_answers_the_reduces_it_skips_with_nothing() -> None:
    """The head showed a peer two reduces further (it had completed them before the regroup this rank redid its
    reduce in): this rank answers its own with its steps and the skipped ones with nothing, and counts on from the
    furthest, so every member takes part in the same reduces again."""
    ctl, out, coll = _rank()
    ctl.handle(Lockstep(until=10))
    coll.realigned_to = 2
    ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)
    assert [(a.version, a.n) for a in out.of(SyncAck)] == [(0, 1), (1, 0), (2, 0)]
    assert ctl.synced == 3


def test_a_sync_now_sets_the_count_and_is_never_a_lockstep_reduce() -> None:
    ctl, out, coll = _rank()
    ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)
    ctl.handle(SyncNow(version=7))
    assert coll.calls == [(1, None)] and ctl.synced == 8
    assert out.of(SyncAck)[0].version == 7


def test_a_chunk_that_ends_below_the_license_takes_part_in_the_rest_with_nothing() -> None:
    ctl, out, coll = _rank(picks=2)
    ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)  # trained while no license was out
    ctl.handle(Lockstep(until=4))
    ctl.book_step(SimpleNamespace(wait_ms=0.0), _Step(), 0)  # the chunk's last step: version 0 with both steps
    ctl._run_out_lockstep()
    assert coll.calls == [(2, 0), (0, 1), (0, 2), (0, 3)] and ctl.synced == 4


@pytest.mark.parametrize("versions,aligned", [([5, 5], True), ([5, 6], False), ([3, 4, 5], False), ([4, 4, 4], True),
                                              ([None, None], True), ([5, None], False)])
def test_the_head_tells_every_member_alike_whether_they_are_in_one_reduce(versions: list[Optional[int]],
                                                                          aligned: bool) -> None:
    flags = sum(1.0 for v in versions if v is not None)
    s = sum(float(v) for v in versions if v is not None)
    sq = sum(float(v) ** 2 for v in versions if v is not None)
    assert lockstep_aligned(flags, s, sq, len(versions)) is aligned


# -- the coordinator's side ------------------------------------------------------------------------------------------

class LockstepRanks(Ranks):
    """Scripted ranks that reduce on their own while licensed: after a step below the license a rank waits in
    that version's collective, which completes (every member acks, with its version and steps left) once every
    live rank is in it. A chunk that ends below the license takes part in the rest with nothing."""

    def __init__(self, world: int, slow: Optional[dict[int, int]] = None) -> None:
        super().__init__(world, slow=slow)
        self.until = [0] * world
        self.synced = [0] * world
        self.waiting: dict[int, set[int]] = defaultdict(set)
        self.lockstep_reduces = 0
        self.licenses: list[tuple[int, int]] = []
        self.run_outs = 0
        """Reduces a rank took part in with nothing, its chunk over below the license."""

    def _left(self, r: int) -> int:
        ch = self.r[r].chunk
        return 0 if ch is None else ch[3] - ch[4]

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        for r, p in out:
            if isinstance(p, Lockstep) and r not in self.dead:
                self.until[r] = max(self.until[r], p.until)
                self.licenses.append((r, p.until))
                if self.r[r].chunk is None and not self.r[r].blocked and self.synced[r] < self.until[r]:
                    self.run_outs += 1  # between chunks: the license's reduces at once (rank/control.py)
                    self._enter(r)
            if isinstance(p, SyncNow) and r not in self.dead:
                assert p.version >= self.until[r], f"sync_now {p.version} below the license {self.until[r]}"
                assert p.version == self.synced[r], (r, p.version, self.synced[r])
        answers = super().hear(out)
        fixed = []
        for r, a in answers:
            if isinstance(a, SyncAck):
                a = SyncAck(n=a.n, d=a.d, version=self.synced[r], left=self._left(r))
                self.synced[r] += 1
            fixed.append((r, a))
        return fixed

    def _enter(self, r: int) -> None:
        v = self.synced[r]
        self.r[r].blocked = True
        self.waiting[v].add(r)
        live = {q for q in range(len(self.r)) if q not in self.dead}
        if live <= self.waiting[v]:
            self.lockstep_reduces += 1
            for q in sorted(self.waiting.pop(v)):
                rk = self.r[q]
                self.pending.append((q, SyncAck(n=rk.steps, d=0.0, version=v, left=self._left(q))))
                rk.steps, rk.blocked = 0, False
                self.synced[q] += 1

    def next(self) -> Optional[tuple[int, Payload]]:
        for r, rk in enumerate(self.r):  # a chunk's end below the license: the rest with nothing, then its metrics
            ch = rk.chunk
            if r not in self.dead and not rk.blocked and ch is not None and ch[4] >= ch[3] \
                    and self.synced[r] < self.until[r]:
                self.run_outs += 1
                self._enter(r)
                return self.pending.popleft() if self.pending else None
        msg = super().next()
        if msg is not None and isinstance(msg[1], Batch):
            r = msg[0]
            if self.synced[r] < self.until[r]:
                self._enter(r)
        return msg


def _run(ahead: int, *, world: int = 2, epochs: int = 3, until: Any = None) -> tuple[Bare, LockstepRanks]:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", world, epochs=epochs, **{"mode.lockstep_ahead": ahead}), clock)
    ranks = LockstepRanks(world)
    play(w, ranks, clock, samples=960, max_steps=40_000, **({"until": until} if until else {}))
    return w, ranks


def test_a_licensed_run_reduces_every_step_and_ends_with_the_books_of_a_paced_one() -> None:
    paced, paced_ranks = _run(0)
    ahead, ranks = _run(8)
    a, b = paced.core.outcome(), ahead.core.outcome()
    assert a["status"] == b["status"] == "FINISHED"
    assert (a["global_step"], a["coverage"]) == (b["global_step"], b["coverage"])
    assert paced_ranks.lockstep_reduces == 0 and not sent(paced.log, Lockstep)
    assert ranks.lockstep_reduces > 0.8 * b["syncs"], (ranks.lockstep_reduces, b["syncs"])
    assert len(sent(ahead.log, SyncNow)) < 0.2 * len(sent(paced.log, SyncNow))
    assert b["syncs"] >= 0.9 * b["global_step"] / 2  # a reduce per step of each rank


def test_the_license_never_reaches_past_the_steps_a_rank_has_left() -> None:
    w, ranks = _run(8)
    assert ranks.licenses and ranks.run_outs == 0  # every licensed reduce came after a step of each rank's chunk
    grants = [p.until for c in sent(w.log, Lockstep) for p in [c.payload]]
    assert grants == sorted(grants) and max(grants) <= w.core.syncs
    assert w.core.life.status.value == "FINISHED"


def test_a_preemption_lets_the_license_run_out_before_its_bundle() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 2, epochs=3, **{"mode.lockstep_ahead": 8}), clock)
    ranks = LockstepRanks(2)
    play(w, ranks, clock, samples=960, max_steps=40_000, until=lambda: w.core.cycle.version > 20)
    assert w.core.cycle.lockstep_until > w.core.cycle.version  # mid-license
    granted = len(sent(w.log, Lockstep))
    w.core.request_preempt()
    play(w, ranks, clock, samples=960, max_steps=40_000)
    assert len(sent(w.log, Lockstep)) == granted  # never extended after the request
    assert w.core.life.status.value == "PREEMPTED"
    assert not ranks.waiting, "a rank was left in a collective"


def test_a_death_mid_license_finishes_its_reduces_with_the_survivors_and_the_run() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 3, epochs=3, **{"mode.lockstep_ahead": 8}), clock)
    ranks = LockstepRanks(3)
    play(w, ranks, clock, samples=960, max_steps=40_000, until=lambda: w.core.cycle.version > 12)
    assert w.core.cycle.lockstep_until > w.core.cycle.version
    granted = len(sent(w.log, Lockstep))
    ranks.dead.add(2)
    for members in ranks.waiting.values():  # the survivors' collective completes without the dead
        members.discard(2)
    w.core.on_death(2, "killed")
    for v in sorted(ranks.waiting):
        live = {0, 1}
        if live <= ranks.waiting[v]:
            for q in sorted(ranks.waiting.pop(v)):
                rk = ranks.r[q]
                ranks.pending.append((q, SyncAck(n=rk.steps, d=0.0, version=v, left=ranks._left(q), generation=1)))
                rk.steps, rk.blocked = 0, False
                ranks.synced[q] += 1
    play(w, ranks, clock, samples=960, max_steps=60_000)
    assert len(sent(w.log, Lockstep)) == granted  # no license after a death
    assert w.core.life.status.value == "FINISHED"
    assert coverage_is_exact(w.core, 960) and w.core.dispatch.lost_picks == 0


def test_a_rank_that_dies_with_answers_to_later_reduces_has_its_steps_counted_once() -> None:
    """Rank 0 answered two reduces past the one in flight (rank 2's answers held back), then died: its death hands
    those steps to the survivors (they are in no finished reduce), so its early answers are not booked as well:
    the run's global step is the no-death run's, every pick trained once."""
    clock = FakeClock()
    w = Bare(cfg_of("nccl_sync", 3, epochs=3, **{"mode.lockstep_ahead": 8}), clock)
    ranks = LockstepRanks(3)
    cyc = w.core.cycle
    play(w, ranks, clock, samples=960, max_steps=40_000,
         until=lambda: cyc.version > 10 and cyc.lockstep_until - cyc.version >= 4)
    held: list[tuple[int, Payload]] = []
    pending = ranks.pending
    for _ in range(5000):  # deliver everything but rank 2's answers until rank 0 has two early answers booked
        if sum(1 for acks in cyc._early.values() if 0 in acks) >= 2:
            break
        msg = pending.popleft() if pending else ranks.next()
        if msg is None:
            w.tick()
            pending.extend(ranks.hear(w.take()))
        elif msg[0] == 2 and isinstance(msg[1], SyncAck):
            held.append(msg)
        else:
            clock.advance(0.01)
            w.send(*msg)
            w.tick()
            pending.extend(ranks.hear(w.take()))
    assert sum(1 for acks in cyc._early.values() if 0 in acks) >= 2
    ranks.dead.add(0)
    for members in ranks.waiting.values():
        members.discard(0)
    w.core.on_death(0, "killed")
    pending.extendleft(reversed(held))
    for v in sorted(ranks.waiting):  # the survivors' collective completes without the dead
        if {1, 2} <= ranks.waiting[v]:
            for q in sorted(ranks.waiting.pop(v)):
                rk = ranks.r[q]
                pending.append((q, SyncAck(n=rk.steps, d=0.0, version=v, left=ranks._left(q))))
                rk.steps, rk.blocked = 0, False
                ranks.synced[q] += 1
    play(w, ranks, clock, samples=960, max_steps=60_000)
    reference, _ = _run(8, world=3)
    assert w.core.life.status.value == "FINISHED"
    assert w.core.outcome()["global_step"] == reference.core.outcome()["global_step"]
    assert coverage_is_exact(w.core, 960) and w.core.dispatch.lost_picks == 0
