"""Epoch dispatch and in-order aggregation (algorithms.md 4.4, 5, 3.13).

* Non-progressive: one plan per rank per epoch, consecutive batch-aligned
  slices sized by ``partition_ratios``, equal split (sync), or measured
  throughput (cadence/async once ElChe is calibrated).
* Progressive: a :class:`ChunkPool` per epoch hands each rank chunks sized to
  its reduce window; barrier-paced policies never let a rank cross a reduce or
  an epoch barrier, async may stream ahead within its overshoot budget.

Epochs aggregate strictly in order: :meth:`Dispatcher.pop_aggregated` hands the
coordinator one finished epoch at a time, and :meth:`Dispatcher.advance` starts
the next unless the gate holds it (an epoch-boundary bundle). The dispatcher owns
the chunks in flight, the pools, the per-epoch accumulators and the coverage of
aggregated epochs; it reads liveness from the cohort and counts from the cycle.
"""
from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from flodl_exp.core.chunk_pool import (
    ChunkPool,
    FinalWindowPlan,
    OvershootTuner,
    advisory_donors,
    compute_chunk_batches,
    reduce_budget,
    refresh_final_window_plan,
    stage_advisory,
    subtract_ranges,
)
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.epoch_metrics import EpochAccumulator
from flodl_exp.core.epoch_plan import EpochPlan
from flodl_exp.core.outbox import Outbox
from flodl_exp.outer_step import OuterStep
from flodl_exp.partition import batch_aligned_plans, equal_sizes, ratio_to_sizes, throughput_sizes
from flodl_exp.policy.actions import ConvergenceAction
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import ChunkMetrics, ExtendPartition, StageAdvisory, StartEpoch, Telemetry

log = logging.getLogger("flodl_exp.coordinator")

AnswerSnapshot = tuple[dict[int, int], int]
"""A rank's training progress when it answered a reduce: batches per chunk in flight, and its finished chunks."""

PROBE_EXTRA_WINDOWS = 4
"""How many windows' worth a rank may train past its count while the cold-start probe is still open (the slowest
rank's probe steps are what it waits for; its start-up may lag the others' by a second on a loaded host)."""


class Gate(enum.Enum):
    OPEN = "open"
    HOLD_EPOCH = "hold_epoch"
    """Chunks of the open epoch go on; no rank crosses into the next (an epoch-boundary bundle)."""
    CLOSED = "closed"
    """Nothing is handed out (draining, bundles, shutdown)."""


@dataclass
class Chunk:
    rank: int
    epoch: int
    offset: int
    size: int


class ChunkBook(dict[int, Chunk]):
    """chunk id -> Chunk, counting chunks per rank and per epoch as they come and go (the only ways the
    book changes), so "has rank r a chunk out" and "has epoch e one" are O(1), not a scan of every chunk
    (asked per chunk handed out: O(W^2) a window at a thousand ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_rank: Counter[int] = Counter()
        self.by_epoch: Counter[int] = Counter()

    def __setitem__(self, cid: int, ch: Chunk) -> None:
        old = self.get(cid)
        if old is not None:
            self._drop(old)
        super().__setitem__(cid, ch)
        self.by_rank[ch.rank] += 1
        self.by_epoch[ch.epoch] += 1

    def _drop(self, ch: Chunk) -> None:
        self.by_rank[ch.rank] -= 1
        self.by_epoch[ch.epoch] -= 1

    def __delitem__(self, cid: int) -> None:
        self._drop(self[cid])
        super().__delitem__(cid)

    def pop(self, cid: int, default: Any = None) -> Any:
        if cid in self:
            ch = super().pop(cid)
            self._drop(ch)
            return ch
        return default


class _Steps:
    """Every rank's steps of its window in progress, read from the cycle's ledger on demand (a list built per
    chunk handed out would cost O(W) each): since the last reduce, or since its answer to an overlapped one."""

    def __init__(self, cycle: AveragingCycle, world_size: int) -> None:
        self._cycle, self._w = cycle, world_size

    def __len__(self) -> int:
        return self._w

    def __getitem__(self, r: int) -> int:
        return self._cycle.window_steps(r)


@dataclass
class AggregatedEpoch:
    epoch: int
    metrics: dict[str, float]
    ranges: list[list[int]]


@dataclass(frozen=True)
class DispatchSettings:
    """What dispatch reads of the config: the shape of the work and the mode's knobs for handing it out."""

    world_size: int
    batch_size: int
    mode: Mode
    progressive: bool
    max_overshoot: Optional[int] = None
    """``mode.max_overshoot``: pins the overshoot budget (None: the guard tunes it)."""
    partition_ratios: Optional[list[float]] = None
    scalar_reductions: dict[str, str] = field(default_factory=dict)
    advise: bool = False
    """``data_plane.stage_advisories``."""


