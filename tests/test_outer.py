"""Outer optimizers (algorithms.md 11.1): each update rule by hand on small tensors, on both backends."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from flodl_exp.bundle_meta import BundleMeta, Resume
from flodl_exp.core.cycle import AveragingCycle, CycleSettings
from flodl_exp.core.epoch_metrics import EpochAccumulator
from flodl_exp.outer import OuterOptimizer, OuterSpec
from flodl_exp.policy.guards import build_guard
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import Snapshot, Update
from flodl_exp.torch_averager import TorchAverager

from conftest import run_spawned

SLOWMO = OuterSpec("slowmo", lr=1.0, mu=0.9)
DILOCO = OuterSpec("diloco", lr=0.7, mu=0.9)


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _windows() -> list[list[torch.Tensor]]:
    """Four windows' consensus frames of a two-parameter model."""
    return [[_t(1.0, 2.0), _t(0.5)], [_t(0.8, 1.9), _t(0.4)], [_t(0.7, 1.5), _t(0.45)], [_t(0.2, 1.4), _t(0.1)]]


def _by_hand(kind: str, lr: float, mu: float, frames: list[list[torch.Tensor]]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """The rules written out: first window seeds prev = consensus and v = 0; then g = prev - consensus,
    v = mu v + g, slowmo new = prev - lr v, diloco new = prev - lr (mu v + g)."""
    prev = [t.clone() for t in frames[0]]
    v = [torch.zeros_like(t) for t in frames[0]]
    news, moms = [[t.clone() for t in frames[0]]], [[t.clone() for t in v]]
    for cons in frames[1:]:
        new = []
        for i, c in enumerate(cons):
            g = prev[i] - c
            v[i] = mu * v[i] + g
            new.append(prev[i] - lr * (v[i] if kind == "slowmo" else mu * v[i] + g))
        prev = new
        news.append([t.clone() for t in new])
        moms.append([t.clone() for t in v])
    return news, moms


@pytest.mark.parametrize("spec", [SLOWMO, DILOCO], ids=["slowmo", "diloco"])
def test_each_rule_matches_the_hand_computation(spec):
    frames = _windows()
    want, want_v = _by_hand(spec.kind, spec.lr, spec.mu, frames)
    opt = OuterOptimizer(spec)
    for k, cons in enumerate(frames):
        got, step = opt.step(cons)
        assert step is not None and step.seeded == (k == 0)
        for a, b in zip(got, want[k]):
            assert torch.allclose(a, b, atol=1e-6), (k, a, b)
        for a, b in zip(opt.momentum or [], want_v[k]):
            assert torch.allclose(a, b, atol=1e-6)
        if k == 0:  # the first window is a no-op that seeds the momentum at zero
            assert all(torch.equal(a, c) for a, c in zip(got, cons)) and step.momentum_norm == 0.0
        else:
            moved = sum(float((a - b).pow(2).sum()) for a, b in zip(want[k], want[k - 1])) ** 0.5
            assert step.step_norm == pytest.approx(moved, rel=1e-5)


def test_slowmo_momentum_accumulates_across_windows():
    """A steady pull (the consensus 1 below the global each window) grows v toward 1/(1-mu) times it."""
    opt = OuterOptimizer(OuterSpec("slowmo", lr=0.1, mu=0.5))
    x = _t(10.0)
    opt.step([x])
    norms = []
    for _ in range(12):
        assert opt.prev is not None
        prev = opt.prev[0].clone()
        _, step = opt.step([prev - 1.0])
        assert step is not None
        norms.append(step.momentum_norm)
    assert norms == sorted(norms) and norms[0] == pytest.approx(1.0) and norms[-1] == pytest.approx(2.0, abs=1e-3)


def test_avg_is_the_identity_and_keeps_no_state():
    opt = OuterOptimizer(OuterSpec())
    cons = [_t(1.0, 2.0)]
    got, step = opt.step(cons)
    assert got[0] is cons[0] and step is None and opt.prev is None and not OuterSpec().stateful


def test_a_parameter_count_change_restarts_the_momentum():
    opt = OuterOptimizer(SLOWMO)
    for cons in _windows()[:3]:
        opt.step(cons)
    assert opt.momentum_norm() > 0
    grown = [_t(1.0, 2.0), _t(0.5), _t(3.0)]
    got, step = opt.step(grown)
    assert step is not None and step.seeded and opt.momentum_norm() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(got, grown))


