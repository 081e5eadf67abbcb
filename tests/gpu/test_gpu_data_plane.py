"""GPU tests of the rank data plane (flodl_exp/rank/data) on a real CUDA device (issue 13, items 7-10).

Run: ``bash tests/gpu/check.sh`` (or ``pytest -q tests/gpu -m gpu``) on a machine with CUDA; everything here skips
without one. Each test's ``timeout`` mark is its time budget (the check prints the time each took against it).
The device-free parts of the same logic are tested in tests/test_data_plane_gpu_logic.py.

- calibration, prefetch and the device pool (moved from tests/test_data_plane.py);
- the VRAM budget inequality with the pool installed, the device total faked so the budget binds;
- a data set that returns CUDA tensors, retained in the RAM tier and read back exactly;
- an OOM injected into the pool: one warning, the pool dropped, synchronous fetch, exact batches;
- stream ordering of pool slots written on one stream and read on the other (depth-0 reads after
  reader writes, reader reads after depth-0 writes), with a delay kernel that makes a missing wait fail.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_data_plane import Synth, drain

from flodl_exp.experiment import Experiment, fetch_batch
from flodl_exp.rank.data import DataPipeline, stores
from flodl_exp.rank.data import budget as B
from flodl_exp.rank.data import pipeline as P
from flodl_exp.rank.data.cache import _SHIFT, DEVICE, RAM
from flodl_exp.rank.data.pipeline import Feed
from flodl_exp.rank.trainer import RankTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB, GIB = B.MIB, B.GIB
SLEEP_CYCLES = 400_000_000
"""``torch.cuda._sleep`` length: ~0.2 s at ~2 GHz, far longer than the host needs to issue the racing read."""


class Cheap:
    """``n`` samples of ``dim`` float32 features cheap to compute from the id; label ``id % 10``."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim
        self.loaded = 0

    def __len__(self) -> int:
        return self.n

    def ref(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(np.ascontiguousarray(ids, dtype=np.int64))
        return ((i[:, None] * 31 + torch.arange(self.dim)) % 1009).float(), i % 10

    def get_batch(self, ids):
        self.loaded += len(ids)
        return self.ref(ids)


class OnDevice(Cheap):
    """The same batches computed on the GPU, behind a delay kernel: a host read that does not wait reads garbage."""

    def __init__(self, n: int, dim: int, device: torch.device) -> None:
        super().__init__(n, dim)
        self.device = device

    def get_batch(self, ids):
        self.loaded += len(ids)
        i = torch.as_tensor(np.ascontiguousarray(ids, dtype=np.int64)).to(self.device)
        torch.cuda._sleep(SLEEP_CYCLES // 20)
        x = ((i[:, None] * 31 + torch.arange(self.dim, device=self.device)) % 1009).float()
        return x, i % 10


def _check(ds: Cheap, ids, data) -> None:
    x, y = data
    assert x.is_cuda and y.is_cuda
    rx, ry = ds.ref(ids)
    assert torch.equal(x.cpu(), rx), "features differ"
    assert torch.equal(y.cpu(), ry), "labels differ"


def _chunk(pipe: DataPipeline, ds: Cheap, epoch: int, picks) -> int:
    """Open a chunk over ``picks``, check every delivered batch, drop it; returns the chunk's depth."""
    feed = pipe.open(epoch, np.asarray(picks, dtype=np.int64))
    while (b := feed.next()) is not None:
        _check(ds, b.ids, b.data)
    return feed.depth


def _pool_rows(pipe: DataPipeline) -> int:
    loc = pipe.cache.loc
    return int(((loc >= 0) & ((loc >> _SHIFT) == DEVICE)).sum())


@pytest.fixture(autouse=True)
def _clean_device():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- the existing CUDA behaviour -------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool_env", [None, "off"])
def test_cuda_calibration_prefetch_and_device_pool(monkeypatch, pool_env):
    if pool_env:
        monkeypatch.setenv("FLODL_VRAM_POOL", pool_env)
    dev = torch.device("cuda:0")
    ds = Synth(512, dim=32)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 10).to(dev)
    exp = Experiment(model, torch.optim.SGD(model.parameters(), lr=0.05), None, ds, None,
                     lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), None)
    pipe = DataPipeline(ds, device=dev, batch_size=32, seed=42, ram_max_usage=0.5)
    tr = RankTrainer(exp, device=dev, seed=42, batch_size=32)
    tr.attach_pipeline(pipe)
    assert pipe.sync_reserve_bytes == B.sync_reserve_bytes(4 * (32 * 10 + 10))
    depths = []
    # The first chunk covers part of the data only: samples first seen after the pool is installed go to it
    # (samples already in the RAM tier stay there).
    for e, size in enumerate((128, 512, 512)):
        st, out = drain(tr, e, 0, size, train=True)
        depths.append(st.feed.depth)
        for b in out:
            ref = fetch_batch(Synth(512, dim=32), b.ids)
            assert b.data[0].is_cuda and torch.equal(b.data[0].cpu(), ref[0]) and torch.equal(b.data[1].cpu(), ref[1])
    assert depths[0] == 0 and pipe.activation_peak > 0  # first chunk: synchronous, measures the peak
    assert depths[1] > 0 and depths[2] > 0
    if pool_env is None:
        assert pipe.cache.rows().get("device", 0) > 0 and pipe.cache.stats["device"] > 0
    else:
        assert "device" not in pipe.cache.rows()
    tr.close_data()


