"""Retention tiers for raw samples: host RAM slabs, device slabs, and the disk-stage pack file.

All three keep fixed-size rows (one per sample and leaf, see ``layout.py``)
at integer slots handed out first come, first served up to a capacity fixed
from the budget. There is no eviction: epochs visit samples in a fresh random
order, so any admitted set is as good as another and a static one never
churns. Slots are written once, before the index publishes them, so reads
need no lock.

The disk stage is one memory-mapped pack file per rank process, named
``flodl_stage-<host>-<pid>-<token>.pack``: it is removed on close and at
interpreter exit, and files left by dead processes (a crash, SIGKILL) are
swept when the next one starts in the same directory.
"""
from __future__ import annotations

import atexit
import glob
import logging
import mmap
import os
import re
import socket
import threading
import uuid
from typing import Optional

import numpy as np
import torch

from .budget import MIB, VRAM_POOL_SLAB
from .layout import Layout

log = logging.getLogger("flodl_exp.data")

RAM_SLAB = 16 * MIB
"""Host allocation granularity: the cache grows by slabs, so a small data set never reserves the whole budget."""
DISK_RSS_WINDOW = 16 * MIB
"""Pack-file pages we let stay mapped before dropping them (MADV_DONTNEED): bounds the stage's share of RSS."""
STAGE_PREFIX = "flodl_stage"


