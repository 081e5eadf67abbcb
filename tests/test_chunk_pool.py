"""Tests for flodl_exp.core.chunk_pool (algorithms.md §5.1/5.3/5.5/5.8, 7.2, 8.3/8.4)."""
from __future__ import annotations

import random
from typing import Any

import pytest

from flodl_exp.core.chunk_pool import (
    ChunkPool,
    FinalWindowPlan,
    OvershootTuner,
    cap_to_budget,
    compute_chunk_batches,
    final_window_alloc,
    reduce_budget,
    refresh_final_window_plan,
    reservation_span_batches,
)
from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, nudge_down
from flodl_exp.policy.base import AveragingPolicy
from flodl_exp.policy.builtin import ASYNC, CADENCE


def spans(pool: ChunkPool) -> list[tuple[int, int]]:
    return [pool.span(r) for r in range(pool.world_size)]


# -- span sizing --------------------------------------------------------------
def test_equal_spans_remainder_round_robin_from_rank_0():
    assert reservation_span_batches(10, [1, 1, 1]) == [4, 3, 3]
    assert reservation_span_batches(11, [1, 1, 1]) == [4, 4, 3]
    assert reservation_span_batches(11, [0, 0, 0]) == [4, 4, 3]  # pre-calibration
    # batch_size 10, 105 samples -> 100 aligned = 10 batches over 3 ranks.
    pool = ChunkPool(0, 105, 10, [5, 5, 5])
    assert pool.total_samples == 100
    assert spans(pool) == [(0, 40), (40, 70), (70, 100)]


def test_spans_from_counts():
    # 20 batches, counts [6, 3, 1]: floors 12, 6, 2 (exact)
    assert reservation_span_batches(20, [6, 3, 1]) == [12, 6, 2]
    # 10 batches, counts [2,1,1]: floors 5,2,2 -> one extra to rank 0
    assert reservation_span_batches(10, [2, 1, 1]) == [6, 2, 2]
    # 7 batches, counts [1,1,5]: floors 1,1,5 = 7
    assert reservation_span_batches(7, [1, 1, 5]) == [1, 1, 5]
    # 9 batches, counts [1,2,4]: floors 1,2,5 = 8 -> +1 rank 0
    assert reservation_span_batches(9, [1, 2, 4]) == [2, 2, 5]
    pool = ChunkPool(3, 200, 10, [2, 1, 1])
    assert spans(pool) == [(0, 100), (100, 150), (150, 200)]
    assert pool.epoch == 3 and pool.batch_size == 10


def test_invalid_construction():
    with pytest.raises(ValueError):
        ChunkPool(0, 100, 0, [1])
    with pytest.raises(ValueError):
        ChunkPool(0, 100, 10, [])


# -- take order ---------------------------------------------------------------
def test_own_span_front_then_steal_largest_residue_tail():
    pool = ChunkPool(0, 100, 10, [7, 3])  # [0,70) / [70,100)
    assert pool.take_chunk(30, 1) == (70, 30)
    assert pool.take_chunk(20, 1) == (50, 20)  # steal rank 0's tail
    assert pool.span(0) == (0, 50)
    assert pool.reservation(0) == (0, 50)
    assert pool.take_chunk(60, 0) == (0, 50)  # clamped to own residue
    assert pool.take_chunk(10, 0) is None and pool.take_chunk(10, 1) is None
    assert pool.remaining() == 0


def test_steal_tie_takes_last_maximal_donor():
    pool = ChunkPool(0, 90, 10, [1, 1, 1])  # [0,30) [30,60) [60,90)
    assert pool.take_chunk(30, 0) == (0, 30)
    assert pool.take_chunk(10, 0) == (80, 10)  # ranks 1 and 2 tie -> rank 2
    assert pool.take_chunk(10, 0) == (50, 10)  # now rank 1 (30) > rank 2 (20)


def test_reclaimed_served_first_and_split():
    pool = ChunkPool(0, 100, 10, [1, 1])  # [0,50) / [50,100)
    assert pool.take_chunk(50, 0) == (0, 50)
    assert pool.forfeit(0) == 50
    assert pool.reclaimed() == [(0, 50)]
    assert pool.take_chunk(20, 1) == (0, 20)
    assert pool.take_chunk(20, 1) == (20, 20)
    assert pool.take_chunk(20, 1) == (40, 10)  # rest of the hole, not own span
    assert pool.take_chunk(20, 1) == (50, 20)  # back to own span front
    assert pool.remaining() == 30