# -- 7: the budget inequality with the pool installed ------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks_on_device", [1, 2])
def test_vram_budget_holds_with_the_pool_installed(monkeypatch, ranks_on_device):
    """max_memory_allocated over the run never exceeds this rank's part of the (faked) device budget.

    The device's total is faked so the budget binds: this rank's part is what it holds at the start plus
    1 GiB, and the data set (655 MB) is larger than the pool that part leaves. With two ranks on the
    device, the other one is taken to hold its whole part. Slack: allocator rounding, index tensors and
    the trainer holding the previous batch while it takes the next (8 MiB + 4 batches; the pool and the
    prefetch window it must account for are ~500 MiB each).
    """
    dev = torch.device("cuda:0")
    n, dim, bs = 80_000, 2048, 64
    ds = Cheap(n, dim)
    torch.manual_seed(0)
    model = torch.nn.Linear(dim, 10).to(dev)
    exp = Experiment(model, torch.optim.SGD(model.parameters(), lr=0.01), None, ds, None,
                     lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), None)
    pipe = DataPipeline(ds, device=dev, batch_size=bs, seed=42, ram_max_usage=0.5, ranks_on_device=ranks_on_device)
    tr = RankTrainer(exp, device=dev, seed=42, batch_size=bs)
    tr.attach_pipeline(pipe)  # reserves the sync's working memory
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    part = base + GIB
    total = int(part * ranks_on_device / 0.9) + 4096
    cap = int(total * 0.9)
    assert cap // ranks_on_device >= part
    other = cap - cap // ranks_on_device  # the other ranks on the device, each at its full part
    monkeypatch.setattr(P, "cuda_memory", lambda d: (total, torch.cuda.memory_allocated(d) + other))
    peaks: list[int] = []
    real_reset = torch.cuda.reset_peak_memory_stats

    def recording_reset(device=None):
        peaks.append(torch.cuda.max_memory_allocated(device))
        real_reset(device)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", recording_reset)
    real_reset(dev)

    def train_chunk(epoch: int, picks) -> int:
        feed = pipe.open(epoch, np.asarray(picks, dtype=np.int64))
        tr.model.train()
        while (b := feed.next()) is not None:
            _check(ds, b.ids, b.data)
            tr.optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(tr.model(b.data[0]), b.data[1])
            loss.backward()
            tr.optimizer.step()
            del loss
        return feed.depth

    perm = np.random.default_rng(0).permutation(n)
    depths = [train_chunk(0, perm[:4 * bs]),  # calibration (synchronous)
              train_chunk(0, perm[4 * bs:12 * bs]),  # the pool is installed: its capacity is spoken for from now on
              train_chunk(1, np.random.default_rng(1).permutation(n)),
              train_chunk(2, np.random.default_rng(2).permutation(n))]
    torch.cuda.synchronize(dev)
    peaks.append(torch.cuda.max_memory_allocated(dev))
    pool = pipe.cache.tiers[DEVICE]
    assert 0 < pool.capacity < n, "the budget should bind: the pool holds part of the data set"
    assert _pool_rows(pipe) == pool.capacity and pipe.cache.stats["device"] > 0
    assert depths[0] == 0 and all(d > 0 for d in depths[1:]), depths
    assert pipe.cache.layout is not None
    slack = 8 * MIB + 4 * bs * pipe.cache.layout.sample_bytes
    limit = cap // ranks_on_device
    assert max(peaks) <= limit + slack, f"peak {max(peaks) / MIB:.1f} MiB over the budget {limit / MIB:.1f} MiB"
    tr.close_data()


# -- 8: a data set returning CUDA tensors through the RAM tier ------------------------------------
@pytest.mark.timeout(60)
def test_cuda_dataset_rows_retained_in_ram_are_exact(monkeypatch):
    dev = torch.device("cuda:0")
    n, bs = 2048, 32
    ds = OnDevice(n, 64, dev)
    pipe = DataPipeline(ds, device=dev, batch_size=bs, seed=42, ram_max_usage=0.5, vram_pool=False)
    perm = np.random.default_rng(0).permutation(n)
    d0 = _chunk(pipe, ds, 0, perm[:4 * bs])  # synchronous, on the trainer's stream
    d1 = _chunk(pipe, ds, 0, perm[4 * bs:])  # readers: fetched on the copy stream, copied to RAM there
    assert d0 == 0 and d1 > 0
    assert ds.loaded == n and pipe.cache.rows() == {"ram": n}
    for e in (1, 2):  # every sample now comes from the RAM tier (pinned staging -> device)
        assert _chunk(pipe, ds, e, np.random.default_rng(e).permutation(n)) > 0
    assert ds.loaded == n and pipe.cache.stats["ram"] >= 2 * n
    pipe.close()


