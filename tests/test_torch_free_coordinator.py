"""The coordinator of the collective (nccl) backend never imports torch: its imports, a control frame's round
trip and the run's prediction (simulate) run in a fresh interpreter where importing torch raises. Torch's
import was about 2 s of CPU on the cores the ranks start on (docs/reference/measurements.md, start-up); the
collective's TCPStore is task 0's (jobs/collective_store.py). Tensors still work: torch loads with the first."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT

_BLOCK_TORCH = textwrap.dedent("""
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported on a torch-free path")
            return None

    sys.meta_path.insert(0, _NoTorch())
""")


def _run(body: str) -> subprocess.CompletedProcess:
    code = _BLOCK_TORCH + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_coordinator_imports_and_a_control_frame_round_trip_need_no_torch():
    r = _run("""
        import flodl_exp.control.main, flodl_exp.control.coordinator, flodl_exp.control.server
        import flodl_exp.jobs.collective_store, flodl_exp.checkpoint
        from flodl_exp import protocol, wire
        msg = wire.decode(wire.encode(protocol.encode(protocol.SyncNow(version=3, divergence=True))), 1 << 20)
        assert protocol.decode(msg) == protocol.SyncNow(version=3, divergence=True)
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "False"


def test_an_nccl_runs_prediction_needs_no_torch():
    r = _run("""
        from flodl_exp.simulate.from_run import base_config, predict
        out = predict(base_config(), "nccl_cadence")
        assert out["predicted/samples_per_s"] > 0, out
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "False"


def test_a_frame_with_tensors_loads_torch_when_it_comes():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from flodl_exp import wire
        frame = bytes.fromhex(sys.argv[1])
        assert "torch" not in sys.modules
        msg = wire.decode(frame, 1 << 20)
        print(msg.tensors["p0"].tolist())
    """), _tensor_frame().hex()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[1.5, -2.0]"


def _tensor_frame() -> bytes:
    import torch

    from flodl_exp import wire

    return wire.encode(wire.Message("snapshot", {"n": 1}, {"p0": torch.tensor([1.5, -2.0])}))