def test_take_size_zero_books_nothing_and_skips_reclaimed():
    pool = ChunkPool(0, 100, 10, [1, 1])
    assert pool.take_chunk(0, 0) == (0, 0)
    assert pool.remaining() == 100 and pool.in_flight(0) == 0
    assert pool.chunks_sent == [1, 0] and pool.outstanding(0) == []
    pool.take_chunk(10, 1)
    pool.forfeit(1)
    assert pool.take_chunk(0, 0) == (0, 0)  # size 0 never consumes a hole
    assert pool.reclaimed() == [(50, 10)]


# -- accounting ----------------------------------------------------------------
def test_remaining_in_flight_completed_done():
    pool = ChunkPool(0, 200, 10, [1, 1])
    assert not pool.is_epoch_done()
    pool.take_chunk(50, 0)
    pool.take_chunk(50, 1)
    pool.take_chunk(50, 0)
    pool.take_chunk(50, 1)
    assert pool.remaining() == 0
    assert pool.dispatched == [100, 100]
    assert pool.in_flight(0) == 100
    pool.mark_completed(0, 30)  # partial credit shrinks the front chunk
    assert pool.outstanding(0) == [(30, 20), (50, 50)]
    assert pool.in_flight(0) == 70
    pool.mark_completed(0, 70)
    pool.mark_completed(1, 100)
    assert pool.completed == [100, 100]
    assert pool.is_epoch_done()


def test_zero_total_pool_is_done():
    pool = ChunkPool(0, 5, 10, [1, 1])
    assert pool.total_samples == 0 and pool.remaining() == 0
    assert pool.take_chunk(10, 0) is None
    assert pool.is_epoch_done()


def test_epoch_elapsed_and_to_dict():
    pool = ChunkPool(2, 100, 10, [1, 1], now_ms=1000.0)
    assert pool.epoch_elapsed_ms(1250.0) == 250.0
    pool.take_chunk(20, 1)
    d = pool.to_dict()
    assert d["epoch"] == 2 and d["outstanding"] == [[], [(50, 20)]]
    assert d["remaining"] == 80 and d["spans"] == [(0, 50), (50, 100)]


# -- forfeit (§7.2) -------------------------------------------------------------
def test_forfeit_then_retake_covers_exactly():
    pool = ChunkPool(0, 100, 10, [1, 1])
    pool.take_chunk(30, 0)
    pool.take_chunk(20, 0)
    pool.mark_completed(0, 10)  # (0,10) covered, (10,20) + (30,20) in flight
    assert pool.forfeit(0) == 40
    assert pool.forfeit(0) == 0  # idempotent
    assert pool.in_flight(0) == 0 and pool.dispatched[0] == 10
    assert pool.remaining() == 100 - 10
    seen = []
    while (c := pool.take_chunk(15, 1)) is not None:
        seen.append(c)
        pool.mark_completed(1, c[1])
    assert seen[:3] == [(10, 15), (25, 5), (30, 15)]  # holes in dispatch order
    covered = sorted(x for o, s in seen for x in range(o, o + s))
    assert covered == list(range(10, 100))
    assert pool.is_epoch_done()


def test_completion_after_forfeit_is_clamped():
    pool = ChunkPool(0, 100, 10, [1, 1])
    pool.take_chunk(40, 0)
    pool.forfeit(0)
    pool.mark_completed(0, 40)  # falsely-dead rank reports anyway
    assert pool.completed[0] == 0 and pool.in_flight(0) == 0
    assert pool.take_chunk(40, 1) == (0, 40)
    assert pool.take_chunk(60, 1) == (50, 50)
    assert pool.take_chunk(60, 1) == (40, 10)
    pool.mark_completed(1, 100)
    assert pool.is_epoch_done()


# -- rollback -------------------------------------------------------------------
def test_rollback_rewinds_cursor():
    pool = ChunkPool(0, 100, 10, [1, 1])
    took = pool.take_chunk(40, 0)
    assert took is not None
    off, sz = took
    pool.rollback_take(0, off, sz)
    assert pool.remaining() == 100 and pool.in_flight(0) == 0
    assert pool.chunks_sent[0] == 0 and pool.reclaimed() == []
    assert pool.take_chunk(40, 0) == (0, 40)