# -- 7: an OOM in the pool falls back to synchronous fetch -------------------------------------------
@pytest.mark.timeout(60)
def test_injected_pool_oom_falls_back_to_synchronous_fetch(monkeypatch, caplog):
    dev = torch.device("cuda:0")
    n, dim, bs = 20_000, 2048, 64
    ds = Cheap(n, dim)
    pipe = DataPipeline(ds, device=dev, batch_size=bs, seed=42, ram_max_usage=0.5)
    real_slab = stores.SlabStore._slab

    def second_slab_fails(self, i):
        if self.device.type == "cuda" and i >= 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected)")
        return real_slab(self, i)

    monkeypatch.setattr(stores.SlabStore, "_slab", second_slab_fails)
    perm = np.random.default_rng(0).permutation(n)
    with caplog.at_level(logging.INFO, logger="flodl_exp.data"):
        assert _chunk(pipe, ds, 0, perm[:4 * bs]) == 0
        torch.cuda.synchronize(dev)
        before_pool = torch.cuda.memory_allocated(dev)
        feed_depth = _chunk(pipe, ds, 0, perm[4 * bs:])  # installs the pool; its second slab "fails"
        assert pipe.fallen_back and DEVICE not in pipe.cache.tiers
        assert feed_depth == 0  # the chunk went on synchronously after the OOM
        assert _chunk(pipe, ds, 1, np.random.default_rng(1).permutation(n)) == 0  # and later chunks too
    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "flodl_exp.data"]
    assert len(warns) == 1 and "out of device memory" in warns[0], warns
    assert pipe.cache.rows()["ram"] == n  # every sample retained on the host instead
    torch.cuda.synchronize(dev)
    assert torch.cuda.memory_allocated(dev) <= before_pool + 8 * MIB, "the pool's first slab should be freed"
    pipe.close()


# -- 10: stream ordering of pool slots ---------------------------------------------------------------
def _pooled(dev: torch.device, n: int = 4096) -> tuple[Cheap, DataPipeline]:
    ds = Cheap(n, 64)
    pipe = DataPipeline(ds, device=dev, batch_size=32, seed=42, ram_max_usage=0.5)
    pipe.cache.load(np.arange(32), dev)  # the row layout (these 32 go to RAM)
    assert pipe.cache.install_device_pool(256 * MIB, dev) > 0
    return ds, pipe


def _delayed_pool_writes(m: pytest.MonkeyPatch) -> None:
    """Each pool row copy waits behind a delay kernel on the stream that issues it."""
    real = stores.to_device

    def sleepy(t, device):
        out = real(t, device)
        if torch.device(device).type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)
        return out

    m.setattr(stores, "to_device", sleepy)


@pytest.mark.timeout(60)
def test_depth0_read_waits_for_pool_writes_on_the_copy_stream(monkeypatch):
    dev = torch.device("cuda:0")
    ds, pipe = _pooled(dev)
    ids = np.arange(1000, 1032)
    assert pipe.copy_stream is not None
    with monkeypatch.context() as m:
        _delayed_pool_writes(m)
        with torch.cuda.stream(pipe.copy_stream):  # as a reader admits samples
            pipe.cache.load(ids, dev)
    assert _pool_rows(pipe) == 32
    assert not pipe.copy_stream.query(), "the pool write should still be queued (else this test proves nothing)"
    b = Feed(pipe, 0, ids, 0).next()  # a depth-0 chunk reads the slots on the trainer's stream
    assert b is not None
    _check(ds, b.ids, b.data)
    assert pipe.cache.stats["device"] == 32
    pipe.close()


@pytest.mark.timeout(60)
def test_reader_read_waits_for_pool_writes_on_the_trainer_stream(monkeypatch):
    dev = torch.device("cuda:0")
    ds, pipe = _pooled(dev)
    ids = np.arange(2000, 2064)
    with monkeypatch.context() as m:
        _delayed_pool_writes(m)
        pipe.cache.load(ids, dev)  # as a depth-0 chunk admits samples, on the trainer's stream
    assert _pool_rows(pipe) == 64
    assert not torch.cuda.current_stream(dev).query(), "the pool write should still be queued"
    monkeypatch.setattr(pipe, "depth_for", lambda chunk_batches: 2)
    feed = pipe.open(0, ids)  # readers read the slots on the copy stream
    assert feed.depth == 2
    got = 0
    while (b := feed.next()) is not None:
        _check(ds, b.ids, b.data)
        got += 1
    assert got == 2 and pipe.cache.stats["device"] == 64
    pipe.close()


@pytest.mark.timeout(30)
def test_ram_tier_is_not_pinned_on_cuda():
    dev = torch.device("cuda:0")
    ds = Cheap(512, 16)
    pipe = DataPipeline(ds, device=dev, batch_size=32, ram_max_usage=0.5, vram_pool=False)
    _chunk(pipe, ds, 0, np.arange(512))
    slabs = pipe.cache.tiers[RAM].slabs
    assert slabs and not any(t.is_pinned() for slab in slabs for t in slab)
    assert pipe.cache.pin  # the staging buffer is
    pipe.close()
