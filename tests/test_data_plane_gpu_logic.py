"""CPU unit tests for the data plane's GPU-path logic (issue 13, items 7-10): what needs no device.

The VRAM budget (sync reserve, the pool's full capacity, the per-device split, the
activation-peak rule), the copy rule (``copy_is_async``), unpinned host slabs, the
OOM fallback (a fake device tier that raises ``torch.OutOfMemoryError``) and the
CUDA budget wiring of ``DataPipeline.depth_for`` with the CUDA probes faked. The
same paths on a real GPU: tests/gpu/test_gpu_data_plane.py.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_data_plane import Synth, _same, drain, make_trainer

from flodl_exp.experiment import fetch_batch
from flodl_exp.rank.data import DataPipeline
from flodl_exp.rank.data import budget as B
from flodl_exp.rank.data import pipeline as P
from flodl_exp.rank.data.cache import DEVICE, RAM, SampleCache
from flodl_exp.rank.data.layout import Layout, copy_is_async, to_device
from flodl_exp.rank.data.pipeline import Feed, is_oom
from flodl_exp.rank.data.stores import SlabStore

DATA_DIR = Path(__file__).resolve().parents[1] / "flodl_exp" / "rank" / "data"
GIB = B.GIB
MIB = B.MIB


# -- 7: the VRAM budget ------------------------------------------------------------
def test_transient_reserve_is_the_larger_of_step_peak_and_sync_workspace():
    assert B.transient_reserve(300, 0) == 300
    assert B.transient_reserve(300, 500) == 500  # a sync needs more than a step: the sync is reserved
    assert B.transient_reserve(0, 0) == 0
    assert B.sync_reserve_bytes(1000) == 5000 == B.SYNC_WORKSPACE_FACTOR * 1000
    assert B.sync_reserve_bytes(-1) == 0


def test_headroom_charges_sync_reserve_and_pending_pool_capacity():
    kw: dict[str, Any] = dict(total=10_000, used=2000, max_usage=0.9)  # cap 9000
    assert B.vram_headroom(**kw, reserve=1000) == 6000
    assert B.vram_headroom(**kw, reserve=1000, sync_reserve=3000) == 4000  # max(peak, sync), not the sum
    assert B.vram_headroom(**kw, reserve=1000, pool_pending=2500) == 3500  # the pool's unallocated part is spoken for
    # depth: the same headroom over the batch size
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000) == 6
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000, sync_reserve=3000) == 4
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000, pool_pending=2500) == 3
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000, pool_pending=10**6) == 0
    # Readers copying a batch each hold one more batch of temporaries: charged too.
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000, readers=2) == 4  # 4 + 2 <= 6
    assert B.prefetch_depth_from_vram(100, 10, is_cuda=True, **kw, reserve=1000, readers=4) == 3  # 3 + 3 <= 6


@pytest.mark.parametrize("room,readers", [(0, 4), (1, 4), (5, 4), (7, 4), (8, 4), (9, 4), (100, 4), (6, 0), (3, 1)])
def test_depth_for_room_is_the_deepest_window_that_fits(room, readers):
    d = B.depth_for_room(room, readers)
    assert B.window_batches(d, readers) <= room < B.window_batches(d + 1, readers)
    assert B.flow_reserve_bytes(d, 10, readers) == max(B.window_batches(d, readers), 1) * 10


def test_pool_budget_reserves_the_sync_and_its_capacity_then_counts_against_depth():
    total, used, peak = 16 * GIB, 2 * GIB, GIB
    flow = B.flow_reserve_bytes(B.FLOW_RESERVE_BATCHES, MIB)
    cap = int(total * 0.9)
    plain = B.vram_pool_budget(total=total, used=used, max_usage=0.9, activation_peak=peak, flow_reserve=flow)
    assert plain == cap - used - peak - flow - B.VRAM_POOL_MARGIN
    synced = B.vram_pool_budget(total=total, used=used, max_usage=0.9, activation_peak=peak, flow_reserve=flow,
                                sync_reserve=3 * GIB)
    assert synced == plain - 2 * GIB  # max(1 GiB peak, 3 GiB sync) reserved
    # Next chunk, nothing of the pool allocated yet: depth sees only the flow reserve and the margin, not the pool.
    bb = MIB
    d = B.prefetch_depth_from_vram(bb, 1, is_cuda=True, total=total, used=used, max_usage=0.9, reserve=peak,
                                   sync_reserve=3 * GIB, pool_pending=synced)
    assert d == (flow + B.VRAM_POOL_MARGIN) // bb
    # Half the pool allocated (now live): the same depth, the budget is the same either way.
    d2 = B.prefetch_depth_from_vram(bb, 1, is_cuda=True, total=total, used=used + synced // 2, max_usage=0.9,
                                    reserve=peak, sync_reserve=3 * GIB, pool_pending=synced - synced // 2)
    assert d2 == d


def test_ranks_sharing_a_device_split_its_budget():
    total, cap = 10 * GIB, 9 * GIB  # max_usage 0.9
    # Two ranks probe an empty device at the same moment: each gets its half, together never more than the cap.
    own, live = 0, GIB  # 1 GiB of contexts / other processes
    pools = [B.vram_pool_budget(total=total, used=live, max_usage=0.9, activation_peak=0, flow_reserve=0, own=own,
                                ranks_on_device=2) for _ in range(2)]
    assert pools[0] == cap // 2 - B.VRAM_POOL_MARGIN
    assert sum(pools) + 2 * B.VRAM_POOL_MARGIN <= cap
    # One rank alone (ranks_on_device=1, the default) keeps the old law: cap - live.
    assert B.vram_headroom(total=total, used=live, max_usage=0.9, reserve=0) == cap - live
    assert B.vram_headroom(total=total, used=live, max_usage=0.9, reserve=0, own=own) == cap - live
    # A rank already holding its half has nothing more, whatever is free on the device.
    assert B.vram_headroom(total=total, used=5 * GIB, max_usage=0.9, reserve=0, own=cap // 2,
                           ranks_on_device=2) == 0
    # A foreign process filling the device still bounds every rank (cap - live < its part).
    assert B.vram_headroom(total=total, used=8 * GIB, max_usage=0.9, reserve=0, own=0, ranks_on_device=2) == GIB
    assert B.prefetch_depth_from_vram(GIB // 4, 1, is_cuda=True, total=total, used=live, max_usage=0.9, reserve=0,
                                      own=0, ranks_on_device=3) == (cap // 3) // (GIB // 4)


@pytest.mark.parametrize("rpn,gpus,local,want", [(2, 1, 0, 2), (2, 2, 1, 1), (3, 2, 0, 2), (3, 2, 1, 1), (4, 0, 0, 1),
                                                 (1, 8, 0, 1)])
def test_ranks_sharing_device(rpn, gpus, local, want):
    assert B.ranks_sharing_device(rpn, gpus, local, {}) == want  # no per-task binding in the environment


def test_activation_peak_does_not_absorb_the_prefetch_window():
    """The window's ready batches are the data plane's, already charged by the depth law: no decay over a run."""
    act, bb, cap = 400 * MIB, 16 * MIB, 2 * GIB
    assert B.update_activation_peak(act, 5000, 1000, 100, depth=10) == max(act, 5000 - 1000 - 1100)

    def run(rule, readers) -> list[int]:
        peak, depths = act, []
        for _ in range(12):
            d = B.prefetch_depth_from_vram(bb, 1, is_cuda=True, total=cap, used=0, max_usage=0.99, reserve=peak,
                                           readers=readers)
            depths.append(d)
            baseline = 100 * MIB
            # The step's activations while the window, the readers' temporaries and the batch in use are live.
            high = baseline + act + (B.window_batches(d, readers) + 1) * bb
            peak = rule(peak, high, baseline, d, readers)
        return depths

    for readers in (0, 4):
        new = run(lambda p, hi, base, d, r: B.update_activation_peak(p, hi, base, bb, d, r), readers)
        old = run(lambda p, hi, base, d, r: B.update_activation_peak(p, hi, base, bb), readers)  # the old rule
        assert len(set(new)) == 1 and new[0] > 0, new
        assert old[-1] < old[0], "the old rule decays (the check above is meaningful)"
    # A genuinely larger step still raises the peak, and it never shrinks.
    assert B.update_activation_peak(act, 100 + 2 * act + 3 * bb, 100, bb, 2) == 2 * act
    assert B.update_activation_peak(2 * act, 100 + act, 100, bb, 0) == 2 * act


def test_slab_store_pending_bytes_and_close():
    lay, _ = Layout.of((torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)), 2)  # 24 B per sample
    assert lay is not None
    st = SlabStore(lay, 100, torch.device("cpu"), slab_bytes=24 * 30)  # 30 rows per slab
    assert st.capacity_bytes == 2400 and st.nbytes == 0 and st.pending_bytes == 2400
    slots = st.reserve(40)
    st.write(slots, [torch.randn(40, 4), torch.arange(40)])
    assert st.nbytes == 60 * 24 and st.pending_bytes == 40 * 24  # two slabs of 30 rows allocated
    out = lay.empty(40, torch.device("cpu"))
    st.read_into(out, np.arange(40), slots)
    assert torch.equal(out[1], torch.arange(40))
    st.reserve(60)
    st.write(np.arange(60, 100), [torch.randn(40, 4), torch.arange(40)])
    assert st.nbytes == 2400 and st.pending_bytes == 0  # the last slab is partial: exactly the capacity
    st.close()
    assert st.nbytes == 0 and st.pending_bytes == 0 and len(st.reserve(5)) == 0
    with pytest.raises(RuntimeError):
        st.write(np.arange(1), [torch.randn(1, 4), torch.arange(1)])


# -- 8: the copy rule --------------------------------------------------------------
def _fake_tensor(device: str, pinned: bool):
    return SimpleNamespace(device=torch.device(device), is_pinned=lambda: pinned)


@pytest.mark.parametrize("src,pinned,dst,want", [
    ("cpu", True, "cuda", True),       # the one async copy: pinned host -> device
    ("cpu", True, "cuda:1", True),
    ("cpu", False, "cuda", False),     # pageable host: staged synchronously anyway
    ("cuda", False, "cpu", False),     # device -> host: the host would read before the copy ran
    ("cuda:0", False, "cuda:1", False),
    ("cpu", True, "cpu", False),
    ("cpu", False, "cpu", False),
])
def test_copy_is_async_only_pinned_host_to_cuda(src, pinned, dst, want):
    assert copy_is_async(_fake_tensor(src, pinned), dst) is want
    assert copy_is_async(_fake_tensor(src, pinned), torch.device(dst)) is want


def test_copy_is_async_on_real_cpu_tensors_and_to_device():
    t = torch.arange(6)
    assert copy_is_async(t, "cpu") is False and copy_is_async(t, "cuda") is False  # not pinned
    calls = []

    class Spy(torch.Tensor):
        def to(self, *a, **kw):
            calls.append(kw.get("non_blocking"))
            return torch.Tensor.to(torch.Tensor(self), *a, **kw)

    out = to_device(t.as_subclass(Spy), "cpu")
    assert calls == [False] and torch.equal(torch.Tensor(out), t)


def test_every_copy_in_the_data_plane_goes_through_the_rule():
    """``non_blocking=`` is written once, in ``layout.to_device``, as ``copy_is_async(...)``."""
    hits = []
    for f in sorted(DATA_DIR.glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if "non_blocking" in line and not line.lstrip().startswith(("#", '"""')) and "``" not in line:
                hits.append((f.name, i, line.strip()))
    assert hits == [("layout.py", hits[0][1], "return t.to(device, non_blocking=copy_is_async(t, device))")], hits
    src = (DATA_DIR / "pipeline.py").read_text()
    assert "batch_to(" not in src  # the experiment's batch_to copies non_blocking whatever the source
    assert not re.search(r"\.to\([^)]*non_blocking", (DATA_DIR / "cache.py").read_text() + (DATA_DIR / "stores.py").read_text())


