"""Issue 28's rank-side GPU fixes, proven on CPU with fakes (tests/gpu/test_gpu_rank.py runs them on a device).

1 a torch older than the floor is refused in one line at start-up, and the abort path says so instead of
  swallowing the missing ``_abort_process_group``; 2 a resumed optimizer's state is loaded on the host, so
  Adam's ``step`` stays a CPU tensor; 5 an inherited ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` is overridden;
  6 the outer state exists before the first sync and syncs reuse their buffers; 9 each rank draws its own
  random stream from equal replicas; 10 fp16 autocast steps through a GradScaler (unscaled before clipping),
  DiLoCo resets Adam in place; 11 heartbeats do not drain the device, the consensus comes in through one
  staging buffer, a regroup re-syncs the outer state, NCCL's interface follows Gloo's, ``batch_to`` is gone.
"""
from __future__ import annotations

import copy
import logging
import queue
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rank_fakes import DIGITS_MLP, spy_clip_norms

from flodl_exp import experiment as experiment_mod
from flodl_exp.experiment import Experiment, build_experiment, rank_seed
from flodl_exp.outer import OuterOptimizer, OuterSpec
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.messages import CoordHeartbeat, EvalResult, ExecuteEval, Regroup, SyncNow
from flodl_exp.rank import backends
from flodl_exp.rank.backends import CollectiveBackend, CoordinatorBackend, nccl_environment
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.inbox import ControlInbox
from flodl_exp.rank.trainer import RankTrainer
from flodl_exp.torch_version import check_torch_version

SLOWMO = OuterSpec("slowmo", lr=1.0, mu=0.9)
EXP = DIGITS_MLP


def _control(trainer: Any, *, device: str = "cpu", messages: tuple = (), **kw: Any) -> tuple[RankControl, list]:
    sent: list = []
    inbox = ControlInbox(coord_timeout=30.0, rank=0, frames=queue.Queue())
    for m in messages:
        inbox.put(encode(m))
    return RankControl(sent.append, inbox, trainer, rank=0, world_size=2, device=torch.device(device), **kw), sent


# ---------------------------------------------------------------- 1: the torch floor
def test_a_torch_older_than_the_floor_is_named_in_one_line():
    line = check_torch_version("2.5.1+cu121")
    assert line is not None and "\n" not in line and "torch 2.5.1+cu121" in line and "torch>=2.6" in line
    assert check_torch_version("2.4.0") is not None
    for ok in ("2.6.0", "2.6.0a0+git1234", "2.10.1", "2.13.0+cpu", "3.0.0", "custom-build"):
        assert check_torch_version(ok) is None, ok


def test_a_rank_refuses_to_start_on_an_old_torch(monkeypatch):
    from flodl_exp.rank.worker import RankWorker

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(RuntimeError, match=r"torch 2\.5\.1 is installed but flodl_exp needs torch>=2\.6"):
        RankWorker(None, 0, 0, {})  # type: ignore[arg-type]  # refused before it reads its spec


def test_the_launcher_refuses_an_old_torch_before_any_job_starts(monkeypatch, tmp_path):
    """The installed distribution's version, read without importing torch: one line, nothing submitted."""
    import importlib.metadata as md

    from flodl_exp.config import ConfigError
    from flodl_exp.jobs import launcher

    from conftest import compose

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "2.5.1" if name == "torch" else real(name))
    monkeypatch.setattr("flodl_exp.jobs.executor.make_executor", lambda *a, **k: pytest.fail("a job was submitted"))
    with pytest.raises(ConfigError, match=r"^torch 2\.5\.1 is installed but flodl_exp needs torch>=2\.6"):
        launcher.launch(compose([]), root=str(tmp_path))
    assert not (tmp_path / "outputs").exists()


def _nccl_backend(**dist: Any) -> CollectiveBackend:
    b = CollectiveBackend.__new__(CollectiveBackend)
    b.group = b.pending = None
    b.dist = SimpleNamespace(is_initialized=lambda: True, **dist)  # type: ignore[assignment]
    return b


def test_an_abort_without_abort_process_group_fails_loudly(monkeypatch):
    """torch 2.4/2.5: the import failed, a warning was logged, and the regroup's init_process_group then failed
    with 'initialized twice' 60 s later."""
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_abort_process_group")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(RuntimeError, match=r"torch 2\.5\.1 is installed .* torch>=2\.6"):
        _nccl_backend().abort()


