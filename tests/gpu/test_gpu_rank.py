"""Issue 28's rank-side fixes on a real GPU (their CPU proofs with fakes: tests/test_gpu_rank_fixes.py).

Adam's ``step`` on the CPU after a resume on CUDA, and a managed step that never synchronises the device
(``torch.cuda.set_sync_debug_mode("error")`` around it); the sync's and the outer optimizer's buffers allocated
once and reused (no growth, no flat copies at the peak); the consensus adopted through one pinned transfer with
no sync; heartbeats that do not wait for a busy stream; per-rank CUDA streams from equal replicas; fp16 through
a GradScaler (unscaled before clipping); DiLoCo's in-place reset keeping Adam's CUDA tensors. One GPU is enough.
"""
from __future__ import annotations

import contextlib
import queue
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rank_fakes import spy_clip_norms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(90)]  # each is one process, a few steps on one GPU: its budget in the check

DEV = torch.device("cuda", 0)
DIM = 1024


@contextlib.contextmanager
def no_device_sync() -> Iterator[None]:
    """Any synchronising CUDA call in the block raises."""
    torch.cuda.synchronize(DEV)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _control(trainer: Any, messages: tuple = (), **kw: Any) -> tuple[Any, list]:
    from flodl_exp.protocol.codec import encode
    from flodl_exp.rank.control import RankControl
    from flodl_exp.rank.inbox import ControlInbox

    sent: list = []
    inbox = ControlInbox(coord_timeout=30.0, rank=0, frames=queue.Queue())
    for m in messages:
        inbox.put(encode(m))
    return RankControl(sent.append, inbox, trainer, rank=0, world_size=2, device=DEV, **kw), sent


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _trainer(optimizer: str = "adam", amp: Any = None, max_grad_norm: Any = 1.0) -> Any:
    from flodl_exp.experiment import Experiment
    from flodl_exp.rank.trainer import RankTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, 8)).to(DEV)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1.0))
    exp = Experiment(model, opt, lr_factor=None, train_data=range(64), eval_data=None, train_step=_mse, eval_fn=None,
                     amp=amp)
    return RankTrainer(exp, device=DEV, max_grad_norm=max_grad_norm)


def _batch() -> Any:
    from flodl_exp.rank.trainer import Batch

    return Batch(data=(torch.randn(32, DIM, device=DEV), torch.randn(32, 8, device=DEV)), data_ms=0.0, ids=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 2: Adam after a resume
def test_adams_step_stays_on_the_cpu_after_a_resume_and_the_step_never_syncs(tmp_path):
    from flodl_exp.checkpoint import optim_path
    from flodl_exp.rank.trainer import EpochState

    saved = _trainer()
    saved.step(_batch()).resolve()
    stem = str(tmp_path / "b")
    torch.save(saved.optimizer.state_dict(), optim_path(stem, 0, primary=True))
    tr = _trainer()
    ctl, _ = _control(tr)
    ctl.resume_stem = stem
    ctl.load_resumed_optimizer()
    states = list(tr.optimizer.state.values())
    assert states and all(st["step"].is_cpu for st in states), "a CUDA step makes Adam call .item() per parameter"
    assert all(st["exp_avg"].is_cuda and st["exp_avg_sq"].is_cuda for st in states)
    batches = [_batch() for _ in range(3)]
    st = EpochState(epoch=0, offset=0, picks=torch.arange(96).numpy(), batch_size=32)
    tr.step(batches[0]).resolve()  # warm-up: lazy CUDA set-up (cuBLAS handles, the pinned loss buffer) may sync once
    with no_device_sync():
        for b in batches[1:]:
            tr.record_step(st, b, tr.step(b))
    tr.end_epoch(st)


# ---------------------------------------------------------------- 6: buffers allocated once
def test_syncs_and_outer_steps_allocate_nothing_after_the_first(master_store, monkeypatch):
    import os

    from flodl_exp.outer import OuterOptimizer, OuterSpec
    from flodl_exp.protocol.messages import SyncNow
    from flodl_exp.rank.backends import CollectiveBackend

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # inherited from a DDP guide: overridden (item 5)
    torch.cuda.set_device(DEV)
    spec = OuterSpec("diloco", lr=0.7, mu=0.9)
    tr = _trainer()
    outer = OuterOptimizer(spec)
    base = torch.cuda.memory_allocated(DEV)
    ctl, sent = _control(tr, outer_spec=spec, outer=outer)
    param_bytes = sum(p.numel() * 4 for p in tr.model.parameters())
    assert torch.cuda.memory_allocated(DEV) - base >= 2 * param_bytes, "the outer state is live before any sync"
    b = CollectiveBackend(host="127.0.0.1", store_port=master_store.port, rank=0, world_size=1, device=DEV,
                          backend="nccl", op_timeout_s=60, store_timeout_s=30)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    ctl.collective = b
    b.prepare(tr.model)
    growth, peaks = [], []
    for k in range(4):
        tr.step(_batch())
        tr.steps_since_avg = 2
        torch.cuda.synchronize(DEV)
        before = torch.cuda.memory_allocated(DEV)
        torch.cuda.reset_peak_memory_stats(DEV)
        ctl.handle(SyncNow(version=k, divergence=True))  # the sync, the outer step, DiLoCo's reset
        torch.cuda.synchronize(DEV)
        growth.append(torch.cuda.memory_allocated(DEV) - before)
        peaks.append(torch.cuda.max_memory_allocated(DEV) - before)
    assert growth == [0, 0, 0, 0], "the sync's and the outer step's buffers are reused"
    assert max(peaks) < param_bytes // 4, f"a parameter-sized temporary at the sync's peak: {peaks} vs {param_bytes}"
    assert outer.momentum_norm() > 0 and len([m for m in sent if type(m).__name__ == "SyncAck"]) == 4
    b.close()


# ---------------------------------------------------------------- 11: the consensus in one transfer; heartbeats
def test_the_consensus_is_adopted_through_one_pinned_transfer_without_a_sync():
    from flodl_exp.protocol.messages import Update
    from flodl_exp.rank.backends import CoordinatorBackend

    tr = _trainer()
    want = [torch.randn(p.shape) for p in tr.model.parameters()]
    be = CoordinatorBackend()
    msg = Update(n=1, tensors={f"p{i}": t for i, t in enumerate(want)})
    be.adopt_update(tr.model, msg, None)  # first: allocates the pinned buffer
    assert be._inbound is not None and be._inbound.is_pinned()
    want = [t + 1.0 for t in want]
    msg = Update(n=1, tensors={f"p{i}": t for i, t in enumerate(want)})
    torch.cuda.synchronize(DEV)
    with no_device_sync():  # one non_blocking transfer from the pinned buffer (an event wait is no stream sync)
        be.adopt_update(tr.model, msg, None)
    assert all(torch.equal(p.detach().cpu(), w) for p, w in zip(tr.model.parameters(), want))


def test_a_heartbeat_does_not_wait_for_a_busy_stream():
    from flodl_exp.protocol.messages import CoordHeartbeat
    from flodl_exp.rank.trainer import PendingStep

    ctl, _ = _control(SimpleNamespace(model=None, optimizer=None), messages=(CoordHeartbeat(),))
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(5e9))  # seconds of GPU cycles ahead of the step's end event
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    loss = torch.zeros((), device=DEV)
    ctl.unreported = deque([(PendingStep(loss=loss, host_ms=0.0, start=start, end=end), 0.0, 0, 0.1)])
    ctl.drain()
    assert not end.query() and len(ctl.unreported) == 1, "the heartbeat waited for the device"
    torch.cuda.synchronize(DEV)