def test_the_step_keeps_the_parameters_dtype():
    opt = OuterOptimizer(DILOCO)
    for cons in _windows():
        got, _ = opt.step([t.to(torch.bfloat16) for t in cons])
        assert all(t.dtype == torch.bfloat16 for t in got)
    assert all(t.dtype == torch.float32 for t in opt.momentum or [])


def test_a_sidecar_round_trip_continues_exactly():
    """Saved after two windows and restored into a fresh optimizer, the next windows match bit for bit."""
    frames = _windows()
    whole = OuterOptimizer(DILOCO)
    outs = [whole.step(c)[0] for c in frames]
    first = OuterOptimizer(DILOCO)
    for c in frames[:2]:
        first.step(c)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = OuterOptimizer(DILOCO)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for k in (2, 3):
        got, step = resumed.step(frames[k])
        assert step is not None and not step.seeded
        assert all(torch.equal(a, b) for a, b in zip(got, outs[k]))
    assert resumed.momentum is not None and whole.momentum is not None
    assert all(torch.equal(a, b) for a, b in zip(resumed.momentum, whole.momentum))


# ---------------------------------------------------------------- cpu backend: once at the coordinator
class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send(self, r: int, msg: object) -> None:
        self.sent.append((r, msg))

    def broadcast(self, msg: object) -> None:
        self.sent.append((-1, msg))

    def sharing_tensors(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _cycle(spec: OuterSpec) -> tuple[AveragingCycle, _Outbox]:
    out = _Outbox()
    c = AveragingCycle(settings=CycleSettings(world_size=2, mode=Mode.parse("cadence", "cpu"), gamma=1.0, alpha=None,
                                              progressive=True, outer=spec),
                       elche=None, guard=build_guard("none"), meta=None, outbox=out,  # type: ignore[arg-type]
                       clock=lambda: 0.0, averager=TorchAverager(spec))
    return c, out


def _reduce(c: AveragingCycle, out: _Outbox, frames: list[list[torch.Tensor]], buf: list[torch.Tensor], n: tuple[int, int]):
    c.trigger([0, 1])
    for r in (0, 1):
        tensors = {f"p{i}": t for i, t in enumerate(frames[r])}
        tensors["b0"] = buf[r]
        c.on_snapshot(r, Snapshot(n=n[r], tensors=tensors))
    out.sent.clear()
    res = c.try_finish(lambda r: True)
    ups = [m for _, m in out.sent if isinstance(m, Update)]
    return res, ups


def test_the_coordinator_steps_the_parameter_frame_and_passes_buffers_through():
    c, out = _cycle(SLOWMO)
    ref = OuterOptimizer(SLOWMO)
    rng = torch.Generator().manual_seed(3)
    for k in range(4):
        frames = [[torch.randn(3, generator=rng), torch.randn(2, generator=rng)] for _ in range(2)]
        bufs = [torch.randn(2, generator=rng) for _ in range(2)]
        res, ups = _reduce(c, out, frames, bufs, (3, 1))
        cons = [(3 * a + 1 * b) / 4 for a, b in zip(*frames)]
        want, _ = ref.step(cons)
        assert len(ups) == 2 and ups[0].tensors is ups[1].tensors  # one frame for every rank
        for i, w in enumerate(want):
            assert torch.allclose(ups[0].tensors[f"p{i}"], w, atol=1e-6)
        assert torch.allclose(ups[0].tensors["b0"], (bufs[0] + bufs[1]) / 2)  # buffers: mean of movers, no outer step
        assert res.outer is not None and res.outer.seeded == (k == 0)
        if k:
            assert res.outer.momentum_norm == pytest.approx(ref.momentum_norm(), rel=1e-6) and res.outer.step_norm > 0


def test_a_round_nobody_moved_in_passes_through_unstepped():
    c, out = _cycle(SLOWMO)
    frames = [[_t(1.0), _t(2.0)], [_t(3.0), _t(4.0)]]
    _reduce(c, out, frames, [_t(0.0), _t(0.0)], (1, 1))
    outer = cast(TorchAverager, c.averager).outer
    assert outer.prev is not None
    before = [t.clone() for t in outer.prev]
    res, ups = _reduce(c, out, frames, [_t(0.0), _t(0.0)], (0, 0))
    assert all(u.skip for u in ups) and res.outer is None
    assert all(torch.equal(a, b) for a, b in zip(before, outer.prev))


def test_the_epoch_records_the_mean_step_and_the_last_momentum():
    from flodl_exp.outer import OuterStep

    acc = EpochAccumulator(0, 2, 0.0)
    acc.add_sync(5.0, 0.1, 0, OuterStep(1.0, 3.0, False))
    acc.add_sync(5.0, 0.1, 0, OuterStep(2.0, 4.0, False))
    m = acc.summary(1.0)
    assert m["outer/step_norm"] == pytest.approx(1.5) and m["outer/momentum_norm"] == 4.0
    assert "outer/step_norm" not in EpochAccumulator(0, 2, 0.0).summary(1.0)  # outer=avg records none


# ---------------------------------------------------------------- the rank's side
def test_diloco_resets_the_inner_optimizer_after_each_adoption_and_slowmo_does_not():
    from rank_fakes import rank_control

    from flodl_exp.experiment import Experiment
    from flodl_exp.rank.trainer import RankTrainer

    for spec, cleared in ((DILOCO, True), (SLOWMO, False)):
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        exp = Experiment(model, opt, lr_factor=None, train_data=range(8), eval_data=None, train_step=None, eval_fn=None)
        trainer = RankTrainer(exp, device=torch.device("cpu"))  # the real reset of the inner optimizer's state
        ctl, _ = rank_control(trainer, outer_spec=spec, cpu=SimpleNamespace(adopt_update=lambda *a: None))
        ctl.handle(Update(n=2, tensors={"p0": torch.zeros(1, 3), "p1": torch.zeros(1)}))
        # Adam's state is zeroed in place (a fresh Adam's state, same tensors: a compiled step is not recompiled)
        zeroed = all(float(t.abs().sum()) == 0.0 for st in opt.state.values() for t in st.values())
        assert len(opt.state) == 2 and zeroed == cleared, spec.kind
        assert opt.param_groups[0]["lr"] == 0.01  # the schedule's state is not the optimizer's moments


# ---------------------------------------------------------------- nccl backend: replicated on every rank
def _replica(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.rank.backends import CollectiveBackend

    torch.manual_seed(100 + rank)  # different replicas, so each reduce has work to do
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = OuterOptimizer(SLOWMO)
    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60)
    hashes = []
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * (rank + 1))  # local training, different on each rank
        b.sync(model, 2 + rank, 1.0)
        params = list(model.parameters())
        new, _ = opt.step([p.detach() for p in params])
        with torch.no_grad():
            for p, t in zip(params, new):
                p.copy_(t)
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().contiguous().numpy().tobytes())
        hashes.append(h.hexdigest())
    b.close()
    q.put((rank, hashes, opt.momentum_norm()))