def test_close_after_a_failed_collective_aborts_instead_of_destroying(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    calls: list[str] = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    b = _nccl_backend(destroy_process_group=lambda: calls.append("destroy"))

    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("NCCL error: remote process exited")

    b.op_timeout_s, b.poll, b._clock = 5.0, lambda: None, lambda: 0.0
    with pytest.raises(RuntimeError, match="NCCL error"):
        b._wait(Failed())
    b.close()
    assert calls == ["abort"], "destroy_process_group would wait on the failed communicator"
    b.close()
    assert calls == ["abort", "destroy"], "a healthy group is destroyed in order"


# ---------------------------------------------------------------- 2: Adam's step stays on the CPU after a resume
def test_a_resumed_optimizer_is_loaded_on_the_host_and_adams_step_stays_there(tmp_path, monkeypatch):
    from flodl_exp.checkpoint import optim_path

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    stem = str(tmp_path / "b")
    torch.save(opt.state_dict(), optim_path(stem, 0, primary=True))
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    seen: list[Any] = []
    real_load = torch.load

    def load(*a: Any, **kw: Any) -> Any:
        seen.append(kw.get("map_location"))
        return real_load(*a, **kw)

    monkeypatch.setattr(torch, "load", load)
    # The rank trains on a GPU: its optimizer state used to be loaded with map_location="cuda:0" (on this
    # CPU-only torch that load fails outright; on a GPU it put every step tensor on the device).
    ctl, _ = _control(SimpleNamespace(optimizer=fresh, model=model), device="cuda:0")
    ctl.resume_stem = stem
    ctl.load_resumed_optimizer()
    assert seen == ["cpu"]
    steps = [st["step"] for st in fresh.state.values()]
    assert len(steps) == 2 and all(s.is_cpu and float(s) == 1.0 for s in steps)


# ---------------------------------------------------------------- 5 and 11: NCCL's environment
def test_an_inherited_async_error_handling_is_overridden_and_said_once():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    notes = nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert len(notes) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in notes[0] and "\n" not in notes[0]
    for before in ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}):
        env = dict(before)
        assert nccl_environment(env) == [] and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_the_nccl_backend_applies_the_environment_before_its_group(monkeypatch, caplog):
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: object())
    monkeypatch.setattr(CollectiveBackend, "_init", lambda self, *a, **kw: seen.update(
        async_eh=backends.os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        ifname=backends.os.environ.get("NCCL_SOCKET_IFNAME")))
    with caplog.at_level(logging.WARNING, logger=backends.log.name):
        CollectiveBackend(host="127.0.0.1", store_port=1, rank=3, world_size=4, device=torch.device("cuda:0"),
                          backend="nccl", op_timeout_s=5, store_timeout_s=5)
    assert seen == {"async_eh": "0", "ifname": "ib0"}
    assert [r.getMessage() for r in caplog.records if "overridden" in r.getMessage()] != []


def test_nccl_takes_gloos_interface_unless_the_user_set_its_own():
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    nccl_environment(env)
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"
    env = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth1"}
    nccl_environment(env)
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"
    env = {}
    nccl_environment(env)
    assert "NCCL_SOCKET_IFNAME" not in env


# ---------------------------------------------------------------- 6: the outer state up front, reused buffers
def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def test_the_outer_state_exists_before_the_first_sync():
    model = _linear()
    outer = OuterOptimizer(SLOWMO)
    _control(SimpleNamespace(model=model, optimizer=None), outer_spec=SLOWMO, outer=outer)
    n = sum(p.numel() for p in model.parameters())
    state = outer.state_buffer
    assert state is not None and state.numel() == 2 * n + 1 and state.dtype == torch.float32
    assert outer.prev is None, "allocated, not seeded: the first window still seeds it"


def test_the_group_allocates_the_syncs_buffers_when_it_forms():
    from flodl_exp.protocol.messages import FormGroup

    prepared: list[Any] = []
    collective = SimpleNamespace(prepare=prepared.append)
    model = _linear()
    ctl, _ = _control(SimpleNamespace(model=model, optimizer=None), join_group=lambda m, poll: collective)
    ctl.handle(FormGroup(backend="gloo", reason="test"))
    assert prepared == [model]