def test_rollback_older_or_stolen_goes_to_reclaimed_and_unknown_ignored():
    pool = ChunkPool(0, 200, 10, [1, 1])
    a = pool.take_chunk(40, 0)
    pool.take_chunk(30, 0)
    assert a is not None
    pool.rollback_take(0, *a)  # not the newest: reclaimed
    assert pool.in_flight(0) == 30 and pool.chunks_sent[0] == 1
    assert pool.take_chunk(40, 1) == (0, 40)
    pool.rollback_take(0, 150, 10)  # never outstanding: no-op
    assert pool.in_flight(0) == 30 and pool.remaining() == 200 - 70
    # a steal rolled back: range returns via reclaimed, donor tail not restored
    p2 = ChunkPool(0, 40, 10, [0, 1])  # [0,0) / [0,40): rank 0 owns nothing
    assert p2.span(0) == (0, 0)
    st = p2.take_chunk(10, 0)
    assert st == (30, 10)
    p2.rollback_take(0, *st)
    assert p2.reclaimed() == [(30, 10)] and p2.remaining() == 40


# -- coverage (§8.3 / §8.4) ---------------------------------------------------
def test_uncovered_ranges_fresh_and_coalescing():
    pool = ChunkPool(0, 100, 10, [1, 1])
    assert pool.uncovered_ranges() == [(0, 100)]
    pool.take_chunk(30, 0)
    pool.take_chunk(20, 1)  # (50,20) in flight
    pool.mark_completed(0, 30)
    assert pool.uncovered_ranges() == [(30, 70)]  # residue+in-flight+residue coalesced
    pool.mark_completed(1, 20)
    assert pool.uncovered_ranges() == [(30, 20), (70, 30)]


def test_uncovered_ranges_include_reclaimed():
    pool = ChunkPool(0, 100, 10, [1, 1])
    pool.take_chunk(40, 0)
    pool.take_chunk(20, 1)
    pool.mark_completed(1, 20)
    pool.forfeit(0)
    assert pool.uncovered_ranges() == [(0, 50), (70, 30)]


def test_from_coverage_yields_exactly_the_uncovered_samples():
    orig = ChunkPool(0, 120, 10, [1, 1, 1])  # [0,40) [40,80) [80,120)
    orig.take_chunk(30, 0)
    orig.take_chunk(20, 1)
    orig.take_chunk(10, 2)
    orig.mark_completed(0, 30)
    orig.mark_completed(2, 10)
    unc = orig.uncovered_ranges()
    assert unc == [(30, 50), (90, 30)]
    pool = ChunkPool.from_coverage(0, orig.total_samples, 10, 3, unc)
    assert pool.remaining() == 80 and not pool.is_epoch_done()
    assert pool.uncovered_ranges() == unc
    hits = [0] * 120
    while pool.remaining():
        for r in range(3):
            c = pool.take_chunk(20, r)
            if c:
                for x in range(c[0], c[0] + c[1]):
                    hits[x] += 1
                pool.mark_completed(r, c[1])
    assert pool.is_epoch_done()
    assert hits == [int(30 <= i < 80 or 90 <= i < 120) for i in range(120)]
    assert ChunkPool.from_coverage(0, 100, 10, 2, []).is_epoch_done()
    with pytest.raises(ValueError):
        ChunkPool.from_coverage(0, 100, 10, 2, [(0, 20), (10, 5)])
    with pytest.raises(ValueError):
        ChunkPool.from_coverage(0, 100, 10, 2, [(90, 20)])


@pytest.mark.parametrize("seed", range(40))
def test_property_every_sample_exactly_once(seed):
    rng = random.Random(seed)
    w = rng.randint(1, 5)
    bs = rng.choice([1, 4, 10])
    total = rng.randint(0, 600)
    counts = [rng.randint(0, 6) for _ in range(w)]
    pool = ChunkPool(seed, total, bs, counts)
    n = pool.total_samples
    hits = [0] * n
    alive = list(range(w))
    fifo: dict[int, list[list[int]]] = {r: [] for r in range(w)}

    def complete(r: int, k: int) -> None:
        pool.mark_completed(r, k)
        while k > 0 and fifo[r]:
            o, s = fifo[r][0]
            t = min(k, s)
            for x in range(o, o + t):
                hits[x] += 1
            k -= t
            if t == s:
                fifo[r].pop(0)
            else:
                fifo[r][0] = [o + t, s - t]

    for _ in range(10_000):
        if pool.is_epoch_done():
            break
        r = rng.choice(alive)
        op = rng.random()
        if op < 0.5:
            c = pool.take_chunk(rng.randint(1, 6) * bs, r)
            if c is not None and c[1] > 0:
                if rng.random() < 0.1:
                    pool.rollback_take(r, *c)
                else:
                    fifo[r].append(list(c))
        elif op < 0.97 or len(alive) == 1:
            inflight = sum(s for _, s in fifo[r])
            if inflight:
                complete(r, rng.randint(1, inflight))
        else:
            pool.forfeit(r)  # rank dies with its outstanding chunks
            fifo[r] = []
            alive.remove(r)
        assert pool.remaining() + sum(pool.in_flight(q) for q in range(w)) + sum(
            hits) == n
        unc = pool.uncovered_ranges()
        assert sum(s for _, s in unc) == n - sum(hits)
    assert pool.is_epoch_done()
    assert hits == [1] * n