class Dispatcher:
    def __init__(self, *, settings: DispatchSettings, epochs: Union[int, EpochPlan], cohort: Cohort,
                 cycle: AveragingCycle, outbox: Outbox, clock: Callable[[], float]) -> None:
        world_size, mode, progressive = settings.world_size, settings.mode, settings.progressive
        max_overshoot, partition_ratios = settings.max_overshoot, settings.partition_ratios
        self.W = world_size
        self.bs = settings.batch_size
        self._plan = EpochPlan.of(epochs)
        self.mode = mode
        self.progressive = progressive
        self.advise = settings.advise and progressive
        """Send staging advisories (``data_plane.stage_advisories``, progressive modes only)."""
        self._advised_counts: tuple[int, ...] = ()
        """The schedule the advisories carry; ``_advised_to[r]``: the one rank r has (the same object, or None)."""
        self._advised_to: list[Optional[tuple[int, ...]]] = [None] * self.W
        self.barrier_paced = mode.barrier_paced
        self.streams = mode.streams
        """The policy lets a rank train past its count (the overshoot budget, tuned by the guard)."""
        self.partition_ratios = partition_ratios
        self.scalar_reductions = dict(settings.scalar_reductions)
        self.overshoot = OvershootTuner.pinned(int(max_overshoot)) if max_overshoot is not None else OvershootTuner()
        self._cohort = cohort
        self._cycle = cycle
        self._out = outbox
        self._clock = clock
        self.gate = Gate.CLOSED
        self.epoch_ceiling: Optional[int] = None
        """Set while an at_epoch bundle is pending: no chunk beyond this epoch, and it is not aggregated."""
        self._total = 0
        """Picks per epoch (samples x augment views), known once the ranks said hello."""
        self._last_aggregated = -1
        self.accs: dict[int, EpochAccumulator] = {}
        self.pools: dict[int, ChunkPool] = {}
        self.final_plans: dict[int, Optional[FinalWindowPlan]] = {}
        self._chunks = ChunkBook()
        """chunk id -> every chunk sent and not yet reported."""
        self.progress: list[dict[int, int]] = [{} for _ in range(world_size)]
        self.answered: list[dict[int, int]] = [{} for _ in range(world_size)]
        """Each rank's ``progress`` when its answer to the latest reduce came (its ack or snapshot): the batches
        of its in-flight chunks that reduce holds (later ones arrive after the answer on the same connection)."""
        """rank -> chunk id -> batches reported trained."""
        self.unreduced_chunks: list[list[tuple[int, list[tuple[int, int]]]]] = [[] for _ in range(world_size)]
        """rank -> (epoch, trained ranges) of each chunk it finished since its last reduce."""
        self._answered_chunks = [0] * world_size
        """rank -> how many of its unreduced_chunks it had finished when it answered the reduce in flight."""
        self._lost_picks = 0
        """Trained picks of dead ranks that no reduce holds and no survivor could retrain (epoch already aggregated)."""
        self._retrained_picks = 0
        """Trained picks of dead ranks that no reduce held, of an epoch already aggregated, handed to the survivors."""
        self.held: dict[int, list[tuple[int, int, int, int]]] = {}
        """Dead rank -> (epoch, offset, size, last picks) it trained and answered the reduce in flight with: in the
        consensus only if that reduce finishes with its share (see on_rank_dead)."""
        self._coverage: dict[int, list[list[int]]] = {}
        """Aggregated epoch -> the [offset, size] ranges its chunks covered."""
        self._rank_epoch = [0] * self.W
        self.extensions: list[list[int]] = [[] for _ in range(world_size)]
        """rank -> ExtendPartition chunk ids sent to it, in order (see _extension_in_training)."""
        self._steps = _Steps(cycle, world_size)
        self._ids = itertools.count()
        self.probe_extra = [0] * world_size
        """Batches a rank may train past its count while the cold-start probe is open (see :meth:`_counts`)."""

    @property
    def rank_epoch(self) -> list[int]:
        return self._rank_epoch

    @property
    def chunks(self) -> ChunkBook:
        return self._chunks

    def chunk_epoch(self, cid: int) -> Optional[int]:
        """The epoch of a chunk in flight (None once it is done or unknown)."""
        ch = self._chunks.get(cid)
        return ch.epoch if ch is not None else None

    @property
    def chunks_by_rank(self) -> Counter[int]:
        """Chunks in flight per rank (indexed: the gate's O(1) test reads it every batch)."""
        return self._chunks.by_rank

    def outcome(self) -> dict[str, Any]:
        """The dispatcher's part of the run's outcome: each epoch's coverage, the picks lost and retrained."""
        return {"coverage": {str(e): v for e, v in self._coverage.items()},
                "lost_picks": self._lost_picks, "retrained_picks": self._retrained_picks}

    @property
    def lost_picks(self) -> int:
        return self._lost_picks

    @property
    def retrained_picks(self) -> int:
        return self._retrained_picks

    @property
    def last_aggregated(self) -> int:
        return self._last_aggregated

    @property
    def total(self) -> int:
        return self._total

    @property
    def coverage(self) -> dict[int, list[list[int]]]:
        return self._coverage

    @property
    def epochs(self) -> int:
        """The run's epoch count (the shared :class:`EpochPlan`: lowered once by a stop)."""
        return self._plan.epochs

    def _open(self, e: int) -> EpochAccumulator:
        if e not in self.accs:
            self.accs[e] = EpochAccumulator(e, self.W, self._clock())
            self._cycle.set_max_total_batches(self._total // self.bs)
        return self.accs[e]

    def _send_chunk(self, r: int, e: int, offset: int, size: int) -> bool:
        cid = next(self._ids)
        self._chunks[cid] = Chunk(r, e, offset, size)
        self._rank_epoch[r] = e
        ok = self._out.send(r, StartEpoch(epoch=e, offset=offset, size=size, chunk=cid))
        if not ok:
            del self._chunks[cid]
        return ok

    def set_gate(self, gate: Gate) -> None:
        """The phase moved (ControlCore.enter): dispatch opens, holds the next epoch, or closes."""
        self.gate = gate

    def hold_after(self, epoch: Optional[int]) -> None:
        """No rank crosses past ``epoch`` until released (None): an at_epoch bundle is pending."""
        self.epoch_ceiling = epoch

    def current_epoch(self) -> int:
        return self._last_aggregated + 1

    def in_flight(self, r: int) -> bool:
        return self._chunks.by_rank[r] > 0

    # -- starting epochs ------------------------------------------------
    def start(self, total_picks: int, resume_meta: Optional[dict[str, Any]]) -> None:
        self._total = total_picks
        meta = resume_meta
        start = int(meta["epoch"]) if meta else 0
        recorded = ((meta.get("coverage") or {}).get("per_epoch") or []) if meta else []
        if recorded and self.progressive:
            # Coverage-granular resume: only the picks the bundle had not covered.
            lowest = min(int(p["epoch"]) for p in recorded)
            self._last_aggregated = lowest - 1
            for p in recorded:
                e = int(p["epoch"])
                self._open(e)
                self.pools[e] = ChunkPool.from_coverage(e, int(p["total_samples"]), self.bs, self.W,
                                                        [tuple(rg) for rg in p["uncovered_ranges"]])
            for r in self._cohort.alive_ranks():
                self._rank_epoch[r] = lowest
                self.dispatch_next(r)
            return
        self._last_aggregated = start - 1
        if start >= self.epochs:
            return
        if self.progressive:
            self._start_progressive(start)
        else:
            self._dispatch_plans(start)

    def on_rank_dead(self, r: int, unreduced_batches: int = 0, acked_batches: int = 0) -> None:
        """Give a dead rank's work back to the survivors (algorithms.md 5.1, 7.2): its untrained picks,
        and the picks it trained since its last reduce (the last ``unreduced_batches``: they never
        reached the consensus). What it trained before that stays covered.

        ``acked_batches``: the rank had answered the collective reduce in flight with that many batches before
        it died. Whether they are in the consensus is known only when that reduce finishes (the survivors may
        complete the collective it completed, or redo it in a regrouped generation without it): until then their
        picks are held, then released (:meth:`release_held`) or retrained (:meth:`retrain_held`)."""
        self._advised_to[r] = None  # a process that comes back as rank r has seen no schedule yet
        back = unreduced_batches * self.bs  # samples to take back, most recent first
        hold = acked_batches * self.bs  # the next ones back: held until the reduce finishes
        survivors = self._cohort.alive_ranks()
        held: list[tuple[int, int, int, int]] = []
        counts = [0, 0]  # retrained, lost
        for cid, ch in sorted(((c, ch) for c, ch in self._chunks.items() if ch.rank == r), key=lambda x: x[0], reverse=True):
            del self._chunks[cid]
            trained = self._trained(r, cid, ch.size)
            undo = min(back, trained)
            back -= undo
            keep = trained - undo
            h = min(hold, keep)
            hold -= h
            if h:
                held.append((ch.epoch, ch.offset, keep, h))
            if ch.epoch <= self._last_aggregated:
                # A retrain chunk (another dead rank's picks of an aggregated epoch, whose books already count
                # them): what it did not get into a reduce goes to the survivors again, as it came.
                if ch.size > keep:
                    self._give_back(r, ch.epoch, ch.offset, ch.size, ch.size - keep, survivors, counts)
                continue
            acc = self._open(ch.epoch)
            if keep:
                acc.ranges.append([ch.offset, keep])
                acc.ranks[r].batches += keep // self.bs
                acc.ranks[r].samples += keep
            if self.progressive and ch.epoch in self.pools:
                self.pools[ch.epoch].mark_completed(r, keep)  # the rest of the chunk is forfeited below
            elif ch.size > keep:
                self._hand_over(r, survivors, ch.epoch, ch.offset + keep, ch.size - keep)
        for epoch, ranges in reversed(self.unreduced_chunks[r]):
            for off, n in reversed(ranges):
                undo = min(back, n)
                back -= undo
                if undo > 0:
                    self._give_back(r, epoch, off, n, undo, survivors, counts)
                h = min(hold, n - undo)
                hold -= h
                if h:
                    held.append((epoch, off, n - undo, h))
        self.unreduced_chunks[r].clear()
        self.held[r] = held
        self._log_given_back(r, counts)
        if self.progressive:
            for pool in self.pools.values():
                pool.forfeit(r)
            self.after_finish()

    def _give_back(self, r: int, epoch: int, off: int, n: int, undo: int, survivors: list[int], counts: list[int]) -> None:
        """The last ``undo`` picks of r's reported range [off, off+n) are in no consensus: trained again."""
        if epoch <= self._last_aggregated:
            # Already aggregated (its metrics and coverage logged, counting these picks as trained): the
            # survivors retrain them as a chunk of that epoch, so the consensus holds each pick once and the
            # books stay true. Only with no survivor are they lost (counted, never hidden).
            unhanded = self._extend_over(survivors, epoch, off + n - undo, undo)
            counts[0] += undo - unhanded
            counts[1] += unhanded
            return
        self._uncover(r, epoch, off, n, undo)
        if self.progressive and epoch in self.pools:
            self.pools[epoch].reopen(r, off + n - undo, undo)
        else:
            self._hand_over(r, survivors, epoch, off + n - undo, undo)

    def _log_given_back(self, r: int, counts: list[int]) -> None:
        retrained, lost = counts
        if retrained:
            self._retrained_picks += retrained
            log.warning("rank %d died with %d trained picks of an aggregated epoch in no reduce: the survivors retrain them",
                        r, retrained)
        if lost:
            self._lost_picks += lost
            log.error("rank %d died with %d trained picks of an aggregated epoch in no reduce and no survivor: they are lost",
                      r, lost)

    def release_held(self, r: int, keep_batches: Optional[int] = None) -> int:
        """The reduce the dead rank had answered finished with its share: its held picks stay covered. With
        ``keep_batches`` (``mode.overlap``: it trained on past its answer, and its leader's partial said how much it
        answered with) only the oldest that many batches do; the rest, in no consensus, are trained again. Returns
        the picks handed back."""
        held = self.held.pop(r, [])
        excess = 0 if keep_batches is None else max(0, sum(h for *_, h in held) - keep_batches * self.bs)
        if not excess:
            return 0
        survivors = self._cohort.alive_ranks()
        counts = [0, 0]
        left = excess
        for epoch, off, n, h in held:  # most recent first
            undo = min(left, h)
            if undo:
                self._give_back(r, epoch, off, n, undo, survivors, counts)
                left -= undo
        self._log_given_back(r, counts)
        if self.progressive:
            self.after_finish()
        return excess

    def retrain_held(self, r: int) -> int:
        """The reduce the dead rank had answered finished without its share (the survivors redid the collective
        in a later generation): its held picks are trained again. Returns the picks handed back."""
        return self.release_held(r, keep_batches=0)

    def _uncover(self, r: int, epoch: int, off: int, n: int, undo: int) -> None:
        """Take the last ``undo`` picks of a reported range [off, off+n) off the epoch's books."""
        acc = self.accs[epoch]
        for rg in acc.ranges:
            if rg[0] == off and rg[1] == n:
                rg[1] -= undo
                break
        acc.ranges[:] = [rg for rg in acc.ranges if rg[1] > 0]
        acc.ranks[r].batches -= undo // self.bs
        acc.ranks[r].samples -= undo

    def _extend_over(self, survivors: list[int], e: int, offset: int, size: int) -> int:
        """ExtendPartition: split [offset, offset+size) in whole batches over the survivors, in rank order. A piece
        whose send fails (a rank dying, not declared dead yet: two deaths close together) goes to the next survivor
        instead, or it would be dropped unseen, neither trained nor counted. Returns the picks no survivor took."""
        live = list(survivors)
        rest_off = offset
        for i, nb in enumerate(equal_sizes(len(survivors), size // self.bs) if survivors else []):
            if nb <= 0:
                continue
            tries = sorted(live, key=lambda q: q != survivors[i])  # its own survivor first, then the others
            for r in tries:  # bounded: each live survivor tried once per piece
                if self._extend(r, e, rest_off, nb * self.bs):
                    break
                live.remove(r)
            else:
                return offset + size - rest_off
            rest_off += nb * self.bs
        return offset + (size // self.bs) * self.bs - rest_off

    def _hand_over(self, r: int, takers: list[int], e: int, offset: int, size: int) -> None:
        """Rank ``r``'s untrained (or again untrained) picks [offset, offset+size) of an open epoch to ``takers``
        (:meth:`_extend_over`); what none of them could be sent (every one dying too) is said, never hidden."""
        if unhanded := self._extend_over(takers, e, offset, size):
            log.error("%d picks of epoch %d from rank %d could be sent to no other rank", unhanded, e, r)

    def _extend(self, r: int, e: int, offset: int, size: int) -> bool:
        cid = next(self._ids)
        self._chunks[cid] = Chunk(r, e, offset, size)
        if not self._out.send(r, ExtendPartition(epoch=e, offset=offset, size=size, chunk=cid)):
            del self._chunks[cid]
            return False
        self.extensions[r] = [x for x in self.extensions[r] if x in self._chunks] + [cid]
        return True

    def _dispatch_plans(self, e: int) -> None:
        self._open(e)
        alive = self._cohort.alive_ranks()
        n_batches = self._total // self.bs
        ratios = self.partition_ratios
        if ratios:
            sizes = ratio_to_sizes(ratios, n_batches)
        elif self.mode.window_grows and self._cycle.speed_known():
            sizes = throughput_sizes(self._cycle.ms_per_batch(), n_batches)
        else:
            sizes = equal_sizes(self.W, n_batches)
        # Dead ranks get nothing; their share is split over the living in rank order.
        dead = [r for r in range(self.W) if r not in alive]
        for r in dead:
            extra, sizes[r] = sizes[r], 0
            for i, s in enumerate(equal_sizes(len(alive), extra)):
                sizes[alive[i]] += s
        plans = [(r, off, size) for r, (off, size) in enumerate(batch_aligned_plans(sizes, self.bs)) if r in alive]
        undelivered = [(r, off, size) for r, off, size in plans if not self._send_chunk(r, e, off, size) and size]
        # A plan that could not go: its rank is dying (its connection closed, the death not declared yet). Its share
        # goes to the others now, as a dead rank's would, or nobody would train it: the dead rank has no chunk of
        # this epoch on the books to hand back (fault suite, nccl_sync+overlap kill2: an epoch one share short).
        takers = [q for q in alive if q not in {r for r, _, _ in undelivered}]
        for r, off, size in undelivered:
            log.warning("rank %d could not be sent its epoch %d share (%d picks): the other ranks train it", r, e, size)
            self._hand_over(r, takers, e, off, size)

    def _start_progressive(self, e: int) -> None:
        self._open(e)
        counts = self._cycle.counts if self._cycle.speed_known() else [1] * self.W
        self.pools[e] = ChunkPool(e, self._total, self.bs, counts, now_ms=self._clock() * 1e3)
        for r in self._cohort.alive_ranks():
            if not self.in_flight(r):
                self._rank_epoch[r] = e
                self.dispatch_next(r)
        self.send_advisories()

    def send_advisories(self) -> None:
        """algorithms.md 5.10, at epoch start and at each reduce: each live rank's likely next picks, from the
        open epoch's pool, then from the next epoch's layout predicted with today's counts."""
        if not self.advise:
            return
        open_pools = sorted(e for e, pool in self.pools.items() if e > self._last_aggregated and pool.remaining() > 0)
        if not open_pools:
            return
        e = open_pools[0]
        counts = self._cycle.counts
        alive = self._cohort.alive_mask
        layouts = [(e, self.pools[e])]
        if e + 1 < self.epochs:
            layouts.append((e + 1, self.pools.get(e + 1) or ChunkPool(e + 1, self._total, self.bs, counts)))
        donors = [advisory_donors(pool, alive) for _, pool in layouts]
        # The schedule rides along when it changed since the rank's last advisory (empty: unchanged, latest
        # wins): W counts to each of W ranks every reduce was O(W^2) bytes to encode and send, for a value
        # that settles after the first windows.
        if tuple(counts) != self._advised_counts:
            self._advised_counts = tuple(counts)
        for r in self._cohort.alive_ranks():
            segs = [[ep, off, size] for (ep, pool), d in zip(layouts, donors)
                    for off, size in stage_advisory(pool, r, counts, alive, d)]
            if segs:
                fresh = self._advised_to[r] is not self._advised_counts
                self._advised_to[r] = self._advised_counts
                self._out.send(r, StageAdvisory(segments=segs, counts=counts if fresh else []))

    # -- progressive chunks ---------------------------------------------
    def _final_alloc(self, e: int) -> Optional[tuple[int, ...]]:
        if not self.barrier_paced:  # final-window plans pin barrier-paced epochs only (no O(W) list per chunk)
            return None
        pool = self.pools[e]
        plan = refresh_final_window_plan(
            self.final_plans.get(e), epoch=e, rem=pool.remaining() // self.bs, counts=self._cycle.counts_view,
            alive=self._cohort.alive_mask, barrier_paced=self.barrier_paced)
        self.final_plans[e] = plan
        return plan.alloc if plan is not None else None

    def _counts(self) -> Sequence[int]:
        """The counts chunks are sized by: ElChe's, plus :attr:`probe_extra` while the cold-start probe is open."""
        if not any(self.probe_extra):
            return self._cycle.counts_view
        if not self._cycle.probing:
            self.probe_extra = [0] * self.W
            return self._cycle.counts_view
        return [c + x for c, x in zip(self._cycle.counts_view, self.probe_extra)]

    def _extend_while_probing(self, r: int) -> bool:
        """Issue 30 (cold start): a rank that reached its count before the probe re-sized the first window (the
        slowest rank has not timed its probe steps yet) trains on instead of idling: one more window's worth, up
        to :data:`PROBE_EXTRA_WINDOWS` of them. The probe's seed then sets the counts (the fast rank's is larger
        than what it trained, by the speed ratio the probe waited for); the gate still waits for every rank's
        count, so the slow ranks' share is not cut. Nothing changes once ElChe is calibrated or has a speed hint."""
        if not self._cycle.probing or not self._cycle.has_elche or self._cycle.speed_known():
            return False
        c = self._cycle.counts_view[r]
        if c <= 0 or self.probe_extra[r] >= PROBE_EXTRA_WINDOWS * c:
            return False
        self.probe_extra[r] += c
        return True

    def _chunk_from(self, r: int, e: int) -> bool:
        pool = self.pools[e]
        assert self._cycle.has_elche, "progressive dispatch needs ElChe (2+ ranks)"
        nb = compute_chunk_batches(
            rank=r, rem_batches=pool.remaining() // self.bs, counts=self._counts(),
            steps=self._steps, policy=self.mode.policy,
            max_overshoot=self.overshoot.value, calibrated=self._cycle.calibrated(),
            has_speed_hint=self._cycle.has_speed_hint(),
            total_samples=self._total, world_size=self.W, batch_size=self.bs, final_alloc=self._final_alloc(e))
        if nb <= 0:
            return False
        rng = pool.take_chunk(nb * self.bs, r)
        if rng is None:
            return False
        if not self._send_chunk(r, e, rng[0], rng[1]):
            pool.rollback_take(r, rng[0], rng[1])
            return False
        return True

    def dispatch_next(self, r: int) -> None:
        """algorithms.md 5.4: hand rank r its next chunk unless a barrier holds it."""
        if not self._cohort.alive(r) or self.gate is Gate.CLOSED:
            return
        if self.barrier_paced and self.in_flight(r):
            return
        b = reduce_budget(r, self._counts(), self.mode.policy, self.overshoot.value)
        if b > 0 and self._cycle.window_steps(r) >= b and not self._extend_while_probing(r):
            return
        e = self._rank_epoch[r]
        first_live = self._last_aggregated + 1
        # A dead rank's forfeit reopens the pool of an epoch this rank may have left (async streams ahead):
        # the oldest open work first, or that epoch never completes.
        for q in sorted(self.pools):
            if first_live <= q < e and self.pools[q].remaining() > 0 and self._chunk_from(r, q):
                return
        pool = self.pools.get(e)
        if pool is not None and pool.remaining() > 0:
            self._chunk_from(r, e)
            return
        nxt = max(e + 1, first_live)
        if self.epoch_ceiling is not None and nxt > self.epoch_ceiling:
            return
        if nxt >= self.epochs or (self.barrier_paced and e >= first_live) or self.gate is Gate.HOLD_EPOCH:
            return
        if self.streams and self.overshoot.value == 0:
            return
        if nxt not in self.pools:
            self._open(nxt)
            self.pools[nxt] = ChunkPool(nxt, self._total, self.bs, self._cycle.counts, now_ms=self._clock() * 1e3)
        self._rank_epoch[r] = nxt
        self._chunk_from(r, nxt)

    def quiesced(self, r: int) -> bool:
        if self.in_flight(r):
            return False
        e = self._rank_epoch[r]
        pool = self.pools.get(e)
        if pool is None:
            return False
        if pool.remaining() == 0:
            return True
        plan = self.final_plans.get(e)
        return plan is not None and plan.alloc[r] == 0

    # -- reports ----------------------------------------------------------
    def on_batch(self, r: int, chunk: int) -> None:
        if self.extensions[r]:  # the per-batch path looks at the chunk only while the rank has an extension out
            ch = self._chunks.get(chunk)
            if ch is not None and self.progress[r].get(chunk, 0) * self.bs >= ch.size:
                chunk = self._extension_in_training(r, ch.epoch, chunk)
        self.progress[r][chunk] = self.progress[r].get(chunk, 0) + 1

    def _extension_in_training(self, r: int, epoch: int, chunk: int) -> int:
        """A rank appends an ExtendPartition to its running chunk of the same epoch and reports the batches under
        that chunk's id: past the chunk's own size they are the extension's, in the order sent. Booked there, a
        death hands back exactly what the extension did not get into a reduce (booked on the full chunk they
        were clamped away, and an extension already reduced went back to the survivors whole: trained twice)."""
        for ext in self.extensions[r]:
            ec = self._chunks.get(ext)
            if ec is not None and ec.epoch == epoch and self.progress[r].get(ext, 0) * self.bs < ec.size:
                return ext
        return chunk

    def answer_snapshot(self, r: int) -> AnswerSnapshot:
        """What rank r has trained by now (its chunks' progress, its finished chunks): kept with an answer to a later
        lockstep reduce, for :meth:`on_answer` when that reduce opens."""
        return dict(self.progress[r]), len(self.unreduced_chunks[r])

    def on_answer(self, r: int, snapshot: Optional[AnswerSnapshot] = None) -> None:
        """Rank r answered a reduce: what its in-flight chunks trained so far (or by ``snapshot``, when the answer
        came before its reduce opened) is in that reduce."""
        progress, finished = snapshot if snapshot is not None else self.answer_snapshot(r)
        self.answered[r] = progress
        self._answered_chunks[r] = finished

    def on_reduce_finished(self, members: Iterable[int], *, keep_after_answer: bool = False,
                           past: Optional[Mapping[int, int]] = None) -> None:
        """What the members trained up to their answer is in the consensus: the chunks they finished by then are
        safe. ``keep_after_answer`` (nccl): a rank trains on after its ack while its peers finish the collective,
        so a chunk it finished after its ack holds batches in no consensus yet (the ledger counts them toward the
        next window): it stays on the books, or a death then could not hand those picks back. ``past`` (overlapped
        reduces): each member's batches past its answer; the chunks that hold its latest that many stay on the books
        too, whenever they finished (an nccl rank acks once its all-reduce landed, well after the replica it sent:
        a chunk finished in between holds batches of the next window)."""
        for r in members:
            chunks = self.unreduced_chunks[r]
            keep = 0 if not keep_after_answer else len(chunks) - min(len(chunks), self._answered_chunks[r])
            if past is not None:
                keep = max(keep, self._chunks_holding_latest(r, past.get(r, 0)))
            del chunks[:len(chunks) - keep]
            self._answered_chunks[r] = 0

    def _trained(self, r: int, cid: int, size: int) -> int:
        """Samples rank ``r`` reported trained of its running chunk ``cid`` (of ``size``)."""
        return min(self.progress[r].get(cid, 0) * self.bs, size)

    def _chunks_holding_latest(self, r: int, batches: int) -> int:
        """How many of ``r``'s finished unreduced chunks (the latest ones) hold its last ``batches`` trained batches,
        after those its running chunks trained."""
        need = batches * self.bs - sum(self._trained(r, cid, ch.size) for cid, ch in self._chunks.items() if ch.rank == r)
        keep = 0
        for _, ranges in reversed(self.unreduced_chunks[r]):
            if need <= 0:
                break
            need -= sum(n for _, n in ranges)
            keep += 1
        return keep

    def on_metrics(self, r: int, m: ChunkMetrics) -> None:
        chunk = self._chunks.pop(m.chunk, None)
        if m.ranges:
            self.unreduced_chunks[r].append((m.epoch, [(int(o), int(n)) for o, n in m.ranges]))
        for extra in m.extra_chunks:
            self._chunks.pop(int(extra), None)
        if m.epoch <= self._last_aggregated:
            # A dead rank's picks retrained after their epoch aggregated (on_rank_dead): that epoch's metrics
            # and coverage already count them; the chunk only has to reach the next reduce.
            if self.progressive and chunk is not None:
                self.dispatch_next(r)
            return
        self._open(m.epoch).add_chunk(r, m)
        if self.progressive and chunk is not None and m.epoch in self.pools:
            self.pools[m.epoch].mark_completed(r, chunk.size)
            self.dispatch_next(r)

    def closing_epoch(self, rank: Optional[int] = None) -> Optional[int]:
        """The oldest epoch not yet aggregated whose last window is running or done, so the next window overlaps
        what follows its aggregation (the eval after it, the epoch hook before the next one).

        Progressive: every chunk of it was handed out. Non-progressive (every chunk goes out when the epoch is
        dispatched, and the window running when a rank ends its share carries on into the next epoch, with no
        reduce at the boundary): ``rank`` (the callback rank) has no more of it left than its current window
        count, so the next window crosses the boundary."""
        if self.progressive:
            return min((e for e, pool in self.pools.items() if e > self._last_aggregated and pool.remaining() == 0),
                       default=None)
        e = self._open_epoch()
        if e is None or rank is None:
            return None
        return e if self.batches_left(rank, e) <= max(1, self._cycle.counts_view[rank]) else None

    def batches_left(self, r: int, e: int) -> int:
        """Batches of epoch ``e`` handed to rank ``r`` and not reported trained yet (its chunks, extensions too)."""
        if not self._chunks.by_rank[r]:
            return 0
        return sum(max(0, ch.size // self.bs - self.progress[r].get(cid, 0))
                   for cid, ch in self._chunks.items() if ch.rank == r and ch.epoch == e)

    def _open_epoch(self) -> Optional[int]:
        return min((e for e in self.accs if e > self._last_aggregated), default=None)

    def on_telemetry(self, r: int, t: Telemetry) -> Optional[int]:
        """Attribute a report by arrival time to the epoch in progress; returns that epoch, or None
        when none is open (after the last aggregation: the caller logs it at the last epoch)."""
        e = self._open_epoch()
        if e is not None:
            self.accs[e].add_telemetry(r, t.values())
        return e

    def on_sync(self, ms: float, d_max: Optional[float], code: int, outer: Optional[OuterStep] = None) -> None:
        e = self._open_epoch()
        if e is not None:
            self.accs[e].add_sync(ms, d_max, code, outer)

    def on_verdict(self, action: ConvergenceAction) -> None:
        if self.streams:
            self.overshoot.on_verdict(action)

    def on_overlapped_trigger(self) -> None:
        """``mode.overlap``: a reduce started and its members train on: each idle one gets its next window's chunk
        now (sized from its steps past the reduce, none yet), not when the reduce finishes."""
        if self.progressive:
            for r in self._cohort.alive_ranks():
                if not self.in_flight(r):
                    self.dispatch_next(r)

    def after_finish(self) -> None:
        if self.progressive:
            for r in self._cohort.alive_ranks():
                if not self.in_flight(r):
                    self.dispatch_next(r)
            self.send_advisories()

    def _ready(self, e: int) -> bool:
        if e not in self.accs or self._chunks.by_epoch[e] > 0:
            return False
        if self.progressive:
            pool = self.pools.get(e)
            return pool is not None and pool.is_epoch_done()
        reported = self.accs[e].reported
        if len(reported) < self._cohort.alive_count():  # O(1): some live rank has not reported yet
            return False
        return all(r in reported for r in self._cohort.alive_ranks())

    def pop_aggregated(self) -> Optional[AggregatedEpoch]:
        """The next epoch in order once every pick of it is reported; None when it is not ready."""
        e = self._last_aggregated + 1
        if e >= self.epochs or not self._ready(e) or (self.epoch_ceiling is not None and e >= self.epoch_ceiling):
            return None
        acc = self.accs[e]
        metrics = acc.summary(self._clock() - acc.started, self.scalar_reductions)
        self._last_aggregated = e
        self._coverage[e] = acc.ranges
        self.pools.pop(e - 1, None)
        return AggregatedEpoch(e, metrics, acc.ranges)

    def advance(self) -> None:
        """After an aggregation: start the next epoch (or keep streaming into it)."""
        e = self._last_aggregated
        if e + 1 >= self.epochs or self.gate is not Gate.OPEN:
            return
        if self.epoch_ceiling is not None and e + 1 > self.epoch_ceiling:
            return
        if not self.progressive:
            if e + 1 not in self.accs:
                self._dispatch_plans(e + 1)
        elif e + 1 not in self.pools:
            self._start_progressive(e + 1)
        else:
            self.after_finish()

    def open_coverage(self) -> list[dict[str, Any]]:
        """Coverage of every open epoch at a reduce finish: what a mid-epoch bundle resumes. An in-flight chunk
        counts as uncovered but for the prefix its rank had trained when it answered that reduce (it is in the
        consensus the bundle saves: resuming would train it twice)."""
        out = []
        for e, pool in sorted(self.pools.items()):
            if e <= self._last_aggregated:
                continue
            trained = [(ch.offset, min(self.answered[ch.rank].get(cid, 0) * self.bs, ch.size))
                       for cid, ch in self._chunks.items() if ch.epoch == e]
            uncovered = subtract_ranges(pool.uncovered_ranges(), [t for t in trained if t[1] > 0])
            out.append({"epoch": e, "total_samples": pool.total_samples, "uncovered_ranges": [list(rg) for rg in uncovered]})
        return out

    def all_aggregated(self) -> bool:
        return self._last_aggregated >= self.epochs - 1

    def any_in_flight(self) -> bool:
        """Some chunk is out and not reported (after the last aggregation: a dead rank's picks being retrained)."""
        return len(self._chunks) > 0