@pytest.mark.e2e
def test_the_nccl_path_replicates_the_outer_step_identically(master_store):
    """Two real processes all-reduce over Gloo and step the outer optimizer on their own: equal state hashes
    on both after every reduce, with no collective beyond the reduce."""
    got = {r: (h, m) for r, h, m in run_spawned(_replica, [(0, master_store.port), (1, master_store.port)])[0]}
    assert got[0][0] == got[1][0] and len(set(got[0][0])) == 3
    assert got[0][1] == got[1][1] > 0


# ---------------------------------------------------------------- the bundle sidecar
def _nccl_rank(spec: OuterSpec = SLOWMO, windows: int = 3, reduced: bool = True):
    """A rank of an nccl cohort, as far as the outer optimizer goes: a two-parameter model, its outer state
    stepped over ``windows`` consensus frames, a collective that says whether the last sync averaged.
    Returns the rank's control, what it sent, and the count of inner-optimizer resets."""
    from rank_fakes import rank_control

    model = torch.nn.Linear(1, 2)  # parameters of shape (2, 1) and (2,)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0], [2.0]]))
        model.bias.copy_(torch.tensor([0.5, 0.25]))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    resets: list[int] = []
    trainer = SimpleNamespace(model=model, optimizer=opt, global_step=0, reset_optimizer_state=lambda: resets.append(1))
    w, sent = rank_control(trainer, outer_spec=spec, outer=OuterOptimizer(spec))
    w.collective = SimpleNamespace(reduced=reduced, workspace=None)  # type: ignore[assignment]  # the group formed, as far as the step asks
    assert w.outer is not None
    for cons in _windows()[:windows]:
        w.outer.step([cons[0].reshape(2, 1), cons[1].repeat(2)])
    return w, sent, resets


