"""The collective on a real GPU (issue 13): NCCL with device_id, a collective that outlives its deadline
raises in Python (the process lives), the abort path, the sync's peak memory. One CUDA device is enough."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _nccl(master_store, op_timeout_s: float = 30.0):
    from flodl_exp.rank.backends import CollectiveBackend

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    return CollectiveBackend(host="127.0.0.1", store_port=master_store.port, rank=0, world_size=1, device=dev, backend="nccl",
                             op_timeout_s=op_timeout_s, store_timeout_s=30)


def test_a_collective_that_outlives_its_deadline_raises_and_the_group_can_be_rebuilt(master_store):
    import torch.distributed as dist

    from flodl_exp.rank.backends import CollectiveTimeout

    b = _nccl(master_store, op_timeout_s=1.0)
    t = torch.ones(4, device="cuda:0")
    torch.cuda._sleep(int(8e9))  # a few seconds of GPU cycles ahead of the all_reduce on this stream
    with pytest.raises(CollectiveTimeout):
        b._all_reduce(t)
    b.abort()
    assert not dist.is_initialized()
    torch.cuda.synchronize()
    b.rebuild(1, 0, 1, session="after-timeout")
    t = torch.full((4,), 2.0, device="cuda:0")
    b._all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((4,), 2.0)), "the process and a new group work after the timeout"
    b.close()


def test_a_one_rank_sync_keeps_parameters_and_buffers_and_its_memory_fits_the_reserve(master_store):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024)).cuda()
    model(torch.randn(64, 1024, device="cuda"))
    before = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    b = _nccl(master_store)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    d, post, pre = b.sync(model, 5, 1.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nsync working memory: {peak / 2**20:.1f} MiB = {peak / param_bytes:.2f} x parameter bytes")
    after = list(model.parameters()) + list(model.buffers())
    assert all(torch.allclose(x, y) for x, y in zip(before, after))
    assert d is not None and d < 1e-6
    assert peak <= 5 * param_bytes + 2**20, "the data plane reserves 5x the parameter bytes for a sync"
    b.abort()
    b.rebuild(1, 0, 1, session="s")
    b.close()


def test_the_rank_reports_the_physical_device():
    from flodl_exp.rank.worker import device_uuid, pick_device, use_device

    dev = pick_device("auto", 0)
    use_device(dev)
    assert dev.type == "cuda" and torch.cuda.current_device() == dev.index
    uuid = device_uuid(dev)
    assert uuid and uuid == str(torch.cuda.get_device_properties(dev).uuid)
