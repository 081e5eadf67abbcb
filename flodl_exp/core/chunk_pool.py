"""Progressive dispatch, pure pieces (algorithms.md §5.1, 5.3, 5.5, 5.8, 7.2, 8.3/8.4).

Owns the per-epoch :class:`ChunkPool` (who gets which slice of the
batch-aligned sample range, and what is still uncovered), the chunk-sizing
rules (:func:`compute_chunk_batches`, :func:`cap_to_budget`,
:func:`reduce_budget`), the epoch's final-window split
(:func:`final_window_alloc`, :func:`refresh_final_window_plan`) and the Async
lookahead auto-tune (:class:`OvershootTuner`).

Kept apart from the coordinator so the books that guarantee "every sample is
trained exactly once per epoch" can be tested exhaustively without sockets,
clocks or torch: everything here is a pure function of its inputs (time is
passed in as ``now_ms``). Sizes handed to the pool are in SAMPLES; sizing
functions speak BATCHES.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from flodl_exp.policy.actions import ConvergenceAction
from flodl_exp.policy.base import AveragingPolicy

Range = tuple[int, int]  # (offset, size)



class IntLookup(Protocol):
    """Per-rank ints read by index (a list, or a view over a ledger that builds no list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> int: ...

def reservation_span_batches(total_batches: int, counts: list[int]) -> list[int]:
    """Per-rank reserved span sizes in batches: ``total_batches·counts[r] // Σcounts``
    (equal split when ``Σcounts == 0``), remainder +1 round-robin from rank 0."""
    w = len(counts)
    if w == 0:
        raise ValueError("counts must name at least one rank")
    tc = sum(counts)
    if tc > 0:
        out = [total_batches * c // tc for c in counts]
    else:
        out = [total_batches // w] * w
    for i in range(total_batches - sum(out)):
        out[i % w] += 1
    return out


class ChunkPool:
    """One epoch's pool over ``[0, floor(total_samples / batch_size)·batch_size)``.

    The range is partitioned into contiguous per-rank reserved spans (rank
    order). A rank consumes its span front-to-back; a rank that ran out peels
    the tail of the largest-residue span; a dead rank's outstanding chunks go
    to ``reclaimed`` and are served before anything else.
    ``total_samples`` is stored batch-aligned (what a coverage snapshot records).
    """

    def __init__(self, epoch: int, total_samples: int, batch_size: int,
                 counts: list[int], now_ms: float = 0.0) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if total_samples < 0 or any(c < 0 for c in counts):
            raise ValueError("total_samples and counts must be >= 0")
        self.epoch = epoch
        self.batch_size = batch_size
        self.total_samples = (total_samples // batch_size) * batch_size
        sizes = reservation_span_batches(self.total_samples // batch_size, list(counts))
        w = len(sizes)
        self._spans: list[list[int]] = []  # [start, end), end moves down on steal
        at = 0
        for b in sizes:
            self._spans.append([at, at + b * batch_size])
            at += b * batch_size
        self._cursor = [s for s, _ in self._spans]
        self._dispatched = [0] * w
        self._completed = [0] * w
        self._chunks_sent = [0] * w
        self._outstanding: list[deque[list[int]]] = [deque() for _ in range(w)]
        self._reclaimed: deque[Range] = deque()
        self.epoch_start_ms = float(now_ms)
        self._remaining = self.total_samples
        """Unassigned samples (residues + reclaimed), kept as they move: remaining() is asked per chunk, and a
        sum over every rank's span each time made a window O(W^2) at a thousand ranks."""

    # -- read-outs -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._spans)

    @property
    def dispatched(self) -> list[int]:
        """Per-rank samples dispatched (copy)."""
        return list(self._dispatched)

    @property
    def completed(self) -> list[int]:
        return list(self._completed)

    @property
    def chunks_sent(self) -> list[int]:
        return list(self._chunks_sent)

    def residue(self, rank: int) -> int:
        """Unassigned samples left in ``rank``'s own span."""
        return max(self._spans[rank][1] - self._cursor[rank], 0)

    def reservation(self, rank: int) -> Range:
        """``(next_offset, len)`` of the unassigned front of ``rank``'s span."""
        return (self._cursor[rank], self.residue(rank))

    def span(self, rank: int) -> Range:
        """Current reserved span of ``rank`` as ``(start, end)``."""
        return (self._spans[rank][0], self._spans[rank][1])

    def outstanding(self, rank: int) -> list[Range]:
        return [(o, s) for o, s in self._outstanding[rank]]

    def reclaimed(self) -> list[Range]:
        return list(self._reclaimed)

    def remaining(self) -> int:
        return self._remaining

    def _recount(self) -> int:
        return sum(self.residue(r) for r in range(self.world_size)) + sum(s for _, s in self._reclaimed)

    def in_flight(self, rank: int) -> int:
        return max(self._dispatched[rank] - self._completed[rank], 0)

    def is_epoch_done(self) -> bool:
        return self.remaining() == 0 and all(
            c >= d for d, c in zip(self._dispatched, self._completed))

    def epoch_elapsed_ms(self, now_ms: float) -> float:
        return now_ms - self.epoch_start_ms

    # -- mutation ------------------------------------------------------------
    def _book(self, rank: int, off: int, size: int) -> Range:
        self._remaining -= size
        self._dispatched[rank] += size
        self._chunks_sent[rank] += 1
        if size > 0:
            self._outstanding[rank].append([off, size])
        return (off, size)

    def take_chunk(self, size: int, rank: int) -> Range | None:
        """Take up to ``size`` samples for ``rank``: reclaimed holes first, then
        the own span's front, then the tail of the largest-residue other span
        (ties: the highest rank, like Rust ``max_by_key``). ``None`` if empty."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if size > 0 and self._reclaimed:
            off, sz = self._reclaimed.popleft()
            a = min(size, sz)
            if a < sz:
                self._reclaimed.appendleft((off + a, sz - a))
            return self._book(rank, off, a)
        res = self.residue(rank)
        if res > 0:
            a = min(size, res)
            off = self._cursor[rank]
            self._cursor[rank] += a
            return self._book(rank, off, a)
        donor, best = None, 0
        for r in range(self.world_size):
            if r != rank and self.residue(r) >= best:
                donor, best = r, self.residue(r)
        if donor is None or best == 0:
            return None
        a = min(size, best)
        self._spans[donor][1] -= a
        return self._book(rank, self._spans[donor][1], a)

    def mark_completed(self, rank: int, n: int) -> None:
        """Credit ``n`` completed samples (clamped to dispatched: a falsely
        declared-dead rank may report after its chunks were forfeited) and
        consume them from the front of the rank's outstanding FIFO."""
        self._completed[rank] = min(self._completed[rank] + n, self._dispatched[rank])
        q, left = self._outstanding[rank], n
        while left > 0 and q:
            front = q[0]
            if front[1] <= left:
                left -= front[1]
                q.popleft()
            else:
                front[0] += left
                front[1] -= left
                left = 0

    def reopen(self, rank: int, offset: int, size: int) -> int:
        """A range ``rank`` completed whose training never reached the consensus (it died before
        the reduce): un-complete it and serve it again, first, from the reclaimed queue.
        Returns the samples reopened (clamped to what the rank had completed)."""
        size = max(0, min(int(size), self._completed[rank]))
        if size:
            self._completed[rank] -= size
            self._dispatched[rank] -= size
            self._reclaimed.append((int(offset), size))
            self._remaining += size
        return size

    def forfeit(self, rank: int) -> int:
        """Dead rank: move its outstanding chunks (dispatch order) to the back of
        ``reclaimed`` and un-dispatch them. Returns samples moved; idempotent."""
        moved = 0
        q = self._outstanding[rank]
        while q:
            off, sz = q.popleft()
            moved += sz
            self._reclaimed.append((off, sz))
        self._dispatched[rank] = max(self._dispatched[rank] - moved, 0)
        self._remaining += moved
        return moved

    def rollback_take(self, rank: int, offset: int, size: int) -> None:
        """Undo a take whose send failed. Rewinds the cursor when the chunk was
        the latest own-span take; otherwise the range goes to the front of
        ``reclaimed``. A range not outstanding for ``rank`` is ignored."""
        if size <= 0:
            return
        q = self._outstanding[rank]
        pos = next((i for i in range(len(q) - 1, -1, -1)
                    if q[i][0] == offset and q[i][1] == size), None)
        if pos is None:
            return
        del q[pos]
        self._dispatched[rank] = max(self._dispatched[rank] - size, 0)
        self._chunks_sent[rank] = max(self._chunks_sent[rank] - 1, 0)
        if self._cursor[rank] == offset + size and offset >= self._spans[rank][0]:
            self._cursor[rank] = offset
        else:
            self._reclaimed.appendleft((offset, size))
        self._remaining = self._recount()

    # -- coverage (checkpoint / resume) --------------------------------------
    def uncovered_ranges(self) -> list[Range]:
        """Sorted, coalesced union of span residues, in-flight chunks (not yet
        covered by design) and reclaimed ranges."""
        rs = [self.reservation(r) for r in range(self.world_size)]
        rs += [(o, s) for q in self._outstanding for o, s in q]
        rs += list(self._reclaimed)
        return _coalesce(rs)

    @classmethod
    def from_coverage(cls, epoch: int, total_samples: int, batch_size: int,
                      world_size: int, uncovered: list[Range],
                      now_ms: float = 0.0) -> ChunkPool:
        """Pool whose only work is ``uncovered`` (served in offset order via
        the reclaimed queue); spans are parked empty so nothing else is served."""
        pool = cls(epoch, total_samples, batch_size, [1] * world_size, now_ms)
        for r in range(world_size):
            pool._cursor[r] = pool._spans[r][1]
        holes = sorted((int(o), int(s)) for o, s in uncovered if s > 0)
        end = 0
        for o, s in holes:
            if o < end or o + s > pool.total_samples:
                raise ValueError(f"uncovered range {(o, s)} overlaps or exceeds "
                                 f"[0, {pool.total_samples})")
            end = o + s
        pool._reclaimed = deque(holes)
        pool._remaining = pool._recount()
        return pool

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "total_samples": self.total_samples,
            "batch_size": self.batch_size,
            "spans": [self.span(r) for r in range(self.world_size)],
            "cursors": list(self._cursor), "dispatched": self.dispatched,
            "completed": self.completed, "chunks_sent": self.chunks_sent,
            "outstanding": [self.outstanding(r) for r in range(self.world_size)],
            "reclaimed": self.reclaimed(), "remaining": self.remaining(),
            "epoch_start_ms": self.epoch_start_ms,
        }


def _coalesce(ranges: list[Range]) -> list[Range]:
    out: list[list[int]] = []
    for o, s in sorted(r for r in ranges if r[1] > 0):
        if out and o <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], o + s - out[-1][0])
        else:
            out.append([o, s])
    return [(o, s) for o, s in out]


def subtract_ranges(ranges: list[Range], minus: list[Range]) -> list[Range]:
    """``ranges`` without every sample in ``minus`` (both [offset, size] lists), sorted and coalesced."""
    out: list[Range] = []
    for o, s in ranges:
        segs = [(o, o + s)]
        for mo, ms in minus:
            a, b = mo, mo + ms
            segs = [piece for x, y in segs
                    for piece in (((x, y),) if b <= x or a >= y else ((x, a), (b, y)))
                    if piece[1] > piece[0]]
        out += [(x, y - x) for x, y in segs]
    return _coalesce(out)


# -- final reduce window (§5.5) ----------------------------------------------
def _fastest_alive(counts: list[int], alive: list[bool]) -> int | None:
    best = None
    for r, c in enumerate(counts):
        if alive[r] and (best is None or c > counts[best]):
            best = r
    return best


def _consolidate_lone_ones(alloc: list[int], alive: list[bool]) -> None:
    while True:
        orphan = next((r for r in range(len(alloc)) if alive[r] and alloc[r] == 1), None)
        if orphan is None:
            return
        peers = [p for p in range(len(alloc)) if p != orphan and alive[p] and alloc[p] >= 1]
        if not peers:
            return
        peer = min(peers, key=lambda p: alloc[p])  # first minimal, like Rust min_by_key
        alloc[peer] += 1
        alloc[orphan] = 0


def final_window_alloc(rem: int, counts: list[int], alive: list[bool]) -> list[int]:
    """Split the epoch's last ``rem`` batches into one window (per-rank batches).

    Fold band (``rem >= Σ alive counts``): every alive rank its count, the crumb
    round-robin over the non-fastest alive ranks sorted by count ascending.
    Below: largest-remainder split by counts, then lone 1s consolidated.
    ``Σ == rem`` whenever some rank is alive (all-zero alive counts fall back to
    equal weights); dead ranks get 0."""
    w = len(counts)
    alloc = [0] * w
    live = [r for r in range(w) if alive[r]]
    if rem <= 0 or not live:
        return alloc
    weights = list(counts) if sum(counts[r] for r in live) > 0 else [1] * w
    total = sum(weights[r] for r in live)
    if rem >= total:
        for r in live:
            alloc[r] = weights[r]
        crumb = rem - total
        fast = _fastest_alive(weights, alive)
        order = sorted((r for r in live if r != fast), key=lambda r: weights[r])
        if not order:
            alloc[fast] += crumb  # type: ignore[index]
        else:
            for i in range(crumb):
                alloc[order[i % len(order)]] += 1
        return alloc
    fracs: list[tuple[int, int]] = []
    for r in live:
        alloc[r], num = divmod(rem * weights[r], total)  # exact integer remainders
        fracs.append((r, num))
    fracs.sort(key=lambda t: -t[1])  # stable: ties keep rank order
    for i in range(rem - sum(alloc)):
        alloc[fracs[i % len(fracs)][0]] += 1
    _consolidate_lone_ones(alloc, alive)
    return alloc


@dataclass(frozen=True)
class FinalWindowPlan:
    epoch: int
    alloc: tuple[int, ...]
    pinned_counts: tuple[int, ...]
    pinned_alive: tuple[bool, ...] = ()
    """The live ranks the plan was made for: a death re-plans (see :func:`refresh_final_window_plan`)."""


def refresh_final_window_plan(prev: FinalWindowPlan | None, *, epoch: int, rem: int,
                              counts: Sequence[int], alive: Sequence[bool],
                              barrier_paced: bool) -> FinalWindowPlan | None:
    """§5.5 pinning: a plan exists only when barrier-paced and
    ``0 < rem < Σ alive counts + W``; kept while epoch, counts and the live ranks are unchanged.

    The reference pins on the epoch and the counts only. A death leaves the counts as they were but gives the
    dead rank's share back to the pool: a plan kept then holds the dead rank's slot and none for the returned
    picks, every survivor is allotted 0, and the epoch never ends (found by a fault fuzz of the control core,
    tests/test_fault_fuzz.py: two deaths in a 4-rank cpu_cadence run left 10 batches of epoch 0 to nobody).

    Called for every chunk handed out, so every rank of a reduce's next round: no Python-level loop over the
    world here (``compress``/``tuple`` run in C), or a round costs O(W^2) interpreted steps (a quarter of a
    second at 1,024 ranks)."""
    if not barrier_paced or rem <= 0:
        return None
    total = sum(itertools.compress(counts, alive))
    if total == 0 or rem >= total + len(counts):
        return None
    pinned, live = tuple(counts), tuple(alive)
    if prev is not None and prev.epoch == epoch and prev.pinned_counts == pinned and prev.pinned_alive == live:
        return prev
    return FinalWindowPlan(epoch, tuple(final_window_alloc(rem, list(counts), list(alive))), pinned, live)


# -- staging advisories (§5.10) ------------------------------------------------
ADVISORY_DONORS = 8
"""Peers whose residue tails an advisory names: the largest residues, the ones ``take_chunk`` steals from."""


def advisory_donors(pool: ChunkPool, alive: Sequence[bool], k: int = ADVISORY_DONORS) -> list[int]:
    """The ``k + 1`` live ranks with the largest residue (ties: the highest rank, as ``take_chunk``), in rank
    order: computed once per advisory round, so a round is O(W), not O(W^2), at a thousand ranks."""
    live = [r for r in range(pool.world_size) if alive[r] and pool.residue(r) > 0]
    if len(live) > k + 1:
        live = sorted(sorted(live, key=lambda r: (pool.residue(r), r), reverse=True)[:k + 1])
    return live


def stage_advisory(pool: ChunkPool, rank: int, counts: Sequence[int], alive: Sequence[bool],
                   donors: Optional[list[int]] = None) -> list[Range]:
    """The picks ``rank`` is likely to be handed from ``pool``, most likely first: the unassigned rest of its
    own span, then the tail of the other live ranks' residue (``max(counts[o], 1)`` batches, capped at the
    residue: what it would take over from a slower peer), of at most :data:`ADVISORY_DONORS` peers (the largest
    residues, ``donors``; every live peer on worlds up to 9 ranks). ``(offset, size)`` ranges of the epoch's
    permutation. Purely advisory: it never changes the allocation."""
    bs = pool.batch_size
    out: list[Range] = []
    off, size = pool.reservation(rank)
    if size > 0:
        out.append((off, size))
    peers = [o for o in (donors if donors is not None else advisory_donors(pool, alive)) if o != rank][:ADVISORY_DONORS]
    for o in peers:
        if not alive[o]:
            continue
        res = pool.residue(o)
        if res <= 0:
            continue
        margin = min(max(_at(counts, o), 1) * bs, res)
        out.append((pool.span(o)[1] - margin, margin))
    return out


# -- chunk sizing (§5.3) ------------------------------------------------------
def _at(xs: IntLookup, i: int) -> int:
    return xs[i] if 0 <= i < len(xs) else 0


def reduce_budget(rank: int, counts: Sequence[int], policy: AveragingPolicy, max_overshoot: int) -> int:
    """Steps ``rank`` may run between reduces, as its policy sets them; 0 means "no barrier" (0-share rank)."""
    return policy.reduce_budget(_at(counts, rank), max_overshoot)


def cap_to_budget(rank: int, x: int, *, counts: Sequence[int], steps: IntLookup,
                  policy: AveragingPolicy, max_overshoot: int) -> int:
    """Never size a chunk past the reduce barrier (floor 1, never inflating x)."""
    b = reduce_budget(rank, counts, policy, max_overshoot)
    return x if b == 0 else min(x, max(b - _at(steps, rank), 1))


def compute_chunk_batches(*, rank: int, rem_batches: int, counts: Sequence[int],
                          steps: IntLookup, policy: AveragingPolicy,
                          max_overshoot: int, calibrated: bool, has_speed_hint: bool,
                          total_samples: int, world_size: int, batch_size: int,
                          final_alloc: list[int] | tuple[int, ...] | None,
                          min_chunk_batches: int = 4) -> int:
    """Batches for ``rank``'s next chunk. ``final_alloc`` is the pinned
    final-window plan's alloc for this epoch (or ``None``)."""
    rem = rem_batches
    if rem <= 0:
        return 0
    if final_alloc is not None:
        return _at(final_alloc, rank)

    def cap(x: int) -> int:
        return cap_to_budget(rank, x, counts=counts, steps=steps, policy=policy, max_overshoot=max_overshoot)

    tc = sum(counts)
    c = _at(counts, rank)
    if tc > 0 and rem < tc:
        return cap(min(c, rem))
    if policy.barrier_paced and c > 0:
        # the rest of this window (all of it at a window's start; less after a cold-start probe
        # re-sized the window a rank had already begun)
        return cap(min(c, rem))
    if not calibrated and not has_speed_hint:
        probe = total_samples // max(world_size * 10 * batch_size, 1)
        return min(max(probe, 4), rem)
    if tc == 0:
        return min(rem, min_chunk_batches)
    target = -(-rem * c // tc)
    return cap(min(max(target, min_chunk_batches), rem))


# -- Async lookahead (§5.8) ---------------------------------------------------
class OvershootTuner:
    """``max_overshoot`` hill-climb: Stable +1 (to ceiling), NudgeDown → initial,
    SuppressGrowth holds. A user-set value pins it (``initial = ceiling = n``)."""

    def __init__(self, initial: int = 3, ceiling: int = 15, auto: bool = True,
                 *, user_set: int | None = None) -> None:
        if user_set is not None:
            initial, ceiling, auto = user_set, user_set, False
        if initial < 0 or ceiling < 0:
            raise ValueError("overshoot initial/ceiling must be >= 0")
        self.initial, self.ceiling, self.auto = initial, ceiling, auto
        self._value = min(initial, ceiling)

    @classmethod
    def pinned(cls, n: int) -> OvershootTuner:
        return cls(user_set=n)

    @property
    def value(self) -> int:
        return self._value

    def on_verdict(self, action: ConvergenceAction) -> int:
        """Apply one finish's verdict (call under Async only); returns the value."""
        if self.auto:
            if action.kind == "stable":
                self._value += 1
            elif action.kind == "nudge_down":
                self._value = self.initial
            self._value = min(self._value, self.ceiling)
        return self._value
