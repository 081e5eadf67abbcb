"""The sample cache: raw samples retained across epochs in the device pool, RAM, then the disk stage.

``SampleCache.load(sample_ids)`` returns exactly the batch
``fetch_batch(dataset, sample_ids)`` would (same values, dtypes, order and
structure) but reads retained samples from the fastest tier holding them and
asks the data set only for the rest, which it then admits into the first tier
with room: device pool (CUDA, once installed) -> RAM (up to the RAM budget)
-> disk stage (up to disk_stage_gb). Only raw samples are kept; the delivery
transform runs later, per epoch and view.

One index (``loc``: tier and slot per sample id) under one lock; admissions
write their rows before publishing them, so reads of published slots need no
lock and several reader threads share the cache.

Host tiers are never pinned; the per-load staging buffer that gathers a
batch's host rows is (``pin=True``, CUDA ranks): it is the one host buffer
host-to-device copies go through. Copies follow ``layout.copy_is_async``:
non-blocking only from pinned host memory to CUDA, so rows a data set returns
on the GPU are copied into the RAM tier synchronously, never read early.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import numpy as np
import torch

from flodl_exp.experiment import fetch_batch
from flodl_exp.rank.data import budget as B
from flodl_exp.rank.data.layout import Layout, flatten, to_device, unflatten
from flodl_exp.rank.data.stores import DiskStage, SlabStore, device_pool

log = logging.getLogger("flodl_exp.data")

DEVICE, RAM, DISK = 1, 2, 3
_SHIFT = 48
_SLOT_MASK = (1 << _SHIFT) - 1


class SampleCache:
    """Tiered retention of raw samples; see the module docstring."""

    def __init__(self, dataset: Any, samples: int, *, ram_bytes: int, disk_bytes: int = 0,
                 disk_dir: Optional[str] = None, pin: bool = False, rank: int = 0) -> None:
        """``pin``: pin the staging buffer of each load (CUDA ranks); the RAM slabs are never pinned."""
        self.dataset = dataset
        self.samples = int(samples)
        self.ram_bytes = max(0, int(ram_bytes))
        self.disk_bytes = max(0, int(disk_bytes))
        self.disk_dir = disk_dir
        self.pin = pin
        self.rank = rank
        self.layout: Optional[Layout] = None
        self.disabled = self.ram_bytes <= 0 and self.disk_bytes <= 0
        self.loc = np.full(self.samples, -1, dtype=np.int64) if not self.disabled else np.empty(0, np.int64)
        self.tiers: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.stats = {"device": 0, "ram": 0, "disk": 0, "miss": 0}

    # -- tiers ----------------------------------------------------------
    def _learn(self, batch: Any, n: int) -> None:
        """First batch: fix the row layout and size the host tiers (or give up on retention)."""
        lay, why = Layout.of(batch, n)
        if lay is None or lay.sample_bytes <= 0:
            self._disable(why or "samples have no bytes")
            return
        self.layout = lay
        ram_rows = B.rows_for(self.ram_bytes, lay.sample_bytes, self.samples)
        if ram_rows:
            self.tiers[RAM] = SlabStore(lay, ram_rows, torch.device("cpu"))
        disk_rows = B.rows_for(self.disk_bytes, lay.sample_bytes, self.samples - ram_rows)
        if disk_rows:
            import tempfile

            try:
                self.tiers[DISK] = DiskStage(lay, disk_rows, self.disk_dir or tempfile.gettempdir())
            except OSError as e:
                log.warning("rank %d: disk stage unavailable (%s): overflow samples are re-read", self.rank, e)
        log.info("rank %d: sample cache: %.1f MiB RAM budget, %d B per sample: RAM %d, disk %d of %d samples",
                 self.rank, self.ram_bytes / B.MIB, lay.sample_bytes, ram_rows,
                 self.tiers[DISK].capacity if DISK in self.tiers else 0, self.samples)
        if not self.tiers:
            self._disable("the budget holds no whole sample")

    def _disable(self, why: str) -> None:
        if not self.disabled:
            log.info("rank %d: sample cache off: %s", self.rank, why)
        self.disabled = True
        for t in self.tiers.values():
            _close_store(t)
        self.tiers = {}

    def install_device_pool(self, budget_bytes: int, device: torch.device) -> int:
        """Add the CUDA tier (once, after calibration); returns its capacity in samples."""
        if self.disabled or self.layout is None or DEVICE in self.tiers:
            return 0
        pool = device_pool(self.layout, budget_bytes, self.samples, device)
        if pool is None:
            return 0
        with self.lock:
            self.tiers = {DEVICE: pool, **self.tiers}
        log.info("rank %d: device sample pool: %d samples (%.1f MiB budget)", self.rank, pool.capacity,
                 budget_bytes / B.MIB)
        return pool.capacity

    def pool_pending_bytes(self) -> int:
        """The device pool's capacity whose slabs are not allocated yet (0 without a pool)."""
        pool = self.tiers.get(DEVICE)
        return int(pool.pending_bytes) if pool is not None else 0

    def drop_device_pool(self) -> int:
        """Remove the device tier and free its memory; returns how many samples it held.

        Its samples become misses again (re-read from the data set, admitted to
        the host tiers with room). Admissions hold the lock, so none writes to
        the pool after this; the device is synchronised before the slabs go,
        so no queued copy still reads or writes them. A reader that loaded
        around the drop may still read the old store; the pipeline discards
        what it produces (it drops the pool only after it stopped taking
        prefetched batches).
        """
        with self.lock:
            pool = self.tiers.get(DEVICE)
            if pool is None:
                return 0
            self.tiers = {k: v for k, v in self.tiers.items() if k != DEVICE}
            held = (self.loc >= 0) & ((self.loc >> _SHIFT) == DEVICE)
            self.loc[held] = -1
        _close_store(pool)
        return int(held.sum())

    def rows(self) -> dict[str, int]:
        names = {DEVICE: "device", RAM: "ram", DISK: "disk"}
        return {names[k]: t.used for k, t in self.tiers.items()}

    def warm(self, sample_ids: np.ndarray) -> int:
        """Fetch and retain the samples of ``sample_ids`` not held yet, in the host tiers only (staging
        advisories: the rank is about to be handed them). Returns the rows retained; 0 with misses left means
        the host tiers are full (retention never evicts)."""
        if self.disabled:
            return 0
        ids = np.unique(np.asarray(sample_ids, dtype=np.int64))
        miss = ids[self.loc[ids] < 0]
        if not len(miss):
            return 0
        fetched = fetch_batch(self.dataset, miss)
        if self.layout is None:
            with self.lock:
                if self.layout is None and not self.disabled:
                    self._learn(fetched, len(miss))
        if self.disabled or not self.layout.matches(fetched, len(miss)):  # type: ignore[union-attr]
            return 0
        leaves, _ = flatten(fetched)
        before = int((self.loc[miss] >= 0).sum())
        self._admit(miss, leaves, tiers=(RAM, DISK))
        staged = int((self.loc[miss] >= 0).sum()) - before
        self.stats["staged"] = self.stats.get("staged", 0) + staged
        return staged

    def _admit(self, ids: np.ndarray, leaves: list[torch.Tensor], tiers: tuple[int, ...] = (DEVICE, RAM, DISK)) -> None:
        """Retain samples not yet held (``ids`` unique), first tier with room first."""
        with self.lock:
            todo = np.nonzero(self.loc[ids] < 0)[0]
            for code in tiers:
                store = self.tiers.get(code)
                if store is None or len(todo) == 0:
                    continue
                slots = store.reserve(len(todo))
                if len(slots) == 0:
                    continue
                take, todo = todo[: len(slots)], todo[len(slots):]
                idx = torch.from_numpy(take)
                store.write(slots, [lf.index_select(0, idx.to(lf.device)) for lf in leaves])
                self.loc[ids[take]] = (code << _SHIFT) | slots

    # -- the read path ------------------------------------------------------
    def load(self, sample_ids: np.ndarray, device: Optional[torch.device] = None) -> tuple[Any, bool]:
        """The batch for ``sample_ids`` and whether it already lies on ``device`` (device-pool hits)."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        n = len(ids)
        tiers = self.tiers  # replaced, never mutated, when the device pool comes or goes
        if self.disabled:
            return fetch_batch(self.dataset, ids), False
        loc = self.loc[ids]
        miss = loc < 0
        fetched_leaves: Optional[list[torch.Tensor]] = None
        inv: Optional[np.ndarray] = None
        if miss.any():
            miss_ids = ids[miss]
            uniq, inv_ = np.unique(miss_ids, return_inverse=True)
            dup = len(uniq) < len(miss_ids)
            fetch_ids = uniq if dup else miss_ids
            fetched = fetch_batch(self.dataset, fetch_ids)
            if self.layout is None:
                with self.lock:
                    if self.layout is None and not self.disabled:
                        self._learn(fetched, len(fetch_ids))
            if not self.disabled and not self.layout.matches(fetched, len(fetch_ids)):  # type: ignore[union-attr]
                with self.lock:
                    self._disable("sample rows change shape or type between batches")
            if self.disabled:
                return (fetched, False) if (miss.all() and not dup) else (fetch_batch(self.dataset, ids), False)
            fetched_leaves, _ = flatten(fetched)
            self._admit(fetch_ids, fetched_leaves)
            self.stats["miss"] += int(miss.sum())
            if miss.all() and not dup:
                return fetched, False
            inv = inv_ if dup else None
        lay = self.layout
        assert lay is not None
        tier = np.where(miss, 0, loc >> _SHIFT)
        slot = loc & _SLOT_MASK
        on_dev = DEVICE in tiers and bool((tier == DEVICE).any())
        host_pos = np.nonzero(tier != DEVICE)[0] if on_dev else np.arange(n)
        host = lay.empty(len(host_pos), torch.device("cpu"), pin=self.pin)
        rel = np.full(n, -1, dtype=np.int64)
        rel[host_pos] = np.arange(len(host_pos))
        for code, name in ((RAM, "ram"), (DISK, "disk")):
            m = np.nonzero(tier == code)[0]
            if len(m):
                tiers[code].read_into(host, rel[m], slot[m])
                self.stats[name] += len(m)
        if fetched_leaves is not None:
            m = np.nonzero(miss)[0]
            dst = torch.from_numpy(rel[m])
            for h, lf in zip(host, fetched_leaves):
                rows = lf if inv is None else lf.index_select(0, torch.from_numpy(inv).to(lf.device))
                h.index_copy_(0, dst, to_device(rows, "cpu"))  # blocking: a GPU row is copied before it is read
        if not on_dev:
            return unflatten(lay.spec, host), False
        assert device is not None
        out = lay.empty(n, device)
        m = np.nonzero(tier == DEVICE)[0]
        tiers[DEVICE].read_into(out, m, slot[m])
        self.stats["device"] += len(m)
        if len(host_pos):
            dst = torch.from_numpy(host_pos).to(device)
            for o, h in zip(out, host):
                o.index_copy_(0, dst, to_device(h, device))  # async only from the pinned staging buffer
        return unflatten(lay.spec, out), True

    def close(self) -> None:
        for t in self.tiers.values():
            _close_store(t)
        self.tiers = {}


def _close_store(store: Any) -> None:
    """Close a tier; a CUDA one only once the device has finished every queued copy from or into it."""
    dev = getattr(store, "device", None)
    cuda = isinstance(dev, torch.device) and dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    store.close()
    if cuda:
        torch.cuda.empty_cache()  # hand the slabs back to the device (other ranks may share it)