# -- final_window_alloc (§5.5) --------------------------------------------------
def test_fold_band_crumbs_go_to_slow_ranks_ascending():
    counts = [71, 18, 15]
    assert final_window_alloc(104, counts, [True] * 3) == [71, 18, 15]
    assert final_window_alloc(105, counts, [True] * 3) == [71, 18, 16]
    assert final_window_alloc(106, counts, [True] * 3) == [71, 19, 16]
    # crumb larger than the non-fastest set: round-robin (dead ranks shrink it)
    assert final_window_alloc(10, [5, 2, 1], [True, False, True]) == [5, 0, 5]
    # fastest tie -> lowest rank stays unpadded
    assert final_window_alloc(9, [4, 4], [True, True]) == [4, 5]
    # single alive rank takes everything
    assert final_window_alloc(9, [4, 4], [False, True]) == [0, 9]


def test_proportional_split_largest_remainder():
    # 10 * [5,3,2]/10 -> exact
    assert final_window_alloc(10, [5, 3, 2, 0], [True] * 4) == [5, 3, 2, 0]
    # 7 * [3,3,3]/9 = 2.33 each -> floors 2,2,2, +1 to rank 0 (stable ties)
    assert final_window_alloc(7, [3, 3, 3], [True] * 3) == [3, 2, 2]
    # 72 over [71,18,15]: 49.15, 12.46, 10.38 -> +1 to rank 1
    assert final_window_alloc(72, [71, 18, 15], [True] * 3) == [49, 13, 10]


def test_lone_ones_consolidate():
    # 3 over [71,18,15]: raw [2,1,0] -> lone 1 moved onto rank 0
    assert final_window_alloc(3, [71, 18, 15], [True] * 3) == [3, 0, 0]
    # 3 over [2,1,1]: floors [1,0,0], +1 to ranks 1,2 (fraction .75) -> [1,1,1];
    # rank 0's 1 onto the first smallest peer (rank 1), then rank 2's onto rank 1
    assert final_window_alloc(3, [2, 1, 1], [True] * 3) == [0, 3, 0]
    # the fold band never consolidates: the schedule itself is served
    assert final_window_alloc(4, [2, 1, 1], [True] * 3) == [2, 1, 1]
    assert final_window_alloc(1, [71, 18, 15], [True] * 3) == [1, 0, 0]  # irreducible
    for rem in range(2, 104):
        a = final_window_alloc(rem, [71, 18, 15], [True, True, True])
        assert sum(a) == rem and 1 not in a, (rem, a)


def test_final_window_sum_invariant_random():
    rng = random.Random(7)
    for _ in range(2000):
        w = rng.randint(1, 6)
        counts = [rng.randint(0, 40) for _ in range(w)]
        alive = [rng.random() < 0.8 for _ in range(w)]
        if not any(alive):
            alive[rng.randrange(w)] = True
        rem = rng.randint(0, sum(counts) + w)
        a = final_window_alloc(rem, counts, alive)
        assert sum(a) == rem, (rem, counts, alive, a)
        assert all(x == 0 for x, al in zip(a, alive) if not al)
    assert final_window_alloc(5, [3, 3], [False, False]) == [0, 0]
    assert final_window_alloc(0, [3, 3], [True, True]) == [0, 0]