# -- 9: no pinned slabs, a pinned staging buffer ---------------------------------------
def test_ram_slabs_are_not_pinned_the_staging_buffer_is(monkeypatch):
    calls: list[tuple[int, bool]] = []
    real = Layout.empty

    def spy(self, n, device, pin=False):
        calls.append((n, pin))
        return real(self, n, device, pin=False)  # this machine has no pinned allocator

    monkeypatch.setattr(Layout, "empty", spy)
    ds = Synth(300, dim=4)
    cache = SampleCache(ds, 300, ram_bytes=10**6, pin=True)  # a CUDA rank's cache
    for start in (0, 30, 0, 30):
        got, _ = cache.load(np.arange(start, start + 30)[::-1].copy())
        _same(got, fetch_batch(Synth(300, dim=4), np.arange(start, start + 30)[::-1].copy()))
    slab_rows = cache.tiers[RAM].slab_rows
    slab_calls = [c for c in calls if c[0] == min(slab_rows, 300)]
    staging = [c for c in calls if c[0] == 30]
    assert slab_calls and all(not pin for _, pin in slab_calls), calls
    assert staging and all(pin for _, pin in staging), calls
    cache.close()
    cpu_pipe = DataPipeline(Synth(10), device=torch.device("cpu"), batch_size=2, ram_max_usage=0.5)
    assert cpu_pipe.cache.pin is False  # a CPU rank pins nothing
    cpu_pipe.close()


