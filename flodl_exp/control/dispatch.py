"""Epoch dispatch and in-order aggregation (algorithms.md 4.4, 5, 3.13).

* Non-progressive: one plan per rank per epoch, consecutive batch-aligned
  slices sized by ``partition_ratios``, equal split (sync), or measured
  throughput (cadence/async once ElChe is calibrated).
* Progressive: a :class:`ChunkPool` per epoch hands each rank chunks sized to
  its reduce window; barrier-paced policies never let a rank cross a reduce or
  an epoch barrier, async may stream ahead within its overshoot budget.

Epochs aggregate strictly in order; each aggregated epoch is handed to the
coordinator (metrics, eval) and the next one is dispatched.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Optional

from ..partition import batch_aligned_plans, equal_sizes, ratio_to_sizes, throughput_sizes
from ..wire import Message
from .actions import ConvergenceAction
from .chunk_pool import ChunkPool, FinalWindowPlan, OvershootTuner, compute_chunk_batches, reduce_budget, refresh_final_window_plan
from .epoch_metrics import EpochAccumulator

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("flodl_exp.coordinator")


class Dispatcher:
    def __init__(self, co: "Coordinator") -> None:
        self.co = co
        self.W = co.W
        self.bs = co.batch_size
        self.epochs = co.epochs
        self.progressive = co.progressive
        self.barrier_paced = co.policy in ("sync", "cadence")
        self.is_async = co.policy == "async"
        mo = co.cfg["mode"]["max_overshoot"]
        self.overshoot = OvershootTuner.pinned(int(mo)) if mo is not None else OvershootTuner()
        self.last_aggregated = -1
        self.accs: dict[int, EpochAccumulator] = {}
        self.pools: dict[int, ChunkPool] = {}
        self.final_plans: dict[int, Optional[FinalWindowPlan]] = {}
        self.chunks: dict[int, tuple[int, int, int, int]] = {}
        """chunk id -> (rank, epoch, offset, size) for every chunk sent and not yet reported."""
        self.rank_epoch = [0] * self.W
        self._ids = itertools.count()

    @property
    def total(self) -> int:
        return self.co.total_picks

    def _open(self, e: int) -> EpochAccumulator:
        if e not in self.accs:
            self.accs[e] = EpochAccumulator(e, self.W, time.monotonic())
            if self.co.elche is not None:
                self.co.elche.set_max_total_batches(self.total // self.bs)
        return self.accs[e]

    def _send_chunk(self, r: int, e: int, offset: int, size: int) -> bool:
        cid = next(self._ids)
        self.chunks[cid] = (r, e, offset, size)
        self.rank_epoch[r] = e
        ok = self.co.send(r, Message("start_epoch", {"epoch": e, "offset": offset, "size": size, "chunk": cid}))
        if not ok:
            del self.chunks[cid]
        return ok

    def in_flight(self, r: int) -> bool:
        return any(c[0] == r for c in self.chunks.values())

    # -- starting epochs ------------------------------------------------
    def start(self) -> None:
        resume = self.co.resume
        meta = resume["meta"] if resume else None
        start = int(meta["epoch"]) if meta else 0
        recorded = ((meta.get("coverage") or {}).get("per_epoch") or []) if meta else []
        if recorded and self.progressive:
            # Coverage-granular resume: only the picks the bundle had not covered.
            lowest = min(int(p["epoch"]) for p in recorded)
            self.last_aggregated = lowest - 1
            for p in recorded:
                e = int(p["epoch"])
                self._open(e)
                self.pools[e] = ChunkPool.from_coverage(e, int(p["total_samples"]), self.bs, self.W,
                                                        [tuple(rg) for rg in p["uncovered_ranges"]])
            for r in self.co.alive_ranks():
                self.rank_epoch[r] = lowest
                self.dispatch_next(r)
            return
        self.last_aggregated = start - 1
        if start >= self.epochs:
            return
        if self.progressive:
            self._start_progressive(start)
        else:
            self._dispatch_plans(start)

    def resume_after_checkpoint(self) -> None:
        """The epoch-boundary bundle is written: dispatch the held next epoch."""
        e = self.last_aggregated + 1
        if e >= self.epochs:
            return
        if not self.progressive:
            self._dispatch_plans(e)
        elif e not in self.pools:
            self._start_progressive(e)
        else:
            self.after_finish()

    def on_rank_dead(self, r: int) -> None:
        """Give the dead rank's unprocessed picks to the survivors; what it trained stays covered."""
        progress = self.co.chunk_progress[r]
        survivors = self.co.alive_ranks()
        for cid, (rr, e, off, size) in sorted(self.chunks.items()):
            if rr != r:
                continue
            del self.chunks[cid]
            done = min(progress.get(cid, 0) * self.bs, size)
            acc = self._open(e)
            if done:
                acc.ranges.append([off, done])
                acc.ranks[r].batches += done // self.bs
                acc.ranks[r].samples += done
            if self.progressive and e in self.pools:
                self.pools[e].mark_completed(r, done)
            elif size - done > 0 and survivors:
                # ExtendPartition: split the remainder in whole batches over the survivors, in rank order.
                rest_off, rest_batches = off + done, (size - done) // self.bs
                for i, nb in enumerate(equal_sizes(len(survivors), rest_batches)):
                    if nb > 0:
                        self._extend(survivors[i], e, rest_off, nb * self.bs)
                        rest_off += nb * self.bs
        if self.progressive:
            for pool in self.pools.values():
                pool.forfeit(r)
            self.after_finish()

    def _extend(self, r: int, e: int, offset: int, size: int) -> None:
        cid = next(self._ids)
        self.chunks[cid] = (r, e, offset, size)
        if not self.co.send(r, Message("extend_partition", {"epoch": e, "offset": offset, "size": size, "chunk": cid})):
            del self.chunks[cid]

    def _dispatch_plans(self, e: int) -> None:
        self._open(e)
        alive = self.co.alive_ranks()
        n_batches = self.total // self.bs
        ratios = self.co.cfg["mode"].get("partition_ratios")
        elche = self.co.elche
        if ratios:
            sizes = ratio_to_sizes(ratios, n_batches)
        elif self.co.policy != "sync" and elche is not None and (elche.is_calibrated or elche.has_speed_hint()):
            sizes = throughput_sizes([max(elche.smoothed_ms(r), 1e-3) if elche.is_calibrated else 1.0 / c
                                      for r, c in enumerate(elche.batch_counts)], n_batches)
        else:
            sizes = equal_sizes(self.W, n_batches)
        # Dead ranks get nothing; their share is split over the living in rank order.
        dead = [r for r in range(self.W) if r not in alive]
        for r in dead:
            extra, sizes[r] = sizes[r], 0
            for i, s in enumerate(equal_sizes(len(alive), extra)):
                sizes[alive[i]] += s
        for r, (off, size) in enumerate(batch_aligned_plans(sizes, self.bs)):
            if r in alive:
                self._send_chunk(r, e, off, size)

    def _start_progressive(self, e: int) -> None:
        self._open(e)
        counts = self.co.counts if self.co.elche is not None and (self.co.elche.is_calibrated or self.co.elche.has_speed_hint()) else [1] * self.W
        self.pools[e] = ChunkPool(e, self.total, self.bs, counts, now_ms=time.monotonic() * 1e3)
        for r in self.co.alive_ranks():
            if not self.in_flight(r):
                self.rank_epoch[r] = e
                self.dispatch_next(r)

    # -- progressive chunks ---------------------------------------------
    def _final_alloc(self, e: int) -> Optional[list[int]]:
        pool = self.pools[e]
        plan = refresh_final_window_plan(
            self.final_plans.get(e), epoch=e, rem=pool.remaining() // self.bs, counts=self.co.counts,
            alive=list(self.co.alive), barrier_paced=self.barrier_paced)
        self.final_plans[e] = plan
        return plan.alloc if plan is not None else None

    def _chunk_from(self, r: int, e: int) -> bool:
        pool = self.pools[e]
        elche = self.co.elche
        nb = compute_chunk_batches(
            rank=r, rem_batches=pool.remaining() // self.bs, counts=self.co.counts,
            steps=[led.steps for led in self.co.ledger], barrier_paced=self.barrier_paced, is_async=self.is_async,
            max_overshoot=self.overshoot.value, calibrated=elche.is_calibrated, has_speed_hint=elche.has_speed_hint(),
            total_samples=self.total, world_size=self.W, batch_size=self.bs, final_alloc=self._final_alloc(e))
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
        if not self.co.alive[r] or self.co.phase not in ("training", "checkpointing"):
            return
        if self.barrier_paced and self.in_flight(r):
            return
        b = reduce_budget(r, self.co.counts, self.is_async, self.overshoot.value)
        if b > 0 and self.co.ledger[r].steps >= b:
            return
        e = self.rank_epoch[r]
        pool = self.pools.get(e)
        if pool is not None and pool.remaining() > 0:
            self._chunk_from(r, e)
            return
        first_live = self.last_aggregated + 1
        nxt = max(e + 1, first_live)
        if nxt >= self.epochs or (self.barrier_paced and e >= first_live) or self.co.phase == "checkpointing":
            return
        if self.is_async and self.overshoot.value == 0:
            return
        if nxt not in self.pools:
            self._open(nxt)
            self.pools[nxt] = ChunkPool(nxt, self.total, self.bs, self.co.counts, now_ms=time.monotonic() * 1e3)
        self.rank_epoch[r] = nxt
        self._chunk_from(r, nxt)

    def quiesced(self, r: int) -> bool:
        if self.in_flight(r):
            return False
        e = self.rank_epoch[r]
        pool = self.pools.get(e)
        if pool is None:
            return False
        if pool.remaining() == 0:
            return True
        plan = self.final_plans.get(e)
        return plan is not None and plan.alloc[r] == 0

    # -- reports ----------------------------------------------------------
    def on_metrics(self, r: int, f: dict) -> None:
        chunk = self.chunks.pop(int(f.get("chunk", -1)), None)
        for extra in f.get("extra_chunks") or []:
            self.chunks.pop(int(extra), None)
        e = int(f["epoch"])
        self._open(e).add_chunk(r, f)
        if self.progressive and chunk is not None and e in self.pools:
            self.pools[e].mark_completed(r, chunk[3])
            self.dispatch_next(r)

    def on_telemetry(self, r: int, f: dict) -> None:
        e = min((e for e in self.accs if e > self.last_aggregated), default=None)
        if e is not None:
            self.accs[e].add_telemetry(r, f)

    def on_sync(self, ms: float, d_max: Optional[float], code: int) -> None:
        e = min((e for e in self.accs if e > self.last_aggregated), default=None)
        if e is not None:
            self.accs[e].add_sync(ms, d_max, code)

    def on_verdict(self, action: ConvergenceAction) -> None:
        if self.is_async:
            self.overshoot.on_verdict(action)

    def after_finish(self) -> None:
        if self.progressive:
            for r in self.co.alive_ranks():
                if not self.in_flight(r):
                    self.dispatch_next(r)

    def _ready(self, e: int) -> bool:
        if e not in self.accs or any(c[1] == e for c in self.chunks.values()):
            return False
        if self.progressive:
            pool = self.pools.get(e)
            return pool is not None and pool.is_epoch_done()
        return all(r in self.accs[e].reported for r in self.co.alive_ranks())

    def aggregate_ready(self) -> None:
        while self.last_aggregated + 1 < self.epochs and self._ready(self.last_aggregated + 1):
            e = self.last_aggregated + 1
            acc = self.accs[e]
            metrics = acc.summary(time.monotonic() - acc.started, self.co.scalar_reductions)
            self.last_aggregated = e
            self.co.on_epoch_aggregated(e, metrics, acc.ranges)
            self.pools.pop(e - 1, None)
            if self.co.phase == "checkpointing":
                return  # the next epoch waits for the bundle (resume_after_checkpoint)
            if e + 1 < self.epochs:
                if not self.progressive:
                    self._dispatch_plans(e + 1)
                elif e + 1 not in self.pools:
                    self._start_progressive(e + 1)
                else:
                    self.after_finish()

    def all_aggregated(self) -> bool:
        return self.last_aggregated >= self.epochs - 1
