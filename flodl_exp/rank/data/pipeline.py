"""The per-rank data pipeline: reader threads fill a bounded, ordered window of ready batches per chunk.

Why: the synchronous fetch puts the whole data cost on the training thread;
a rank whose data set is slow (disk, decode, network storage) reads as a slow
device to the balancer. Here ``open(epoch, picks)`` (begin_epoch) sizes the
window for the chunk from the budget laws (``budget.py``), and reader threads
load batches ahead of the trainer, in order, at most ``depth`` batches ahead
of what it consumed, through the sample cache (``cache.py``).
``Feed.extend`` (ExtendPartition) makes more batches claimable mid-chunk.
``Feed.next`` blocks until the next batch is ready, running the worker's
control drain every 10 ms while it waits (a peer's collective must never
wait on our data); the time spent in that control work is not data wall.

Depth 0 is the single-stage synchronous fetch: ram_max_usage=0 always, and
on CUDA the first chunk, which measures the activation peak after its first
step (the VRAM law needs it). An out-of-memory error in the device pool or
the prefetch window (``torch.OutOfMemoryError``, raised on a reader or in the
synchronous fetch) drops the pool and makes the rank fetch synchronously for
the rest of the run, with one warning (``DataPipeline.fall_back``).

Streams (CUDA): readers load and copy on one copy stream; a batch handed to
the trainer makes its stream wait on the reader's event (``deliver``). The
device pool is written on whichever stream admitted the sample, so a
depth-0 fetch makes the trainer's stream wait on the copy stream first, and a
chunk with readers makes the copy stream wait on the trainer's stream before
they start. Pool slabs are freed only after a device synchronise. The delivery transform
``dataset.transform(batch, sample_ids, views, epoch, seed)`` runs on the
trainer's thread as the batch is handed over, so caches only hold raw samples.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from flodl_exp.partition import decode_pick
from flodl_exp.rank.data import budget as B
from flodl_exp.rank.data.cache import SampleCache
from flodl_exp.rank.data.layout import flatten, to_device
from flodl_exp.rank.data.probe import READERS_ENV, VRAM_POOL_ENV, cuda_memory, forced_ram_budget, mem_available

log = logging.getLogger("flodl_exp.data")

DEFAULT_READERS = 4
POLL_S = 0.010

_OOM_TYPES: tuple[type[BaseException], ...] = tuple({torch.cuda.OutOfMemoryError,
                                                     getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)})


def is_oom(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (alias ``torch.cuda.OutOfMemoryError``): a device allocation failed."""
    return isinstance(exc, _OOM_TYPES)


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensor, tuple/list, dict, nested) on ``device``; non-blocking only where ``copy_is_async`` allows."""
    if isinstance(batch, torch.Tensor):
        return to_device(batch, device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


@dataclass
class Delivered:
    data: Any
    data_ms: float
    """Wall blocked waiting for (or synchronously fetching) the batch, control work excluded
    (the user's ``data_starve_ms``)."""
    ids: np.ndarray
    wait_ms: float = 0.0
    """The same wait with the control work done during it: the delivered cost ElChe schedules on
    (algorithms.md 9.1), so a rank that services parameter traffic while waiting is not seen as faster."""


@dataclass
class _Ready:
    data: Any
    samples: np.ndarray
    views: np.ndarray
    event: Any = None


class Feed:
    """One chunk's ordered stream of batches (created by ``DataPipeline.open``)."""

    def __init__(self, pipe: DataPipeline, epoch: int, picks: np.ndarray, depth: int) -> None:
        self.pipe = pipe
        self.epoch = int(epoch)
        self.picks = np.asarray(picks)
        self.depth = int(depth)
        self.consumed = 0
        self.claimed = 0
        self.ready: dict[int, Any] = {}
        self.closed = False

    @property
    def n_batches(self) -> int:
        return len(self.picks) // self.pipe.batch_size

    def claimable(self) -> bool:
        return (not self.closed and self.depth > 0 and self.claimed < self.n_batches
                and self.claimed < self.consumed + self.depth)

    def extend(self, picks: np.ndarray) -> None:
        """ExtendPartition: append picks; their batches become claimable at once."""
        with self.pipe.cond:
            self.picks = np.concatenate([self.picks, np.asarray(picks)])
            self.pipe.cond.notify_all()

    def next(self, on_wait: Optional[Callable[[], None]] = None,
             should_stop: Optional[Callable[[], bool]] = None) -> Optional[Delivered]:
        """The next batch of the chunk; None when it is done, or when ``should_stop()`` turned true while waiting."""
        pipe = self.pipe
        j = self.consumed
        bs = pipe.batch_size
        if j >= self.n_batches:
            return None
        if pipe.measuring and pipe.delivered > 0:
            pipe.calibrate()
        t0 = time.perf_counter()
        control = 0.0
        ids = self.picks[j * bs:(j + 1) * bs].copy()
        item: Any = None
        while item is None:
            if self.depth <= 0:
                try:
                    item = pipe.produce(ids, on_reader=False)
                except BaseException as e:
                    if not pipe.fall_back(self, e):
                        raise
                    continue  # the pool is gone: fetch this batch again, synchronously
                self.consumed = j + 1
                break
            while True:
                with pipe.cond:
                    item = self.ready.pop(j, None)
                    if item is None:
                        pipe.cond.wait(POLL_S)
                        item = self.ready.pop(j, None)
                    if item is not None:
                        self.consumed = j + 1
                        pipe.cond.notify_all()
                        break
                if on_wait is not None:
                    tc = time.perf_counter()
                    on_wait()
                    control += time.perf_counter() - tc
                if should_stop is not None and should_stop():
                    return None
            if isinstance(item, BaseException) and pipe.fall_back(self, item):
                self.consumed = j  # batch j is fetched again, synchronously (depth is now 0)
                item = None
        if isinstance(item, BaseException):
            raise item
        data = pipe.deliver(item, self.epoch)
        pipe._measure(item.data)
        pipe.delivered += 1
        wait = time.perf_counter() - t0
        return Delivered(data=data, data_ms=max(0.0, wait - control) * 1e3, ids=ids, wait_ms=wait * 1e3)

    def close(self) -> None:
        with self.pipe.cond:
            self.closed = True
            self.ready.clear()
            self.pipe.cond.notify_all()


class DataPipeline:
    """Budgets, the sample cache, reader threads and the current chunk's ``Feed``."""

    def __init__(self, dataset: Any, *, device: torch.device, batch_size: int, augment: int = 1, seed: int = 42,
                 vram_max_usage: float = 0.90, ram_max_usage: float = 0.50, sample_cache: bool = True,
                 disk_stage_gb: float = 0.0, disk_stage_dir: Optional[str] = None, vram_pool: bool = True,
                 ranks_per_node: int = 1, readers: Optional[int] = None, ram_budget_bytes: Optional[int] = None,
                 rank: int = 0, sync_reserve_bytes: int = 0, ranks_on_device: int = 1) -> None:
        """``sync_reserve_bytes``: VRAM a parameter sync allocates (``budget.sync_reserve_bytes``, or set later with
        ``reserve_for_sync(model)``); ``ranks_on_device``: ranks sharing this rank's GPU, which split its budget."""
        self.dataset = dataset
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.batch_size = int(batch_size)
        self.augment = max(1, int(augment))
        self.seed = int(seed)
        self.rank = rank
        self.vram_max_usage = B.clamp_vram_usage(vram_max_usage)
        self.ram_max_usage = B.clamp_ram_usage(ram_max_usage)
        forced = ram_budget_bytes if ram_budget_bytes is not None else forced_ram_budget()
        if self.ram_max_usage <= 0:
            share = 0
        elif forced is not None:
            share = int(forced)
        else:
            share = B.rank_ram_share(mem_available(), 0, self.ram_max_usage, ranks_per_node)
        self.share = share
        cache_bytes, self.ring_bytes = B.split_share(share, bool(sample_cache))
        disk_bytes = B.disk_stage_bytes(disk_stage_gb) if (sample_cache and share > 0) else 0
        self.cache = SampleCache(dataset, len(dataset), ram_bytes=cache_bytes, disk_bytes=disk_bytes,
                                 disk_dir=disk_stage_dir, pin=self.is_cuda, rank=rank)
        self.pool_wanted = self.is_cuda and B.vram_pool_enabled(bool(vram_pool), os.environ.get(VRAM_POOL_ENV))
        self.pool_installed = False
        self.sync_reserve_bytes = max(0, int(sync_reserve_bytes))
        self.ranks_on_device = max(1, int(ranks_on_device))
        self.fallen_back = False
        """An OOM in the pool or prefetch: the pool is dropped and every later fetch is synchronous."""
        self.window_depth = 0
        """Prefetch depth of the current chunk (the window the next activation-peak update measures)."""
        t = getattr(dataset, "transform", None)
        self.transform: Optional[Callable[..., Any]] = t if callable(t) else None
        if readers is None:
            env = os.environ.get(READERS_ENV)
            readers = int(env) if env else (1 if getattr(dataset, "thread_safe", True) is False else DEFAULT_READERS)
        self.n_readers = max(1, int(readers))
        self.cond = threading.Condition()
        self.feed: Optional[Feed] = None
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.delivered = 0
        self.activation_peak = 0
        self.measuring = False
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._staging = np.empty(0, dtype=np.int64)
        self._staging_at = 0
        self._stager: Optional[threading.Thread] = None
        self._sync_logged = False
        self._seen_batch_bytes = 0
        self.last_depth = 0
        log.info("rank %d: data plane: RAM share %.1f MiB (cache %.1f, ring %.1f), disk stage %.2f GiB, "
                 "readers %d, device pool %s, transform %s", rank, share / B.MIB, cache_bytes / B.MIB,
                 self.ring_bytes / B.MIB, disk_bytes / B.GIB, self.n_readers,
                 "on" if self.pool_wanted else "off", "yes" if self.transform else "no")

    # -- budgets -------------------------------------------------------------
    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch: from the cache's row layout, else measured on the first batch (0 = unknown)."""
        lay = self.cache.layout
        return lay.sample_bytes * self.batch_size if lay is not None else self._seen_batch_bytes

    def _measure(self, data: Any) -> None:
        if not self._seen_batch_bytes:
            self._seen_batch_bytes = sum(t.nbytes for t in flatten(data)[0] if isinstance(t, torch.Tensor))

    def _update_peak(self) -> None:
        """Chunk boundary on CUDA: fold the last chunk's high-water mark into the activation peak.

        The mark is taken net of the window's own ready batches (``budget.update_activation_peak``),
        so prefetch slack is not mistaken for activations and the depth does not decay over a run.
        """
        if self.activation_peak > 0:
            torch.cuda.current_stream(self.device).synchronize()
            self.activation_peak = B.update_activation_peak(
                self.activation_peak, torch.cuda.max_memory_allocated(self.device),
                torch.cuda.memory_allocated(self.device), self.batch_bytes, self.window_depth, self.n_readers)
        torch.cuda.reset_peak_memory_stats(self.device)

    def calibrate(self) -> None:
        """After the first step on CUDA: record the activation peak (prefetch starts next chunk)."""
        torch.cuda.current_stream(self.device).synchronize()
        self.activation_peak = B.first_activation_peak(torch.cuda.max_memory_allocated(self.device),
                                                       torch.cuda.memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.measuring = False
        log.info("rank %d: activation peak %.1f MiB", self.rank, self.activation_peak / B.MIB)

    def reserve_for_sync(self, model: torch.nn.Module) -> int:
        """Reserve a parameter sync's working memory in the VRAM budget; returns the reserve in bytes.

        ``budget.sync_reserve_bytes`` of the parameter and float-buffer bytes, counted as float32
        (the flat all-reduce copies are float32 whatever the parameters' dtype).
        """
        ts = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
        param_bytes = sum(t.numel() * max(4, t.element_size()) for t in ts)
        self.sync_reserve_bytes = max(self.sync_reserve_bytes, B.sync_reserve_bytes(param_bytes))
        return self.sync_reserve_bytes

    def fall_back(self, feed: Feed, exc: BaseException) -> bool:
        """An OOM in the device pool or the prefetch window: drop the pool, fetch synchronously from now on.

        Called on the trainer's thread with the error a reader handed over or
        the synchronous fetch raised. The feed stops taking prefetched batches
        (depth 0; what readers still produce is discarded), the pool is
        dropped and its memory freed, later chunks get depth 0, and one
        warning is logged. Returns False, and the caller re-raises, for any
        other error and for an OOM after the fallback (the synchronous fetch
        itself does not fit: no data-plane setting can help).
        """
        if self.fallen_back or not is_oom(exc):
            return False
        exc.__traceback__ = None  # its frames may hold device tensors
        with self.cond:
            self.fallen_back = True
            self.pool_wanted = False
            feed.depth = 0
            feed.ready.clear()
            self.cond.notify_all()
        dropped = self.cache.drop_device_pool()
        if self.is_cuda:
            torch.cuda.empty_cache()
        log.warning("rank %d: out of device memory in the data plane (%s): device pool dropped (%d samples), "
                    "synchronous fetch for the rest of the run", self.rank, str(exc).splitlines()[0] if str(exc) else
                    type(exc).__name__, dropped)
        return True

    def depth_for(self, chunk_batches: int) -> int:
        """Ready-batch window for a chunk of ``chunk_batches`` (0 = synchronous)."""
        if self.share <= 0 or chunk_batches <= 0 or self.fallen_back:
            return 0
        if not self.is_cuda:
            return B.ring_slots(self.batch_bytes, self.ring_bytes, chunk_batches)
        if self.measuring and self.delivered > 0:
            self.calibrate()
        self._update_peak()
        if self.activation_peak == 0:
            self.measuring = True
            return 0
        total, live = cuda_memory(self.device)
        own = torch.cuda.memory_allocated(self.device)
        lay = self.cache.layout
        install = (self.pool_wanted and not self.pool_installed and lay is not None and not self.cache.disabled)
        d = B.prefetch_depth_from_vram(lay.sample_bytes if lay else 0, self.batch_size, is_cuda=True, total=total,
                                       used=live, max_usage=self.vram_max_usage, reserve=self.activation_peak,
                                       own=own, ranks_on_device=self.ranks_on_device,
                                       sync_reserve=self.sync_reserve_bytes,
                                       pool_pending=self.cache.pool_pending_bytes(), readers=self.n_readers)
        d = B.chunk_depth(d, chunk_batches, install)
        if install:
            budget = B.vram_pool_budget(total=total, used=live, max_usage=self.vram_max_usage,
                                        activation_peak=self.activation_peak,
                                        flow_reserve=B.flow_reserve_bytes(d, self.batch_bytes, self.n_readers), own=own,
                                        ranks_on_device=self.ranks_on_device, sync_reserve=self.sync_reserve_bytes)
            self.cache.install_device_pool(budget, self.device)
            self.pool_installed = True
        if d == 0 and not self._sync_logged:
            self._sync_logged = True
            log.info("rank %d: VRAM budget leaves no room for prefetch: synchronous fetch (data cost unoverlapped)",
                     self.rank)
        return d

    # -- feeds ---------------------------------------------------------------
    def open(self, epoch: int, picks: np.ndarray) -> Feed:
        """Start a chunk: close the previous feed, size the window, let the readers go."""
        if self.feed is not None:
            self.feed.close()
        depth = self.depth_for(len(picks) // self.batch_size)
        feed = Feed(self, epoch, picks, depth)
        self.window_depth = depth
        if depth > 0 and self.copy_stream is not None:
            # Readers read pool slots the trainer's stream may still be writing (admissions of a depth-0 chunk).
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        if depth != self.last_depth:
            log.debug("rank %d: prefetch depth %d (chunk %d batches)", self.rank, depth, feed.n_batches)
            self.last_depth = depth
        with self.cond:
            self.feed = feed
            if depth > 0:
                self._start_readers()
            self.cond.notify_all()
        return feed

    def _start_readers(self) -> None:
        while len(self.threads) < self.n_readers:
            th = threading.Thread(target=self._reader, name=f"data-reader-{len(self.threads)}", daemon=True)
            self.threads.append(th)
            th.start()

    def _reader(self) -> None:
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self.cond:
                while not self.stopping and not (self.feed is not None and self.feed.claimable()):
                    self.cond.wait()
                if self.stopping:
                    return
                feed = self.feed
                assert feed is not None
                j = feed.claimed
                feed.claimed += 1
                ids = feed.picks[j * self.batch_size:(j + 1) * self.batch_size].copy()
            try:
                item: Any = self.produce(ids, on_reader=True)
            except BaseException as e:  # handed to the trainer's thread, raised there
                item = e
            with self.cond:
                if not feed.closed and feed.depth > 0:  # depth 0: the trainer fell back and fetches itself
                    feed.ready[j] = item
                self.cond.notify_all()
            item = None  # a discarded batch (or an error's frames) must not stay alive while this reader idles

    def produce(self, ids: np.ndarray, *, on_reader: bool) -> _Ready:
        """Load one batch of picks (cache first) and put it on the device (async copy on a reader)."""
        samples, views = decode_pick(ids, self.augment)
        if not self.is_cuda:
            data, _ = self.cache.load(samples)
            return _Ready(data, samples, views)
        assert self.copy_stream is not None
        if not on_reader:
            # Pool slots may have been written by readers on the copy stream: read them after those writes.
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            data, on_dev = self.cache.load(samples, self.device)
            return _Ready(data if on_dev else _to_device(data, self.device), samples, views)
        with torch.cuda.stream(self.copy_stream):
            data, on_dev = self.cache.load(samples, self.device)
            if not on_dev:
                data = _to_device(data, self.device)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return _Ready(data, samples, views, ev)

    def deliver(self, item: _Ready, epoch: int) -> Any:
        """Hand a ready batch to the trainer's stream and apply the transform (keyed by sample, view, epoch, seed)."""
        data = item.data
        if item.event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(item.event)
            for t in flatten(data)[0]:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(cur)  # the copy stream's blocks must outlive their use here
        if self.transform is not None:
            data = self.transform(data, item.samples, item.views, epoch, self.seed)
        return data

    # -- staging advisories (algorithms.md 5.10) --------------------------------------------
    STAGE_BATCHES = 4
    """Batches of samples the stager fetches per turn, between turns it yields to the readers."""

    def stage(self, picks: np.ndarray) -> None:
        """Picks this rank is about to be handed (the coordinator's advisory): retain their samples in the host
        cache while the readers are idle. The newest advisory replaces the one in progress. Purely a hint:
        nothing is fetched when retention is off or full."""
        if self.cache.disabled or len(picks) == 0 or getattr(self.dataset, "thread_safe", True) is False:
            return  # a data set that takes one reader at a time gets no second one
        samples, _ = decode_pick(np.asarray(picks, dtype=np.int64), self.augment)
        with self.cond:
            self._staging = np.asarray(samples, dtype=np.int64)
            self._staging_at = 0
            if self._stager is None and not self.stopping:
                self._stager = threading.Thread(target=self._stage_loop, name="data-stager", daemon=True)
                self._stager.start()
            self.cond.notify_all()

    def _stage_loop(self) -> None:
        n = self.batch_size * self.STAGE_BATCHES
        while True:
            with self.cond:
                # Staging waits while a feed has batches to claim: the readers' work is the chunk in hand.
                while not self.stopping and (self._staging_at >= len(self._staging)
                                             or (self.feed is not None and self.feed.claimable())):
                    self.cond.wait(timeout=1.0)
                if self.stopping:
                    return
                ids = self._staging[self._staging_at:self._staging_at + n]
                self._staging_at += len(ids)
            try:
                staged = self.cache.warm(ids)
            except Exception as e:  # a hint must never break training: stop staging, say so once
                log.warning("rank %d: staging stopped: %s: %s", self.rank, type(e).__name__, e)
                staged, ids = 0, ids[:0]
                with self.cond:
                    self._staging_at = len(self._staging)
            if staged == 0 and len(ids) and bool((self.cache.loc[ids] < 0).any()):
                with self.cond:  # the host tiers are full: nothing more fits until the next run
                    self._staging_at = len(self._staging)

    def close(self) -> None:
        """Stop the readers and the stager, drop the cache (the disk stage file goes with it)."""
        if self.feed is not None:
            self.feed.close()
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for th in self.threads + ([self._stager] if self._stager is not None else []):
            th.join(timeout=5.0)
        self.threads = []
        self.cache.close()


def build_pipeline(dp: Any, dataset: Any, *, device: torch.device, batch_size: int, augment: int, seed: int,
                   ranks_per_node: int = 1, rank: int = 0, sync_reserve_bytes: int = 0,
                   ranks_on_device: int = 1) -> DataPipeline:
    """A pipeline from a ``data_plane`` config node (dict or DictConfig).

    ``ranks_on_device``: ranks sharing this rank's GPU (``budget.ranks_sharing_device``); they split its VRAM
    budget. ``sync_reserve_bytes``: a parameter sync's working memory (``budget.sync_reserve_bytes``), also set
    by ``RankTrainer.attach_pipeline`` through ``reserve_for_sync(model)``.
    """
    get = dp.get if hasattr(dp, "get") else (lambda k, d=None: getattr(dp, k, d))
    return DataPipeline(
        dataset, device=device, batch_size=batch_size, augment=augment, seed=seed,
        vram_max_usage=float(get("vram_max_usage", 0.90)), ram_max_usage=float(get("ram_max_usage", 0.50)),
        sample_cache=bool(get("sample_cache", True)), disk_stage_gb=float(get("disk_stage_gb", 0.0) or 0.0),
        disk_stage_dir=get("disk_stage_dir", None), vram_pool=bool(get("vram_pool", True)),
        ranks_per_node=ranks_per_node, rank=rank, sync_reserve_bytes=sync_reserve_bytes,
        ranks_on_device=ranks_on_device,
    )