# -- 7: the OOM fallback --------------------------------------------------------------
class OomPool:
    """A device tier whose every write fails as a CUDA allocation would."""

    def __init__(self, exc_type: type[BaseException]) -> None:
        self.exc_type = exc_type
        self.device = torch.device("cpu")
        self.capacity = 10**6
        self.used = 0
        self.writes = 0
        self.closed = False
        self.pending_bytes = 123

    def reserve(self, k: int) -> np.ndarray:
        return np.arange(k, dtype=np.int64)

    def write(self, slots, leaves) -> None:
        self.writes += 1
        raise self.exc_type("CUDA out of memory. Tried to allocate 64.00 MiB")

    def read_into(self, out, pos, slots) -> None:  # pragma: no cover - never published
        raise AssertionError("nothing was published to the pool")

    def close(self) -> None:
        self.closed = True


OOM_TYPES = [torch.cuda.OutOfMemoryError, torch.OutOfMemoryError]


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(torch.cuda.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("x")) and not is_oom(MemoryError())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "flodl_exp.data"]


@pytest.mark.parametrize("exc_type", OOM_TYPES)
def test_oom_in_the_pool_on_a_reader_falls_back_to_synchronous_fetch(caplog, exc_type):
    ref = make_trainer(Synth(256, dim=4))
    tr = make_trainer(Synth(256, dim=4), ram_max_usage=0.5, readers=2)
    pipe = tr.pipeline
    pool = OomPool(exc_type)
    pipe.cache.tiers = {DEVICE: pool, **pipe.cache.tiers}
    assert pipe.cache.pool_pending_bytes() == 123
    with caplog.at_level(logging.INFO, logger="flodl_exp.data"):
        st, got = drain(tr, 0, 0, 256)
        _, want = drain(ref, 0, 0, 256)
        assert pool.writes >= 1 and pipe.fallen_back and pool.closed
        assert DEVICE not in pipe.cache.tiers and pipe.cache.pool_pending_bytes() == 0
        assert st.feed.depth == 0  # the chunk went on synchronously
        st1, got1 = drain(tr, 1, 0, 256)
        _, want1 = drain(ref, 1, 0, 256)
        assert st1.feed.depth == 0  # and every later chunk too
    assert len(got) == len(want) == 32 and len(got1) == 32
    for a, b in zip(got + got1, want + want1):
        assert np.array_equal(a.ids, b.ids)
        _same(a.data, b.data)
    assert pipe.cache.rows()["ram"] == 256  # the samples went to the RAM tier instead
    warns = _warnings(caplog)
    assert len(warns) == 1 and "out of device memory" in warns[0] and "synchronous" in warns[0], warns
    tr.close_data()


