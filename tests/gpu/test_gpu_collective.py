"""The collective on real GPUs, two ranks each (issue 28): a world size of 1 proves nothing (its all_reduce is an
identity and there is no peer to lose).

* Gloo with two processes on one GPU (how ranks sharing a GPU average: CUDA replicas staged through the host),
  and NCCL with two processes on two GPUs (skipped with fewer): the weighted average of two different replicas
  equals the one computed here on the CPU, buffers averaged equally, inside the sync's VRAM reserve;
* a peer that goes silent, or dies: the survivor's collective raises in Python (:class:`CollectiveTimeout` at its
  own deadline for the silent one), the process lives with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` inherited, the
  group is aborted without waiting, and a new group (generation 1, alone) forms in the same process and reduces
  (the elastic regroup of items 1 and 5, on NCCL too);
* snapshot staging for the wire (cpu backend, bf16): values written to the replica by a kernel still queued
  behind a delay on the stream reach the host as the values computed here, not as what the buffer held;
* the device a rank reports is the one ``nvidia-smi -L`` (or NVML) lists, and the build has kernels for it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

from conftest import run_spawned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
SETUPS = [
    pytest.param("gloo", (0, 0), id="gloo-two-ranks-one-gpu"),
    pytest.param("nccl", (0, 1), id="nccl-two-gpus",
                 marks=pytest.mark.skipif(not TWO_GPUS, reason="NCCL with two ranks needs two GPUs")),
]
DIM = 256
PEER_TIMEOUT_S = 4.0


def _model(rank: int, dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(100 + rank)  # two different replicas
    m = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.BatchNorm1d(DIM)).to(dev)
    m(torch.randn(32, DIM, device=dev))  # running statistics differ too
    return m


def _host(model: torch.nn.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from flodl_exp.averaging import float_buffers

    return ([p.detach().cpu().numpy().copy() for p in model.parameters()],
            [b.detach().cpu().numpy().copy() for b in float_buffers(model)])


def _backend(rank: int, port: int, backend: str, dev: torch.device, op_timeout_s: float):
    from flodl_exp.rank.backends import CollectiveBackend

    return CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=dev, backend=backend,
                             op_timeout_s=op_timeout_s, store_timeout_s=60)


def _measured_sync(rank: int, port: int, backend: str, index: int, q, sync) -> None:
    """Two different replicas, one on each rank; ``sync(backend, model, dev)`` averages them; what each held before
    and after, and the sync's peak VRAM beside the parameter bytes, go to ``q``."""
    torch.set_num_threads(1)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    model = _model(rank, dev)
    before = _host(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    b = _backend(rank, port, backend, dev, 60.0)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    sync(b, model, dev)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    q.put((rank, before, _host(model), peak, param_bytes))
    b.close()


def _average(rank: int, port: int, backend: str, index: int, q) -> None:
    _measured_sync(rank, port, backend, index, q, lambda b, model, dev: b.sync(model, rank + 1, 1.0))  # masses 1, 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "gpus"), SETUPS)
def test_two_ranks_average_to_the_weighted_mean_within_the_reserve(master_store, backend, gpus):
    got, codes = run_spawned(_average, [(r, master_store.port, backend, gpus[r]) for r in (0, 1)], timeout=120)
    assert codes == [0, 0], codes
    by = {r: (before, after, peak, pb) for r, before, after, peak, pb in got}
    (p0, b0), (p1, b1) = by[0][0], by[1][0]
    want_p = [(1 * x + 2 * y) / 3 for x, y in zip(p0, p1)]  # the n^gamma-weighted mean, computed here
    want_b = [(x + y) / 2 for x, y in zip(b0, b1)]  # float buffers: equally among movers
    assert not np.allclose(p0[0], p1[0]), "the replicas must differ for the average to show"
    for r in (0, 1):
        pa, ba = by[r][1]
        for got_t, want in zip(pa + ba, want_p + want_b):
            np.testing.assert_allclose(got_t, want, rtol=1e-5, atol=1e-6)
        peak, param_bytes = by[r][2], by[r][3]
        print(f"\nrank {r} ({backend}): sync working memory {peak / 2**20:.1f} MiB = {peak / param_bytes:.2f} x parameter bytes")
        assert peak <= 5 * param_bytes + 2**20, "the data plane reserves 5x the parameter bytes for a sync"


def _overlapped(rank: int, port: int, backend: str, index: int, q) -> None:
    def sync(b, model: torch.nn.Module, dev: torch.device) -> None:
        b.start_overlapped(model, rank + 1, 1.0)  # masses 1 and 2; the all-reduce runs while the replica trains on
        torch.cuda._sleep(50_000_000)  # the "training" below queues behind a delay, concurrent with the all-reduce
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.5 * (rank + 1))
        b.land_overlapped(model, True, keep_current=True)
        b.apply_correction(model)

    _measured_sync(rank, port, backend, index, q, sync)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "gpus"), SETUPS)
