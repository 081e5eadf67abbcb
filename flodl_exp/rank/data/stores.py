"""Retention tiers for raw samples: host RAM slabs, device slabs, and the disk-stage pack file.

All three keep fixed-size rows (one per sample and leaf, see ``layout.py``)
at integer slots handed out first come, first served up to a capacity fixed
from the budget. There is no eviction: epochs visit samples in a fresh random
order, so any admitted set is as good as another and a static one never
churns. Slots are written once, before the index publishes them, so reads
need no lock.

The disk stage is one pack file per rank process, named
``flodl_stage-<host>-<pid>-<token>.pack``: it is removed on close and at
interpreter exit, and files left by dead processes (a crash, SIGKILL) are
swept when the next one starts in the same directory.
"""
from __future__ import annotations

import atexit
import glob
import logging
import os
import re
import socket
import threading
import uuid
from typing import Optional

import numpy as np
import torch

from flodl_exp.rank.data.budget import MIB, VRAM_POOL_SLAB
from flodl_exp.rank.data.layout import Layout, to_device

log = logging.getLogger("flodl_exp.data")

RAM_SLAB = 16 * MIB
"""Host allocation granularity: the cache grows by slabs, so a small data set never reserves the whole budget.

Host slabs are never pinned: reads gather rows into a batch-sized staging buffer
(``SampleCache.load``), and that buffer is the one host-to-device copies go
through, so it is the one that is pinned. Pinning the slabs bought nothing and
locked up to 3/8 of the available memory."""
STAGE_PREFIX = "flodl_stage"


class SlabStore:
    """Rows in lazily allocated slabs on one device (host RAM, never pinned, or a CUDA device).

    ``capacity_bytes`` is what the store may grow to; only ``nbytes`` of it is
    allocated so far, and ``pending_bytes`` is the rest, which a VRAM budget
    must still count as spoken for. ``close`` drops the slabs; a closed store
    hands out no slot and allocates nothing more.
    """

    def __init__(self, layout: Layout, capacity: int, device: torch.device, *, slab_bytes: int = RAM_SLAB) -> None:
        self.layout = layout
        self.capacity = int(capacity)
        self.device = device
        self.slab_rows = max(1, int(slab_bytes) // max(1, layout.sample_bytes))
        self.used = 0
        self.slabs: list[list[torch.Tensor]] = []
        self.allocated = 0
        self.closed = False
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the slabs allocated so far."""
        return self.allocated

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all the slabs the capacity needs (allocated or not)."""
        return self.capacity * self.layout.sample_bytes

    @property
    def pending_bytes(self) -> int:
        """Capacity not allocated yet (0 once closed)."""
        return 0 if self.closed else max(0, self.capacity_bytes - self.allocated)

    def reserve(self, k: int) -> np.ndarray:
        """Up to ``k`` fresh slots (fewer when the capacity runs out; none once closed)."""
        take = 0 if self.closed else max(0, min(int(k), self.capacity - self.used))
        slots = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        return slots

    def _slab(self, i: int) -> list[torch.Tensor]:
        with self._lock:
            if self.closed:
                raise RuntimeError("slab store closed")
            while len(self.slabs) <= i:
                rows = max(1, min(self.slab_rows, self.capacity - len(self.slabs) * self.slab_rows))
                self.slabs.append(self.layout.empty(rows, self.device))
                self.allocated += rows * self.layout.sample_bytes
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
                d.index_copy_(0, dst_idx, to_device(rows, self.device))

    def read_into(self, out: list[torch.Tensor], pos: np.ndarray, slots: np.ndarray) -> None:
        """``out[l][pos[j]] = row(slots[j])`` (``out`` on this store's device)."""
        sid, row = np.divmod(slots, self.slab_rows)
        slabs = self.slabs
        for s in np.unique(sid):
            m = np.nonzero(sid == s)[0]
            src = slabs[int(s)]
            src_idx = torch.from_numpy(row[m]).to(self.device)
            dst_idx = torch.from_numpy(pos[m]).to(out[0].device)
            for o, lf in zip(out, src):
                o.index_copy_(0, dst_idx, to_device(lf.index_select(0, src_idx), o.device))

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.slabs = []
            self.allocated = 0


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
    """Rows in one pack file: leaf ``l`` is a ``[capacity, row_bytes_l]`` byte matrix at a fixed offset.

    Why positional I/O (``pwrite``/``preadv``) and not a memory map: on
    kernels whose page cache holds large folios (Linux 6.x ext4/xfs with THP),
    touching one 4 KiB row of a mapped file maps its whole 2 MiB folio into
    the process (measured here: +2048 KiB RssFile per random row read), so a
    mapped stage read at random grows RSS towards the file size and no RAM
    budget holds. With pread the pages stay in the kernel's page cache
    (shared, reclaimable) and out of our RSS; a read is one syscall per row
    and leaf, microseconds next to the data set's own loading.

    The file is allocated up front (posix_fallocate: a full disk fails here,
    not mid-epoch) for ``capacity`` rows, already bounded by disk_stage_gb
    and the data set size.
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
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:
                if e.errno == 28:  # ENOSPC: refuse now rather than fail mid-epoch
                    raise
                os.ftruncate(self.fd, size)  # a file system without fallocate
        except BaseException:
            os.close(self.fd)
            os.unlink(self.path)
            raise
        self.offsets: list[int] = []
        off = 0
        for rb in self.row_bytes:
            self.offsets.append(off)
            off += self.capacity * rb
        self.closed = False
        atexit.register(self.close)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.layout.sample_bytes

    def reserve(self, k: int) -> np.ndarray:
        take = max(0, min(int(k), self.capacity - self.used))
        slots = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        return slots

    @staticmethod
    def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
        """(first index, first slot, length) of each run of consecutive slots."""
        runs = []
        start = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                runs.append((start, int(slots[start]), i - start))
                start = i
        return runs

    def write(self, slots: np.ndarray, leaves: list[torch.Tensor]) -> None:
        runs = self._runs(slots)
        for base, lf, rb in zip(self.offsets, leaves, self.row_bytes):
            if not rb:
                continue
            raw = lf.detach().to("cpu").contiguous().reshape(len(slots), -1).view(torch.uint8).numpy()
            for i, s, n in runs:
                buf = np.ascontiguousarray(raw[i:i + n]).data.cast("B")
                done = 0
                while done < len(buf):
                    done += os.pwrite(self.fd, buf[done:], base + s * rb + done)

    def read_into(self, out: list[torch.Tensor], pos: np.ndarray, slots: np.ndarray) -> None:
        dst_idx = torch.from_numpy(pos)
        for o, base, rb, dt, shape in zip(out, self.offsets, self.row_bytes, self.layout.dtypes,
                                          self.layout.row_shapes):
            if not rb:
                continue
            buf = np.empty((len(slots), rb), dtype=np.uint8)
            for j, s in enumerate(slots):
                if os.preadv(self.fd, [buf[j]], base + int(s) * rb) != rb:
                    raise OSError(f"disk stage {self.path}: short read at slot {int(s)}")
            rows = torch.from_numpy(buf).view(dt).reshape(len(slots), *shape)
            o.index_copy_(0, dst_idx.to(o.device), to_device(rows, o.device))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