def test_syncs_and_outer_steps_reuse_their_buffers(master_store):
    model = _linear()
    model(torch.randn(8, 4))
    outer = OuterOptimizer(SLOWMO)
    b = CollectiveBackend(host="127.0.0.1", store_port=master_store.port, rank=0, world_size=1, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=30, store_timeout_s=10)
    ctl, sent = _control(SimpleNamespace(model=model, optimizer=None, steps_since_avg=3, step_count=0),
                         outer_spec=SLOWMO, outer=outer)
    ctl.collective = b
    b.prepare(model)
    assert b._flat is not None and b._saved is not None and outer.state_buffer is not None
    ptrs = (b._flat.data_ptr(), b._saved.data_ptr(), outer.state_buffer.data_ptr())
    made: list[int] = []
    real_cat, real_clone = torch.cat, torch.Tensor.clone

    def cat(*a: Any, **kw: Any) -> Any:
        made.append(1)
        return real_cat(*a, **kw)

    def clone(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
        made.append(1)
        return real_clone(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "cat", cat)
        mp.setattr(torch.Tensor, "clone", clone)
        for _ in range(3):
            ctl.trainer.steps_since_avg = 3
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
            ctl.handle(SyncNow(version=0, divergence=True))
    assert made == [], "no flat copy of the parameters per sync (torch.cat / clone)"
    assert (b._flat.data_ptr(), b._saved.data_ptr(), outer.state_buffer.data_ptr()) == ptrs
    assert outer._scratch is None, "the outer step's scratch is the sync's all-reduce buffer"
    assert outer.prev is not None and outer.momentum_norm() > 0
    assert len([m for m in sent if type(m).__name__ == "SyncAck"]) == 3
    b.close()


def test_a_failed_collective_restores_the_replica_from_the_syncs_buffer(master_store):
    model = _linear()
    b = CollectiveBackend(host="127.0.0.1", store_port=master_store.port, rank=0, world_size=1, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=30, store_timeout_s=10)
    before = [t.detach().clone() for t in model.state_dict().values()]
    b.sync(model, 2, 1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    b.restore(model)
    assert all(torch.equal(a, c) for a, c in zip(before, model.state_dict().values()))
    b.close()


# ---------------------------------------------------------------- 9: a random stream per rank
def test_each_rank_draws_its_own_stream_from_equal_replicas():
    draws, params = [], []
    for rank in (0, 1):
        exp = build_experiment(EXP, world_size=2, device=torch.device("cpu"), seed=7, rank=rank)
        draws.append(torch.rand(8))
        params.append([p.detach().clone() for p in exp.model.parameters()])
    assert not torch.equal(draws[0], draws[1]), "dropout masks would coincide across replicas"
    assert all(torch.equal(a, b) for a, b in zip(*params)), "the replicas still start equal"
    build_experiment(EXP, world_size=2, device=torch.device("cpu"), seed=7, rank=1)
    assert torch.equal(torch.rand(8), draws[1]), "the same rank draws the same stream on every start"
    assert rank_seed(7, 0) != rank_seed(7, 1) != rank_seed(8, 1)


# ---------------------------------------------------------------- 10: fp16 through a GradScaler; DiLoCo's reset
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _tiny_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).float().sum() * 1e-9  # gradients below fp16's smallest subnormal (6e-8)


def _amp_trainer(amp: Any, max_grad_norm: Any = None) -> RankTrainer:
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    exp = Experiment(model, opt, lr_factor=None, train_data=range(8), eval_data=None, train_step=_tiny_loss,
                     eval_fn=None, amp=amp)
    return RankTrainer(exp, device=torch.device("cpu"), max_grad_norm=max_grad_norm)


def _batch() -> Any:
    from flodl_exp.rank.trainer import Batch

    torch.manual_seed(1)
    return Batch(data=torch.randn(8, 4), data_ms=0.0, ids=None)  # type: ignore[arg-type]


def test_an_fp16_step_scales_its_loss_so_small_gradients_do_not_underflow():
    tr = _amp_trainer("fp16")
    assert tr.scaler is not None and tr.scaler.is_enabled()
    assert isinstance(tr.model, _Tiny)
    before = tr.model.lin.weight.detach().clone()
    tr.step(_batch()).resolve()
    moved = float((tr.model.lin.weight.detach() - before).abs().max())
    assert moved > 0, "an unscaled fp16 backward underflows to zero gradients"
    # the same step unscaled, by hand: the gradient is exactly zero
    model = _Tiny()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _tiny_loss(model, _batch().data)
    loss.backward()
    assert model.lin.weight.grad is not None and float(model.lin.weight.grad.abs().max()) == 0.0


def test_clipping_sees_unscaled_gradients(monkeypatch):
    seen = spy_clip_norms(monkeypatch)
    tr = _amp_trainer("fp16", max_grad_norm=1e9)
    tr.step(_batch()).resolve()
    ref = _Tiny()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _tiny_loss(ref, _batch().data)
    (loss * 65536.0).backward()  # the scaler's initial scale, applied and taken off by hand
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad / 65536.0)
                                                       for p in ref.parameters() if p.grad is not None])))
    assert len(seen) == 1 and seen[0] == pytest.approx(want, rel=1e-3), (seen, want)