def test_an_overlapped_all_reduce_lands_as_the_weighted_mean_plus_what_was_trained_since(master_store, backend, gpus):
    """``mode.overlap`` on CUDA: launched, the replica written meanwhile by kernels queued behind a delay (the
    all-reduce's own buffer untouched), landed as ``W_avg + (W_now - W_sent)``, within the sync's VRAM reserve."""
    got, codes = run_spawned(_overlapped, [(r, master_store.port, backend, gpus[r]) for r in (0, 1)], timeout=120)
    assert codes == [0, 0], codes
    by = {r: (before, after, peak, pb) for r, before, after, peak, pb in got}
    (p0, b0), (p1, b1) = by[0][0], by[1][0]
    want_p = [(1 * x + 2 * y) / 3 for x, y in zip(p0, p1)]
    want_b = [(x + y) / 2 for x, y in zip(b0, b1)]
    for r in (0, 1):
        pa, ba = by[r][1]
        for got_t, want in zip(pa, want_p):
            np.testing.assert_allclose(got_t, want + 0.5 * (r + 1), rtol=1e-5, atol=1e-5)
        for got_t, want in zip(ba, want_b):  # buffers trained nothing since: the movers' mean
            np.testing.assert_allclose(got_t, want, rtol=1e-5, atol=1e-6)
        peak, param_bytes = by[r][2], by[r][3]
        print(f"\nrank {r} ({backend}, overlapped): sync working memory {peak / 2**20:.1f} MiB = "
              f"{peak / param_bytes:.2f} x parameter bytes")
        assert peak <= 5 * param_bytes + 2**20, "the data plane reserves 5x the parameter bytes for a sync"


def _peer_lost(rank: int, port: int, backend: str, index: int, how: str, q) -> None:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # inherited, as sbatch passes it on (item 5): must not matter
    torch.set_num_threads(1)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    from flodl_exp.rank.backends import CollectiveTimeout

    model = _model(0, dev)  # equal replicas: the first sync leaves them as they are
    b = _backend(rank, port, backend, dev, PEER_TIMEOUT_S)
    b.sync(model, 1, 1.0)  # generation 0 works for both
    if rank == 1:  # it never joins the next collective: hung (alive, silent), or dead
        q.put((rank, how, 0.0, 0.0, None))
        q.close()
        q.join_thread()
        if how == "silent":
            time.sleep(PEER_TIMEOUT_S + 6)
        os._exit(0)
    t0 = time.monotonic()
    try:
        b.sync(model, 1, 1.0)
        q.put((rank, "the collective completed without its peer", 0.0, 0.0, None))
        return
    except CollectiveTimeout:
        what = "timed out"
    except Exception as e:  # a dead peer may also fail the collective at once (Gloo: the connection closed)
        what = f"failed: {type(e).__name__}"
    waited = time.monotonic() - t0
    b.restore(model)
    t1 = time.monotonic()
    b.rebuild(1, 0, 1, session="alone")  # aborts generation 0 without waiting for its pending collective
    regroup_s = time.monotonic() - t1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    b.sync(model, 2, 1.0)
    value = float(next(model.parameters()).detach().flatten()[0])
    b.close()
    q.put((rank, what, waited, regroup_s, value))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["silent", "dead"])