@pytest.mark.parametrize("exc_type", OOM_TYPES)
def test_oom_in_the_pool_on_the_synchronous_path_retries_once(caplog, exc_type):
    pipe = DataPipeline(Synth(64, dim=4), device=torch.device("cpu"), batch_size=8, ram_max_usage=0.5)
    pool = OomPool(exc_type)
    pipe.cache.tiers = {DEVICE: pool, **pipe.cache.tiers}
    picks = np.arange(64)
    feed = Feed(pipe, 0, picks, 0)  # a depth-0 chunk (CUDA calibration, or no VRAM room)
    with caplog.at_level(logging.WARNING, logger="flodl_exp.data"):
        out = [feed.next() for _ in range(8)]
    for k, b in enumerate(out):
        assert b is not None and np.array_equal(b.ids, picks[k * 8:(k + 1) * 8])
        _same(b.data, fetch_batch(Synth(64, dim=4), picks[k * 8:(k + 1) * 8]))
    assert feed.next() is None and pool.writes == 1 and pipe.fallen_back
    assert len(_warnings(caplog)) == 1
    assert pipe.depth_for(8) == 0
    pipe.close()


def test_a_second_oom_after_the_fallback_and_other_errors_propagate(caplog):
    class AlwaysOom(Synth):
        def get_batch(self, ids):
            raise torch.OutOfMemoryError("CUDA out of memory")

    tr = make_trainer(AlwaysOom(64, dim=4), ram_max_usage=0.5)
    st = tr.begin_epoch(0, 0, 64)
    with caplog.at_level(logging.WARNING, logger="flodl_exp.data"), pytest.raises(torch.OutOfMemoryError):
        tr.next_batch(st)  # the fallback's synchronous retry does not fit either: a real OOM
    assert tr.pipeline.fallen_back and len(_warnings(caplog)) == 1
    tr.close_data()
    pipe = DataPipeline(Synth(64, dim=4), device=torch.device("cpu"), batch_size=8, ram_max_usage=0.5)
    assert pipe.fall_back(Feed(pipe, 0, np.arange(64), 2), ValueError("corrupt")) is False
    assert not pipe.fallen_back
    pipe.close()