def test_bf16_and_float32_need_no_scaler():
    assert _amp_trainer("bf16").scaler is None and _amp_trainer("bf16").amp_dtype == torch.bfloat16
    tr = _amp_trainer(None)
    assert tr.scaler is None and tr.amp_dtype is None
    with pytest.raises(Exception, match="experiment.amp"):
        build_experiment({**EXP, "amp": "fp8"}, world_size=1, device=torch.device("cpu"), seed=0)


def test_the_probe_puts_the_scaler_back():
    tr = _amp_trainer("fp16")
    tr.step(_batch()).resolve()
    assert tr.scaler is not None
    before = tr.scaler.state_dict()
    tr.total_picks = 64
    tr.pipeline = SimpleNamespace(open=lambda e, picks: SimpleNamespace(next=lambda *a: SimpleNamespace(
        data=torch.randn(8, 4), data_ms=0.0, ids=None, wait_ms=0.0)), close=lambda: None)
    tr.batch_size = 8
    tr.probe(3)
    assert tr.scaler.state_dict() == before, "the probe's steps leave no trace in the loss scale"


def test_dilocos_reset_zeroes_adam_in_place_and_matches_a_fresh_adam():
    model = _Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    for _ in range(3):
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    exp = Experiment(model, opt, lr_factor=None, train_data=range(8), eval_data=None, train_step=None, eval_fn=None)
    tr = RankTrainer(exp, device=torch.device("cpu"))
    before = {id(p): {k: id(v) for k, v in st.items()} for p, st in opt.state.items()}
    twin = copy.deepcopy((model, opt))
    tr.reset_optimizer_state()
    assert {id(p): {k: id(v) for k, v in st.items()} for p, st in opt.state.items()} == before, "same keys, same tensors"
    assert all(float(v.abs().sum()) == 0.0 for st in opt.state.values() for v in st.values())
    twin_model, twin_opt = twin
    twin_opt.state.clear()  # what DiLoCo used to do
    g = torch.randn(4, 4)
    for m, o in ((model, opt), (twin_model, twin_opt)):
        o.zero_grad()
        m(g).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_an_optimizer_whose_fresh_state_is_not_zero_is_still_cleared():
    model = _Tiny()
    opt = torch.optim.Rprop(model.parameters(), lr=0.01)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    exp = Experiment(model, opt, lr_factor=None, train_data=range(8), eval_data=None, train_step=None, eval_fn=None)
    RankTrainer(exp, device=torch.device("cpu")).reset_optimizer_state()
    assert len(opt.state) == 0, "Rprop's step sizes zeroed would freeze it"


