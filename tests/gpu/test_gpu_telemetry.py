"""GPU-only checks of telemetry's device matching and the trainer's event timing (issue 13, items 11-12).

Run on a CUDA host with nvidia-ml-py: ``bash tests/gpu/check.sh`` (or ``pytest -q tests/gpu``). Elsewhere every test
skips; without Hydra the trainer's timing test skips (it builds the experiment through it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_fakes import DIGITS_MLP

from flodl_exp.rank import telemetry as T

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
EXP = DIGITS_MLP


@pytest.fixture
def nvml():
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


def _uuid(nvml, handle) -> str:
    return T._norm(nvml.nvmlDeviceGetUUID(handle))


def _torch_uuid(dev: int) -> str:
    return str(torch.cuda.get_device_properties(dev).uuid).lower()


@pytest.mark.timeout(30)
def test_nvml_handle_has_the_torch_device_uuid(nvml):
    for dev in range(torch.cuda.device_count()):
        probe = T.GpuProbe(torch.device("cuda", dev))
        try:
            assert probe.found_by == "uuid"
            assert _uuid(nvml, probe.handle) in (f"gpu-{_torch_uuid(dev)}", f"mig-{_torch_uuid(dev)}")
        finally:
            probe.close()


@pytest.mark.timeout(30)
def test_per_process_memory_is_positive_after_allocating(nvml):
    dev = torch.device("cuda", 0)
    x = torch.ones(64 << 20, device=dev)  # 256 MiB
    torch.cuda.synchronize(dev)
    probe = T.GpuProbe(dev)
    try:
        s = probe.sample()
    finally:
        probe.close()
    del x
    assert s["gpu_proc_mem_gb"] >= 0.25 * 0.99, s  # ours: at least what we allocated
    assert s["mem_gb"] > 0


@pytest.mark.timeout(60)
def test_trainer_steps_are_timed_with_cuda_events():
    pytest.importorskip("hydra", reason="build_experiment instantiates through Hydra (tests/gpu/wheels.sh bundles it)")
    from flodl_exp.experiment import build_experiment
    from flodl_exp.rank.trainer import Batch, EpochState, RankTrainer

    dev = torch.device("cuda", 0)
    exp = build_experiment(EXP, world_size=1, device=dev, seed=0)
    tr = RankTrainer(exp, device=dev, batch_size=32)
    assert tr.device_timing
    ds = exp.train_data
    x, y = ds.x[:320].to(dev), ds.y[:320].to(dev)
    batches = [Batch(data=(x[i:i + 32], y[i:i + 32]), data_ms=0.0, ids=np.arange(i, i + 32)) for i in range(0, 320, 32)]
    st = EpochState(epoch=0, offset=0, picks=np.arange(320), batch_size=32)
    steps = []
    for b in batches:
        s = tr.step(b)
        assert s.start is not None and s.end is not None and s.loss_host is not None and not s.loss_host.is_cuda
        tr.record_step(st, b, s)
        steps.append(s)
    m = tr.end_epoch(st)
    assert not st.pending and m.batches == 10
    times = [s.ms for s in steps]
    assert all(t > 0 for t in times), times
    assert m.compute_only_ms == pytest.approx(sum(times))
    losses = [float(s.loss) for s in steps]
    assert [s.resolve()[0] for s in steps] == losses  # the pinned copy holds the loss once the step is done
    assert m.avg_loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    loss, ms = tr.train_step(batches[0])  # the per-batch path: resolved at once
    assert ms > 0 and loss == loss


_CHILD = """
import json, os, torch, pynvml
from flodl_exp.rank import telemetry as T
pynvml.nvmlInit()
n = torch.cuda.device_count()
probe = T.GpuProbe(torch.device("cuda", 0))
h, how = T.resolve_nvml_handle(0, os.environ["CUDA_VISIBLE_DEVICES"], None, pynvml)
print(json.dumps({"count": n, "torch_uuid": str(torch.cuda.get_device_properties(0).uuid),
                  "probe": pynvml.nvmlDeviceGetUUID(probe.handle), "found_by": probe.found_by,
                  "visible": pynvml.nvmlDeviceGetUUID(h), "visible_how": how}))
probe.close()
pynvml.nvmlShutdown()
"""


@pytest.mark.timeout(120)
def test_a_rank_given_a_uuid_in_cuda_visible_devices_sees_that_gpu(nvml):
    last = torch.cuda.device_count() - 1  # the last GPU: on a multi-GPU host not NVML's index 0
    probe = T.GpuProbe(torch.device("cuda", last))
    try:
        uuid = nvml.nvmlDeviceGetUUID(probe.handle)
    finally:
        probe.close()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
    r = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["count"] == 1
    assert T._norm(got["torch_uuid"]) in (T._norm(uuid)[4:], T._norm(uuid))
    assert T._norm(got["probe"]) == T._norm(uuid) and got["found_by"] == "uuid"
    assert T._norm(got["visible"]) == T._norm(uuid) and got["visible_how"] == "visible"  # the entry alone finds it too