@pytest.mark.parametrize(("backend", "gpus"), SETUPS)
def test_a_lost_peer_raises_in_python_and_the_survivor_regroups(master_store, backend, gpus, how):
    """A silent peer: :class:`CollectiveTimeout` at the rank's own deadline. A dead one: that, or the collective's
    own error. Either way the process lives (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 inherited notwithstanding), the group
    is aborted without waiting, and the survivor forms generation 1 alone and reduces on the GPU."""
    got, codes = run_spawned(_peer_lost, [(r, master_store.port, backend, gpus[r], how) for r in (0, 1)], timeout=120)
    r0 = next(g for g in got if g[0] == 0)
    _, what, waited, regroup_s, value = r0
    if how == "silent":
        assert what == "timed out", r0
        assert PEER_TIMEOUT_S * 0.9 <= waited, f"the deadline fired after {waited:.1f}s"
    else:
        assert what == "timed out" or what.startswith("failed"), r0
    assert waited <= PEER_TIMEOUT_S + 10, f"the survivor learnt of the loss after {waited:.1f}s"
    assert regroup_s < 30, f"aborting and forming the new group took {regroup_s:.1f}s"
    assert value == pytest.approx(3.0), "the new group (alone) reduced: the process and CUDA survived the loss"
    assert codes[0] == 0, codes


@pytest.mark.timeout(60)
def test_snapshot_staging_waits_for_the_replica_written_behind_a_delay():
    """The replica's new values are written by a kernel queued behind ~0.3 s of GPU sleep on the current stream;
    the staged host tensors must hold them (bf16 of values computed here on the CPU), not the stale buffer."""
    from flodl_exp.rank.backends import CoordinatorBackend

    dev = torch.device("cuda:0")
    torch.manual_seed(7)
    want_p = [torch.randn(513, 7), torch.randn(1000)]
    want_b = [torch.randn(33)]
    dst_p = [torch.zeros_like(t, device=dev) for t in want_p]
    dst_b = [torch.zeros_like(t, device=dev) for t in want_b]
    src = [t.to(dev) for t in want_p + want_b]
    be = CoordinatorBackend(bf16_wire=True)
    for _ in range(2):  # the second pass reuses the staging buffer, stale values from the first in it
        torch.cuda.synchronize(dev)
        for t in dst_p + dst_b:
            t.zero_()
        torch.cuda._sleep(600_000_000)  # the copies below run only after this
        for d, s in zip(dst_p + dst_b, src):
            d.copy_(s)
        out = be.stage(dst_p, dst_b, torch.bfloat16, pin=True)
        for i, w in enumerate(want_p):
            assert out[f"p{i}"].dtype == torch.bfloat16 and torch.equal(out[f"p{i}"], w.to(torch.bfloat16)), f"p{i}"
        for j, w in enumerate(want_b):
            assert torch.equal(out[f"b{j}"], w), f"b{j}"
        src = [s * -2 for s in src]
        want_p, want_b = [w * -2 for w in want_p], [w * -2 for w in want_b]


def _listed_uuids() -> list[str]:
    """Every GPU and MIG device UUID as the driver lists it (``nvidia-smi -L``, else NVML): independent of torch."""
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        found = re.findall(r"UUID: ((?:GPU|MIG)-[0-9A-Za-z/-]+)\)", r.stdout)
        if found:
            return found
    pynvml = pytest.importorskip("pynvml", reason="neither nvidia-smi -L nor NVML to compare with")
    from flodl_exp.rank.telemetry import _nvml_devices

    pynvml.nvmlInit()
    try:
        out = []
        for h in _nvml_devices(pynvml):
            u = pynvml.nvmlDeviceGetUUID(h)
            out.append(u.decode() if isinstance(u, bytes) else str(u))
        return out
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.timeout(60)
def test_the_rank_reports_the_device_the_driver_lists():
    from flodl_exp.devices import arch_runs_on
    from flodl_exp.rank.worker import device_uuid, pick_device, use_device

    listed = _listed_uuids()
    assert listed, "the driver lists no device"
    dev = pick_device("auto", 0)
    use_device(dev)
    assert dev.type == "cuda" and torch.cuda.current_device() == dev.index
    ours = [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    assert all(ours) and len(set(ours)) == len(ours), ours

    def norm(u: str) -> str:
        return u.lower().removeprefix("gpu-").removeprefix("mig-")

    by_bare = {norm(u): u for u in listed}
    for u in ours:
        assert u is not None and norm(u) in by_bare, f"{u} is not among the driver's devices {listed}"
        assert u.upper().startswith("MIG-") == by_bare[norm(u)].upper().startswith("MIG-"), "a MIG slice says so"
    arch = torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        assert arch_runs_on(cap, arch), f"cuda:{i} {cap} judged unsupported by {arch}, yet this check runs on it"