def test_the_rank_steps_only_after_a_sync_that_averaged_and_diloco_resets_the_inner_optimizer():
    w, _, resets = _nccl_rank(DILOCO, windows=1, reduced=False)
    before = [p.detach().clone() for p in w.trainer.model.parameters()]
    assert w._outer_step() is None and resets == []  # nobody moved: no step, no reset
    assert all(torch.equal(a, b) for a, b in zip(before, w.trainer.model.parameters()))
    w.collective.reduced = True
    ref = OuterOptimizer(DILOCO)
    ref.step([_windows()[0][0].reshape(2, 1), _windows()[0][1].repeat(2)])
    want, _ = ref.step([p.detach().clone() for p in w.trainer.model.parameters()])
    step = w._outer_step()
    assert step is not None and step.step_norm > 0 and resets == [1]
    assert all(torch.allclose(a, b) for a, b in zip(w.trainer.model.parameters(), want))
    assert _nccl_rank(SLOWMO, windows=0)[0]._outer_step() is None, "the seeding window reports no step"


def test_an_nccl_rank_resumes_its_outer_state_from_the_sidecar(tmp_path):
    from flodl_exp import checkpoint as ck

    saved, _, _ = _nccl_rank(SLOWMO)
    stem = str(tmp_path / "b")
    ck.save_rank_pieces(stem, saved.trainer.model, saved.trainer.optimizer, rank=0, primary=True, write_model=True,
                        outer_state=saved.outer.state_dict())
    w, _, _ = _nccl_rank(SLOWMO, windows=0)
    w.resume_from(Resume(stem=stem, meta=BundleMeta(epoch=0, global_step=5, sync_round=0)))
    assert w.trainer.global_step == 5 and w.outer.momentum_norm() == pytest.approx(saved.outer.momentum_norm())
    assert all(torch.equal(a, b) for a, b in zip(w.outer.momentum, saved.outer.momentum))
    assert all(torch.equal(a, b) for a, b in zip(w.outer.prev, saved.outer.prev))

@pytest.mark.parametrize("mode", ["cpu_sync", "nccl_sync"])
def test_a_stateful_outer_optimizer_puts_its_sidecar_in_the_bundle(tmp_path, mode):
    """cpu: the coordinator writes it (the state lives there); nccl: the model's writer does, and the meta lists it."""
    import json

    from control_fakes import Harness

    from flodl_exp import checkpoint as ck
    from flodl_exp.core.lifecycle import Status
    from flodl_exp.protocol.messages import EvalResult, SaveResult

    slowmo: dict[str, Any] = {"outer.kind": "slowmo"}
    h = Harness(tmp_path, mode, world=2, epochs=1, **slowmo)
    holder: Any = None
    if mode == "cpu_sync":  # the coordinator's optimizer has momentum when the final saves go out
        holder = cast(TorchAverager, h.co.core.cycle.averager).outer
        for cons in _windows()[:3]:
            holder.step(cons)
    stem = h.co.core.writer.stem
    evals, saves = h.final_saves()
    if mode == "nccl_sync":  # the rank that writes the model writes its replicated optimizer (RankControl._save)
        w, sent, _ = _nccl_rank()
        holder = w.outer
        w.handle(next(p for _, p in saves if p.model))
        assert isinstance(sent[-1], SaveResult) and sent[-1].error is None
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.status is Status.FINISHED
    meta = json.loads(open(ck.meta_path(stem)).read())
    assert "final.outer.pt" in meta["pieces"] and os.path.exists(ck.outer_path(stem))
    state = ck.load_outer_state(stem)
    assert state["kind"] == "slowmo" and len(state["momentum"]) == 2 and holder.momentum_norm() > 0
    assert holder is not None and holder.momentum is not None
    assert all(torch.equal(a, b) for a, b in zip(state["momentum"], holder.momentum))


def test_resuming_a_stateful_outer_optimizer_without_its_sidecar_is_one_line(tmp_path):
    from omegaconf import OmegaConf

    from flodl_exp import checkpoint as ck
    from flodl_exp.config import Config, ConfigError

    stem = str(tmp_path / "b")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck.save_rank_pieces(stem, model, opt, rank=0, primary=True, write_model=True)
    ck.write_meta(stem, BundleMeta(epoch=1, global_step=3, sync_round=1, world_size_at_save=1,
                                   pieces=("b.pt", "b.optim.pt")))
    cfg = OmegaConf.structured(Config)
    cfg.cluster.ranks_per_node = 1
    cfg.checkpoint.resume_from = stem
    cfg.outer.kind = "diloco"
    with pytest.raises(ConfigError, match=r"b\.outer\.pt does not exist: outer=diloco") as e:
        ck.validate_resume(cfg)
    assert "\n" not in str(e.value)