# ---------------------------------------------------------------- 9: a CUDA stream per rank
def test_each_rank_draws_its_own_cuda_stream_from_equal_replicas():
    from flodl_exp.experiment import build_experiment

    exp_cfg = {
        "name": "t", "model": {"_target_": "flodl_exp.zoo.digits.MLP", "hidden": 16},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}, "scheduler": None,
        "train_data": {"_target_": "flodl_exp.zoo.digits.DigitsDataset", "split": "train"}, "eval_data": None,
        "train_step": "flodl_exp.zoo.digits.train_step", "eval_fn": None, "batch_size": 32, "epochs": 1,
    }
    draws, params = [], []
    for rank in (0, 1):
        exp = build_experiment(exp_cfg, world_size=2, device=DEV, seed=7, rank=rank)
        draws.append(torch.rand(16, device=DEV).cpu())
        params.append([p.detach().cpu() for p in exp.model.parameters()])
    assert not torch.equal(draws[0], draws[1]) and all(torch.equal(a, b) for a, b in zip(*params))


# ---------------------------------------------------------------- 10: fp16 on CUDA; DiLoCo's reset
def test_an_fp16_step_goes_through_the_scaler_and_clips_unscaled_gradients(monkeypatch):
    seen = spy_clip_norms(monkeypatch)
    tr = _trainer("sgd", amp="fp16", max_grad_norm=1e9)
    assert tr.scaler is not None and tr.scaler.is_enabled()
    batch = _batch()
    ref = _trainer("sgd")
    with torch.autocast("cuda", dtype=torch.float16):
        _mse(ref.model, batch.data).backward()
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.model.parameters()
                                                       if p.grad is not None])))
    tr.step(batch).resolve()
    assert len(seen) == 1 and seen[0] == pytest.approx(want, rel=1e-2), (seen, want)


def test_dilocos_reset_keeps_adams_cuda_tensors():
    tr = _trainer()
    tr.step(_batch()).resolve()
    ids = {id(v) for st in tr.optimizer.state.values() for v in st.values()}
    tr.reset_optimizer_state()
    after = [v for st in tr.optimizer.state.values() for v in st.values()]
    assert {id(v) for v in after} == ids and all(float(v.abs().sum()) == 0.0 for v in after)
    assert all(v.is_cuda for st in tr.optimizer.state.values() for k, v in st.items() if k != "step")