def test_refresh_final_window_plan_pins_until_counts_or_epoch_change():
    kw: dict[str, Any] = dict(counts=[4, 2], alive=[True, True], barrier_paced=True)
    assert refresh_final_window_plan(None, epoch=0, rem=8, **kw) is None  # >= 6+2
    p = refresh_final_window_plan(None, epoch=0, rem=7, **kw)
    assert p == FinalWindowPlan(0, (4, 3), (4, 2), (True, True))
    assert refresh_final_window_plan(p, epoch=0, rem=3, **kw) is p  # pinned
    p2 = refresh_final_window_plan(p, epoch=0, rem=3, counts=[3, 3],
                                   alive=[True, True], barrier_paced=True)
    assert p2 is not None and p2.alloc == (3, 0)  # [2,1] -> lone 1 consolidated
    p3 = refresh_final_window_plan(p, epoch=1, rem=3, **kw)
    assert p3 is not None and p3.epoch == 1
    assert refresh_final_window_plan(p, epoch=0, rem=0, **kw) is None
    assert refresh_final_window_plan(None, epoch=0, rem=3, counts=[4, 2],
                                     alive=[True, True], barrier_paced=False) is None


def test_a_death_replans_the_final_window_for_the_survivors():
    # Pinned with rank 2's share; rank 2 dies (counts unchanged) and its picks come back to the pool: the plan
    # is made again, every remaining batch allotted to a live rank. Kept, it allotted the survivors nothing.
    counts = [2, 3, 4]
    p = refresh_final_window_plan(None, epoch=0, rem=4, counts=counts, alive=[True, True, True], barrier_paced=True)
    assert p is not None and p.alloc[2] > 0
    q = refresh_final_window_plan(p, epoch=0, rem=7, counts=counts, alive=[True, True, False], barrier_paced=True)
    assert q is not p and q is not None
    assert q.alloc[2] == 0 and sum(q.alloc) == 7


# -- compute_chunk_batches (§5.3) -----------------------------------------------
class _Unpaced(AveragingPolicy):
    """Neither barrier-paced nor streaming: the budget is the count, and chunks aim at the rank's share."""

    name = "unpaced"
    barrier_paced = False


UNPACED = _Unpaced()
BASE = dict(rank=0, rem_batches=1000, counts=[10, 5], steps=[0, 0],
            policy=ASYNC, max_overshoot=3, calibrated=True,
            has_speed_hint=False, total_samples=10_000, world_size=2,
            batch_size=10, final_alloc=None)


def ccb(**over) -> int:
    return compute_chunk_batches(**{**BASE, **over})


def test_ccb_empty_and_final_plan_pinned():
    assert ccb(rem_batches=0, final_alloc=[9, 9]) == 0
    assert ccb(rem_batches=5, final_alloc=[4, 1]) == 4  # bypasses everything
    assert ccb(rank=1, rem_batches=5, final_alloc=(4, 1), steps=[0, 99]) == 1


def test_ccb_edge_schedule_capped():
    assert ccb(rem_batches=12) == 10  # rem < 15: min(counts[r], rem)
    assert ccb(rem_batches=7) == 7
    assert ccb(rem_batches=12, steps=[11, 0]) == 2  # cap: 13 - 11
    assert ccb(rem_batches=12, steps=[20, 0]) == 1  # floor 1
    assert ccb(rem_batches=12, policy=UNPACED, steps=[8, 0]) == 2
    assert ccb(rem_batches=12, counts=[0, 15]) == 0  # 0-share rank gets 0


def test_ccb_schedule_exact_for_barrier_paced():
    assert ccb(policy=CADENCE) == 10  # a whole window at its start
    # Mid-window (only after the cold-start probe re-sized a window a rank had begun): its rest. The
    # reference never asks then (its counts move only at a reduce), so it is uncapped there.
    assert ccb(policy=CADENCE, steps=[4, 0]) == 6
    assert ccb(policy=CADENCE, calibrated=False) == 10


def test_ccb_probe_for_uncalibrated_async():
    assert ccb(calibrated=False) == 50  # 10000 // (2*10*10)
    assert ccb(calibrated=False, total_samples=100) == 4  # floor 4
    assert ccb(calibrated=False, rem_batches=16, counts=[0, 0]) == 16  # min(50, rem)
    assert ccb(calibrated=False, rem_batches=3, total_samples=100, counts=[0, 0]) == 3
    assert ccb(calibrated=False, has_speed_hint=True) != 50  # hint skips probe


def test_ccb_target_ceil_min_and_cap():
    assert ccb(max_overshoot=10_000) == 667  # ceil(1000*10/15)
    assert ccb(rank=1, max_overshoot=10_000) == 334  # ceil(1000*5/15)
    assert ccb() == 13  # capped at budget 10+3
    assert ccb(steps=[5, 0]) == 8
    assert ccb(counts=[0, 0]) == 4  # tc == 0 -> min(rem, min_chunk)
    assert ccb(counts=[0, 0], rem_batches=3) == 3
    assert ccb(rank=1, counts=[100, 1], rem_batches=101, max_overshoot=10) == 4
    assert ccb(rank=1, counts=[100, 1], rem_batches=101, max_overshoot=0) == 1
    assert ccb(rank=1, counts=[100, 1], rem_batches=101, min_chunk_batches=6,
               max_overshoot=10) == 6