# -- 7: the CUDA budget wiring of depth_for, with the CUDA probes faked ------------------
class FakeCuda:
    """The CUDA memory counters ``DataPipeline`` reads, driven by the test."""

    def __init__(self, total: int, other: int) -> None:
        self.total, self.other = total, other
        self.allocated = 0
        self.peak = 0

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(P, "cuda_memory", lambda dev: (self.total, self.other + self.allocated))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(synchronize=lambda: None))


@pytest.mark.parametrize("ranks_on_device", [1, 2])
def test_depth_for_charges_sync_reserve_pool_capacity_and_splits_the_device(monkeypatch, ranks_on_device):
    fake = FakeCuda(total=10 * GIB, other=GIB)
    fake.install(monkeypatch)
    n, dim, bs = 4096, 256, 16  # 1032 B per sample
    pipe = DataPipeline(Synth(n, dim=dim), device=torch.device("cpu"), batch_size=bs, ram_max_usage=0.5,
                        ranks_on_device=ranks_on_device)
    model = torch.nn.Linear(1024, 1024)  # 1,049,600 parameters -> 4,198,400 B of float32
    assert pipe.reserve_for_sync(model) == 5 * 4 * (1024 * 1024 + 1024)
    pipe.sync_reserve_bytes = 2 * GIB  # larger than the step peak below, so it decides
    pipe.is_cuda, pipe.pool_wanted = True, True  # the CUDA budget path, on this CPU machine
    pipe.cache.load(np.arange(bs))  # the row layout
    assert pipe.cache.layout is not None
    sb = pipe.cache.layout.sample_bytes
    bb = sb * bs
    pipe.activation_peak = 512 * MIB
    cap = int(10 * GIB * 0.9)
    # This rank's model, optimizer state, ...: chosen so its part of the budget leaves a pool of ~2 MiB (< the data set).
    part = min(cap // ranks_on_device, cap - fake.other)  # one rank: the other process binds; two: the half
    fake.allocated = part - 2 * GIB - B.VRAM_POOL_MARGIN - B.flow_reserve_bytes(16, bb, 4) - 2 * MIB
    d = pipe.depth_for(10**6)
    room = min(cap // ranks_on_device - fake.allocated, cap - fake.allocated - fake.other) - 2 * GIB
    assert d == B.FLOW_RESERVE_BATCHES  # the pool-install chunk
    pool = pipe.cache.tiers[DEVICE]
    want = room - B.flow_reserve_bytes(d, bb, pipe.n_readers) - B.VRAM_POOL_MARGIN
    assert pool.capacity == min(want // sb, n)
    # Nothing of the pool is allocated yet: the next chunk still counts its whole capacity.
    assert pipe.cache.pool_pending_bytes() == pool.capacity * sb
    assert 0 < pool.capacity < n
    d2 = pipe.depth_for(10**6)
    assert pipe.n_readers == 4 and d2 == B.depth_for_room((room - pool.capacity * sb) // bb, 4)
    assert 0 < d2 < 10**6 and B.window_batches(d2, 4) * bb + pool.capacity * sb <= room
    # Half of it allocated (live, so in ``allocated`` and ``used``): the same budget, the same depth.
    pool.write(pool.reserve(pool.capacity // 2), [torch.zeros(pool.capacity // 2, dim), torch.zeros(pool.capacity // 2,
                                                                                                   dtype=torch.int64)])
    fake.allocated += pool.nbytes
    assert pipe.depth_for(10**6) == d2
    pipe.close()