# ---------------------------------------------------------------- 11: heartbeats, inbound staging, regroup, batch_to
class _Unfinished:
    """A trained step whose device work has not finished: resolving it waits for the device."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def ready(self) -> bool:
        return False

    def resolve(self) -> tuple[float, float]:
        self.log.append("waited")
        return 0.5, 3.0


def test_a_heartbeat_does_not_drain_the_device_but_an_eval_does():
    log: list[str] = []
    def evaluate() -> dict[str, float]:
        log.append("eval")
        return {}

    trainer = SimpleNamespace(model=None, optimizer=None, evaluate=evaluate)
    ctl, sent = _control(trainer, messages=(CoordHeartbeat(), CoordHeartbeat()))
    ctl.unreported = deque([(_Unfinished(log), 0.0, 0, 0.1)])  # type: ignore[list-item]
    ctl.drain()
    assert log == [], "the coordinator's 1 Hz heartbeat used to wait for the GPU"
    ctl.inbox.put(encode(ExecuteEval(epoch=0)))
    ctl.drain()
    assert log == ["waited", "eval"] and isinstance(sent[-1], EvalResult)


def test_a_consensus_comes_in_through_one_reused_staging_buffer():
    be = CoordinatorBackend()
    params = [torch.randn(3, 2).to(torch.bfloat16), torch.randn(5)]
    bufs = [torch.randn(4)]
    ps, bs = be.inbound(params, bufs, torch.device("cpu"), pin=False)
    assert [t.dtype for t in ps + bs] == [torch.float32] * 3 and [t.shape for t in ps] == [(3, 2), (5,)]
    assert torch.equal(ps[0], params[0].float()) and torch.equal(ps[1], params[1]) and torch.equal(bs[0], bufs[0])
    assert len({t.untyped_storage().data_ptr() for t in ps + bs}) == 1, "one flat copy, one transfer"
    host = be._inbound
    assert host is not None
    be.inbound(params, bufs, torch.device("cpu"), pin=False)
    assert be._inbound is host, "the staging buffer is reused"


def test_a_cpu_replica_adopts_the_consensus_as_before():
    model = _linear()
    want = [torch.full_like(p, 0.5) for p in model.parameters()]
    bufs = [torch.full_like(b, 2.0) for b in model.buffers() if b.is_floating_point()]
    from flodl_exp.protocol.messages import Update

    tensors = {f"p{i}": t for i, t in enumerate(want)} | {f"b{j}": t for j, t in enumerate(bufs)}
    CoordinatorBackend().adopt_update(model, Update(n=1, tensors=tensors), None)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want))


def test_a_regroup_re_syncs_the_outer_state_from_the_groups_rank_0():
    """A collective that failed on one survivor and not the other leaves their replicated outer states apart."""
    model = torch.nn.Linear(1, 2)
    root = OuterOptimizer(SLOWMO)
    root.step([torch.ones(2, 1), torch.ones(2)])
    root.step([torch.zeros(2, 1), torch.zeros(2)])  # rank 0 stepped once more than this survivor
    outer = OuterOptimizer(SLOWMO)
    ctl, _ = _control(SimpleNamespace(model=model, optimizer=None), outer_spec=SLOWMO, outer=outer)
    outer.step([torch.ones(2, 1), torch.ones(2)])
    got: list[int] = []

    def broadcast_(t: torch.Tensor, src: int = 0) -> None:
        got.append(src)
        assert root.state_buffer is not None
        t.copy_(root.state_buffer)

    ctl.collective = SimpleNamespace(rebuild=lambda *a: None, broadcast_=broadcast_, rank=1)  # type: ignore[assignment]
    ctl.handle(Regroup(generation=1, new_rank=1, world_size=2, ranks=[0, 2], session="s1"))
    assert got == [0] and outer.prev is not None and root.prev is not None
    assert all(torch.equal(a, b) for a, b in zip(outer.prev, root.prev))
    assert outer.momentum_norm() == pytest.approx(root.momentum_norm()) and root.momentum_norm() > 0


def test_an_unseeded_root_unseeds_the_survivors():
    outer = OuterOptimizer(SLOWMO)
    ctl, _ = _control(SimpleNamespace(model=torch.nn.Linear(1, 2), optimizer=None), outer_spec=SLOWMO, outer=outer)
    outer.step([torch.ones(2, 1), torch.ones(2)])
    ctl.collective = SimpleNamespace(rebuild=lambda *a: None, broadcast_=lambda t, src=0: t.zero_(), rank=1)  # type: ignore[assignment]
    ctl.handle(Regroup(generation=1, new_rank=1, world_size=2, ranks=[0, 2], session="s1"))
    assert outer.prev is None and outer.state_dict()["prev"] == []


@pytest.mark.parametrize("new_rank", [0, 1])
def test_a_failed_re_sync_keeps_the_rank_alive_and_no_half_received_state(new_rank):
    """A member that dies between the group's forming and the broadcast: the regroup handler does not end the rank
    (the next collective fails and regroups again); a receiver forgets its state, the sender keeps its own."""
    outer = OuterOptimizer(SLOWMO)
    ctl, _ = _control(SimpleNamespace(model=torch.nn.Linear(1, 2), optimizer=None), outer_spec=SLOWMO, outer=outer)
    outer.step([torch.ones(2, 1), torch.ones(2)])
    aborted: list[int] = []

    def broadcast_(t: torch.Tensor, src: int = 0) -> None:
        t[:2] = 7.0  # half received
        raise RuntimeError("Connection closed by peer")

    ctl.collective = SimpleNamespace(rebuild=lambda *a: None, broadcast_=broadcast_, rank=new_rank,  # type: ignore[assignment]
                                     abort=lambda: aborted.append(1))
    ctl.handle(Regroup(generation=1, new_rank=new_rank, world_size=2, ranks=[0, 2], session="s1"))
    assert aborted == [1] and (outer.prev is None) == (new_rank != 0)


def test_batch_to_is_gone():
    """It copied non_blocking in any direction (a device->pageable copy read before it landed) and nothing used it."""
    assert not hasattr(experiment_mod, "batch_to")
