"""The coordinator of the collective (nccl) backend never imports torch: its imports, a control frame's round
trip and the run's prediction (simulate) run in a fresh interpreter where importing torch raises. Torch's
import was about 2 s of CPU on the cores the ranks start on (docs/reference/measurements.md, start-up); the
collective's TCPStore is task 0's (jobs/collective_store.py). Tensors still work: torch loads with the first.
One interpreter for all of it (each costs seconds of start-up in make test-fast)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT

_SCRIPT = textwrap.dedent("""
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported on a torch-free path")
            return None

    blocker = _NoTorch()
    sys.meta_path.insert(0, blocker)

    import flodl_exp.coordinator.main, flodl_exp.coordinator.coordinator, flodl_exp.coordinator.server
    import flodl_exp.jobs.collective_store, flodl_exp.checkpoint
    from flodl_exp.protocol import codec
    from flodl_exp.protocol import messages as protocol
    from flodl_exp.protocol import wire
    msg = wire.decode(wire.encode(codec.encode(protocol.SyncNow(version=3, divergence=True))), 1 << 20)
    assert codec.decode(msg) == protocol.SyncNow(version=3, divergence=True)
    print("control frame", "torch" in sys.modules)

    from flodl_exp.simulate.from_run import base_config, predict
    out = predict(base_config(), "nccl_cadence")
    assert out["predicted/samples_per_s"] > 0, out
    print("nccl prediction", "torch" in sys.modules)

    sys.meta_path.remove(blocker)  # a frame with tensors (a cpu-backend snapshot) loads torch as it comes
    frame = bytes.fromhex(sys.argv[1])
    print("tensor frame", wire.decode(frame, 1 << 20).tensors["p0"].tolist())
""")


def _tensor_frame() -> bytes:
    import torch

    from flodl_exp.protocol import wire

    return wire.encode(wire.Message("snapshot", {"n": 1}, {"p0": torch.tensor([1.5, -2.0])}))


def test_the_nccl_coordinator_and_its_prediction_need_no_torch_and_a_tensor_loads_it():
    r = subprocess.run([sys.executable, "-c", _SCRIPT, _tensor_frame().hex()], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["control frame False", "nccl prediction False", "tensor frame [1.5, -2.0]"]