class SlabStore:
    """Rows in lazily allocated slabs on one device (host RAM, pinned host RAM, or a CUDA device)."""

    def __init__(self, layout: Layout, capacity: int, device: torch.device, *, pin: bool = False,
                 slab_bytes: int = RAM_SLAB) -> None:
        self.layout = layout
        self.capacity = int(capacity)
        self.device = device
        self.pin = pin
        self.slab_rows = max(1, int(slab_bytes) // max(1, layout.sample_bytes))
        self.used = 0
        self.slabs: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return len(self.slabs) * self.slab_rows * self.layout.sample_bytes

    def reserve(self, k: int) -> np.ndarray:
        """Up to ``k`` fresh slots (fewer when the capacity runs out)."""
        take = max(0, min(int(k), self.capacity - self.used))
        slots = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        return slots

    def _slab(self, i: int) -> list[torch.Tensor]:
        with self._lock:
            while len(self.slabs) <= i:
                rows = min(self.slab_rows, self.capacity - len(self.slabs) * self.slab_rows)
                self.slabs.append(self.layout.empty(max(rows, 1), self.device, pin=self.pin))
            return self.slabs[i]

    def write(self, slots: np.ndarray, leaves: list[torch.Tensor]) -> None:
        """Store rows ``leaves[l][j]`` at ``slots[j]``."""
        sid, row = np.divmod(slots, self.slab_rows)
        for s in np.unique(sid):
            m = np.nonzero(sid == s)[0]
            dst = self._slab(int(s))
            src_idx = torch.from_numpy(m)
            dst_idx = torch.from_numpy(row[m]).to(self.device)
            for d, lf in zip(dst, leaves):
                rows = lf.index_select(0, src_idx.to(lf.device)) if len(m) != lf.shape[0] else lf
                d.index_copy_(0, dst_idx, rows.to(self.device, non_blocking=True))

    def read_into(self, out: list[torch.Tensor], pos: np.ndarray, slots: np.ndarray) -> None:
        """``out[l][pos[j]] = row(slots[j])`` (``out`` on this store's device)."""
        sid, row = np.divmod(slots, self.slab_rows)
        for s in np.unique(sid):
            m = np.nonzero(sid == s)[0]
            src = self.slabs[int(s)]
            src_idx = torch.from_numpy(row[m]).to(self.device)
            dst_idx = torch.from_numpy(pos[m]).to(out[0].device)
            for o, lf in zip(out, src):
                o.index_copy_(0, dst_idx, lf.index_select(0, src_idx).to(o.device, non_blocking=True))

    def close(self) -> None:
        self.slabs = []


def device_pool(layout: Layout, budget_bytes: int, samples: int, device: torch.device) -> Optional[SlabStore]:
    """The CUDA sample pool: slabs of 64 MiB from the leftover VRAM budget (None when nothing fits)."""
    rows = min(int(budget_bytes) // max(1, layout.sample_bytes), int(samples))
    if rows <= 0:
        return None
    return SlabStore(layout, rows, device, slab_bytes=VRAM_POOL_SLAB)


# -- disk stage -----------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_NAME = re.compile(rf"^{STAGE_PREFIX}-(?P<host>.+)-(?P<pid>\d+)-(?P<tok>[0-9a-f]+)\.pack$")


def sweep_stale(directory: str, host: Optional[str] = None) -> list[str]:
    """Remove pack files of dead processes of this host in ``directory``; returns what was removed."""
    host = host or socket.gethostname()
    removed = []
    for path in glob.glob(os.path.join(directory, f"{STAGE_PREFIX}-*.pack")):
        m = _NAME.match(os.path.basename(path))
        if not m or m.group("host") != host:
            continue
        pid = int(m.group("pid"))
        if pid != os.getpid() and not _pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    if removed:
        log.info("disk stage: removed %d stale pack file(s) of dead processes in %s", len(removed), directory)
    return removed


class DiskStage:
    """Rows in one memory-mapped pack file: leaf ``l`` is a ``[capacity, row_bytes_l]`` byte matrix.

    The file is allocated up front (posix_fallocate, so a full disk fails
    here, not as a SIGBUS mid-epoch) for ``capacity`` rows, where capacity
    is already bounded by disk_stage_gb and the data set size. Touched pages
    are dropped from our mapping every ``DISK_RSS_WINDOW`` bytes: the data
    stays in the file and the page cache (reclaimable), not in our RSS.
    """

    def __init__(self, layout: Layout, capacity: int, directory: str) -> None:
        self.layout = layout
        self.capacity = int(capacity)
        self.used = 0
        os.makedirs(directory, exist_ok=True)
        sweep_stale(directory)
        name = f"{STAGE_PREFIX}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.pack"
        self.path = os.path.join(directory, name)
        self.row_bytes = layout.row_bytes
        size = max(1, self.capacity * layout.sample_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except (AttributeError, OSError) as e:
                if isinstance(e, OSError) and e.errno == 28:  # ENOSPC: refuse, never SIGBUS later
                    raise
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        atexit.register(self.close)
        self.views: list[np.ndarray] = []
        off = 0
        for rb in self.row_bytes:
            self.views.append(np.frombuffer(self._mm, dtype=np.uint8, count=self.capacity * rb, offset=off)
                              .reshape(self.capacity, rb))
            off += self.capacity * rb
        self._touched = 0
        self._lock = threading.Lock()
        self.closed = False

    @property
    def nbytes(self) -> int:
        return self.capacity * self.layout.sample_bytes

    def reserve(self, k: int) -> np.ndarray:
        take = max(0, min(int(k), self.capacity - self.used))
        slots = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        return slots

    def _touch(self, nbytes: int) -> None:
        with self._lock:
            self._touched += nbytes
            if self._touched < DISK_RSS_WINDOW or self.closed:
                return
            self._touched = 0
            try:
                self._mm.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):
                pass

    def write(self, slots: np.ndarray, leaves: list[torch.Tensor]) -> None:
        for v, lf, rb in zip(self.views, leaves, self.row_bytes):
            if rb:
                v[slots] = lf.detach().to("cpu").contiguous().reshape(len(slots), -1).view(torch.uint8).numpy()
        self._touch(len(slots) * self.layout.sample_bytes)

    def read_into(self, out: list[torch.Tensor], pos: np.ndarray, slots: np.ndarray) -> None:
        dst_idx = torch.from_numpy(pos)
        for o, v, rb, dt, shape in zip(out, self.views, self.row_bytes, self.layout.dtypes, self.layout.row_shapes):
            if not rb:
                continue
            raw = torch.from_numpy(v[slots])  # fancy indexing copies out of the map
            rows = raw.view(dt).reshape(len(slots), *shape)
            o.index_copy_(0, dst_idx.to(o.device), rows.to(o.device, non_blocking=True))
        self._touch(len(slots) * self.layout.sample_bytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.views = []
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a view still exported: the mapping dies with the process, the file goes now
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