def test_reduce_budget_and_cap():
    assert reduce_budget(0, [10, 0], ASYNC, 3) == 13
    assert reduce_budget(0, [10, 0], CADENCE, 3) == 10
    assert reduce_budget(1, [10, 0], ASYNC, 3) == 0
    assert reduce_budget(5, [10, 0], ASYNC, 3) == 0
    kw: dict[str, Any] = dict(counts=[10, 0], steps=[4, 100], policy=CADENCE, max_overshoot=0)
    assert cap_to_budget(0, 20, **kw) == 6
    assert cap_to_budget(0, 3, **kw) == 3
    assert cap_to_budget(1, 20, **kw) == 20  # no budget -> untouched


# -- OvershootTuner (§5.8) --------------------------------------------------------
def test_overshoot_tuner_auto():
    t = OvershootTuner()
    assert t.value == 3
    for _ in range(20):
        t.on_verdict(STABLE)
    assert t.value == 15
    t.on_verdict(SUPPRESS_GROWTH)
    assert t.value == 15
    assert t.on_verdict(nudge_down(0.5)) == 3
    t.on_verdict(STABLE)
    assert t.value == 4


def test_overshoot_tuner_pinned():
    for t in (OvershootTuner.pinned(7), OvershootTuner(user_set=7)):
        assert (t.initial, t.ceiling, t.auto, t.value) == (7, 7, False, 7)
        t.on_verdict(STABLE)
        t.on_verdict(nudge_down(0.5))
        assert t.value == 7
    assert OvershootTuner.pinned(0).value == 0
    assert OvershootTuner(initial=20, ceiling=15).value == 15


def test_reopen_serves_a_completed_range_again_before_anything_else():
    pool = ChunkPool(0, 96, 8, [1, 1])
    a = pool.take_chunk(16, 0)
    assert a == (0, 16)
    pool.mark_completed(0, 16)
    assert pool.reopen(0, 8, 8) == 8  # the last batch of that chunk never reached a reduce
    assert pool.completed == [8, 0] and pool.dispatched == [8, 0]
    assert not pool.is_epoch_done() and pool.uncovered_ranges() == [(8, 88)]  # reopened + never taken, coalesced
    assert pool.take_chunk(16, 1) == (8, 8), "reclaimed work first"
    assert pool.reopen(1, 0, 100) == 0, "nothing completed: nothing to reopen"


def test_subtract_ranges():
    from flodl_exp.core.chunk_pool import subtract_ranges

    assert subtract_ranges([(0, 100)], [(10, 20), (50, 10)]) == [(0, 10), (30, 20), (60, 40)]
    assert subtract_ranges([(0, 10), (20, 10)], [(5, 20)]) == [(0, 5), (25, 5)]
    assert subtract_ranges([(0, 10)], [(0, 10)]) == [] and subtract_ranges([(0, 10)], []) == [(0, 10)]


def test_remaining_is_kept_exactly_through_every_way_the_pool_moves() -> None:
    """remaining() is a running count (a sum over every rank's span per chunk was O(W^2) a window at a
    thousand ranks): after any sequence of takes, steals, completions, reopens, forfeits and rollbacks it
    equals the recount."""
    import random

    from flodl_exp.core.chunk_pool import ChunkPool

    rng = random.Random(7)
    for trial in range(30):
        w = rng.randint(1, 6)
        pool = ChunkPool(0, rng.randint(0, 4000), 8, [rng.randint(1, 9) for _ in range(w)])
        taken: list[tuple[int, int, int]] = []
        for _ in range(200):
            op, r = rng.random(), rng.randrange(w)
            if op < 0.5:
                got = pool.take_chunk(rng.randint(0, 12) * 8, r)
                if got is not None:
                    taken.append((r, *got))
            elif op < 0.7:
                pool.mark_completed(r, rng.randint(0, 5) * 8)
            elif op < 0.8:
                pool.reopen(r, rng.randrange(4000), rng.randint(0, 3) * 8)
            elif op < 0.9:
                pool.forfeit(r)
            elif taken:
                pool.rollback_take(*taken.pop(rng.randrange(len(taken))))
            assert pool.remaining() == pool._recount(), f"trial {trial}"
