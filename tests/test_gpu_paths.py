"""The GPU paths' logic, proven on CPU with fakes (tests/gpu/ holds what needs a device).

One backend for the cohort from the hellos; a forced NCCL refused in one line; a periodic eval
holds the nccl collective back; collectives wait by polling with their own deadline and end on
a regroup; the group is aborted, never destroyed, on failure; the user's CUDA_VISIBLE_DEVICES
survives the local launcher; a SLURM job without GPUs trains on CPU; snapshots stage through one
host buffer.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from control_fakes import Harness
from rank_fakes import rank_control

from flodl_exp.config import ConfigError
from flodl_exp.config_rules import validate
from flodl_exp.core.lifecycle import RunFailure
from flodl_exp.devices import CollectiveRefused, RankDevice, choose_collective, shared_devices
from flodl_exp.jobs.executor import restore_visible_devices
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import (
    CoordHeartbeat,
    EvalResult,
    ExecuteEval,
    FormGroup,
    Regroup,
    Shutdown,
    StartEpoch,
    SyncNow,
)
from flodl_exp.rank.backends import CollectiveBackend, CollectiveInterrupted, CollectiveTimeout, CoordinatorBackend
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.worker import pick_device, requested_device


def _gpu(rank: int, uuid: str | None, host: str = "n1", index: int = 0) -> RankDevice:
    return RankDevice(rank=rank, host=host, device=f"cuda:{index}", uuid=uuid)


# ---------------------------------------------------------------- the cohort's backend
def test_one_gpu_per_rank_gets_nccl():
    choice = choose_collective([_gpu(0, "GPU-a"), _gpu(1, "GPU-b", index=1)])
    assert choice.backend == "nccl"


def test_ranks_sharing_a_gpu_average_through_gloo_and_say_which():
    devs = [_gpu(0, "GPU-a"), _gpu(1, "GPU-a"), _gpu(2, "GPU-b", index=1)]
    assert shared_devices(devs) == [[0, 1]]
    choice = choose_collective(devs, "auto")
    assert choice.backend == "gloo" and "ranks [0, 1] share one GPU" in choice.reason


def test_the_same_index_on_two_hosts_is_two_gpus_and_renumbered_uuids_are_one():
    """cuda:0 on two nodes is two devices; cuda:0 and cuda:1 with one UUID (CUDA_VISIBLE_DEVICES renumbering) are one."""
    assert choose_collective([_gpu(0, "GPU-a", host="n1"), _gpu(1, "GPU-b", host="n2")]).backend == "nccl"
    assert choose_collective([_gpu(0, "GPU-a", index=0), _gpu(1, "GPU-a", index=1)]).backend == "gloo"
    # no UUID reported: host + device name decides
    assert choose_collective([_gpu(0, None, host="n1"), _gpu(1, None, host="n2")]).backend == "nccl"
    assert choose_collective([_gpu(0, None), _gpu(1, None)]).backend == "gloo"


def test_a_mixed_cpu_gpu_cohort_picks_one_backend_for_everyone():
    choice = choose_collective([_gpu(0, "GPU-a"), RankDevice(1, "n2", "cpu")])
    assert choice.backend == "gloo" and "ranks [1] train on CPU" in choice.reason


def test_a_forced_nccl_that_cannot_run_is_refused_in_one_line():
    with pytest.raises(CollectiveRefused) as e:
        choose_collective([_gpu(0, "GPU-a"), _gpu(1, "GPU-a")], "nccl")
    assert "\n" not in str(e.value) and "cluster.collective=nccl" in str(e.value) and "share one GPU" in str(e.value)
    assert choose_collective([_gpu(0, "GPU-a"), _gpu(1, "GPU-a")], "gloo").backend == "gloo"
    assert choose_collective([RankDevice(0, "h", "cpu"), RankDevice(1, "h", "cpu")]).backend == "gloo"


def test_the_coordinator_sends_the_cohorts_backend_before_the_first_chunk(tmp_path):
    h = Harness(tmp_path, "nccl_cadence", 2)
    for r in range(2):
        h.co.on_event(("join", r, Hello(rank=r, samples=256, host="h", pid=100 + r, device="cuda:0", device_uuid="GPU-x")))
    h.co.start()
    sent = h.transport.take()
    first = {r: next(type(p) for rr, p in sent if rr == r) for r in range(2)}
    assert first == {0: FormGroup, 1: FormGroup}, "the group is formed before any chunk"
    assert {p.backend for _, p in sent if isinstance(p, FormGroup)} == {"gloo"}
    assert h.sink.tags["collective"] == "gloo"


def test_a_forced_nccl_on_a_shared_gpu_fails_the_run_before_training(tmp_path):
    forced: dict[str, Any] = {"cluster.collective": "nccl"}
    h = Harness(tmp_path, "nccl_cadence", 2, **forced)
    for r in range(2):
        h.co.on_event(("join", r, Hello(rank=r, samples=256, host="h", pid=100 + r, device="cuda:0", device_uuid="GPU-x")))
    with pytest.raises(RunFailure, match="share one GPU"):
        h.co.start()
    assert not h.transport.take(StartEpoch)


def test_cpu_modes_form_no_group(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", 2)
    h.start()
    assert not h.transport.take(FormGroup)


def test_a_periodic_eval_holds_the_collective_back(tmp_path):
    """An eval on the callback rank while its peers wait in an all_reduce would outlast any collective timeout."""
    h = Harness(tmp_path, "nccl_sync", 2, epochs=3, **{"eval.every": 1})
    plans = h.start()
    h.play([0, 1], until=lambda: h.co.eval_pending is not None, pending=[(r, p) for r, ps in plans.items() for p in ps])
    cb = h.co.eval_pending
    assert cb is not None
    for r, p in h.transport.take():  # a reduce fired in the same tick, before the eval was sent: it runs first
        if not isinstance(p, ExecuteEval):
            h.answer(r, p)
    h.tick()
    held: list = []
    for _ in range(30):
        for r, p in h.transport.take():
            if isinstance(p, SyncNow):
                held.append((r, p))
            elif not isinstance(p, ExecuteEval):
                h.answer(r, p)
        h.tick()
    assert not held, "no collective while the eval runs"
    assert h.co.core.cycle.should_average(h.co.core.cohort.alive_ranks(), h.co.core.dispatch.quiesced), "the gate itself is open"
    h.msg(cb, EvalResult(epoch=0, metrics={"accuracy": 0.5}))
    h.tick()
    assert h.transport.take(SyncNow), "the eval answered: the collective starts"


# ---------------------------------------------------------------- waiting for a collective
class _Pending:
    """A collective that never completes (a peer that never arrives)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:  # pragma: no cover - never reached
        raise AssertionError("wait() on a pending collective")


def _backend(poll=lambda: None, clock=None) -> CollectiveBackend:
    b = CollectiveBackend.__new__(CollectiveBackend)
    b.op_timeout_s, b.poll = 5.0, poll
    t = iter(range(10_000))
    b._clock = clock or (lambda: float(next(t)))  # one second per look
    return b


def test_a_collective_that_outlives_its_deadline_raises_in_python():
    with pytest.raises(CollectiveTimeout, match="cluster.collective_timeout_s"):
        _backend()._wait(_Pending())


def test_a_control_message_can_end_a_pending_collective():
    calls = []

    def poll() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise CollectiveInterrupted("regroup")

    with pytest.raises(CollectiveInterrupted):
        _backend(poll, clock=lambda: 0.0)._wait(_Pending())
    assert len(calls) == 3


def test_a_finished_collective_reports_its_own_error():
    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        _backend()._wait(Failed())


def test_a_one_rank_sync_leaves_parameters_and_buffers_unchanged_and_abort_allows_a_new_group(master_store):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(8, 4))  # running stats move off their defaults
    before = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    b = CollectiveBackend(host="127.0.0.1", store_port=master_store.port, rank=0, world_size=1, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=30, store_timeout_s=10)
    d, post, pre = b.sync(model, 3, 1.0)
    after = list(model.parameters()) + list(model.buffers())
    assert all(torch.allclose(x, y) for x, y in zip(before, after)) and d is not None and d < 1e-6
    b.abort()
    assert b.group is None and not dist.is_initialized(), "abort leaves no group behind (Gloo never uses the default one)"
    b.rebuild(1, 0, 1, session="s1")
    assert b.group is not None and b.generation == 1
    b.sync(model, 1, 1.0)
    b.close()
    assert b.group is None and not dist.is_initialized()


def test_nccl_is_refused_for_a_cpu_rank():
    with pytest.raises(ValueError, match="NCCL"):
        CollectiveBackend(host="127.0.0.1", store_port=1, rank=0, world_size=2, device=torch.device("cpu"), backend="nccl",
                          op_timeout_s=1, store_timeout_s=1)


# ---------------------------------------------------------------- the rank's side
def _rank(messages: list) -> tuple[RankControl, list]:
    """Rank 1 of a formed group with ``messages`` queued; returns its control and the rebuilds it asked for."""
    w, _ = rank_control(SimpleNamespace(global_step=0), messages=messages, rank=1)
    rebuilt: list = []
    w.collective = SimpleNamespace(rebuild=lambda *a: rebuilt.append(a))  # type: ignore[assignment]
    return w, rebuilt


def test_a_regroup_mid_collective_ends_the_wait_and_is_handled_by_the_retry():
    regroup = Regroup(generation=1, new_rank=0, world_size=2, ranks=[1, 2], session="s1")
    w, rebuilt = _rank([CoordHeartbeat(), StartEpoch(epoch=0, offset=0, size=8, chunk=3), regroup])
    with pytest.raises(CollectiveInterrupted):
        w._poll_during_collective()
    assert w.pending_regroup == regroup and list(w.inbox.deferred) == [StartEpoch(epoch=0, offset=0, size=8, chunk=3)]
    assert w._await_regroup(deadline_s=1.0)
    assert rebuilt == [(1, 0, 2, "s1")] and list(w.inbox.deferred), "other work waits its turn"


def test_a_newer_regroup_while_one_forms_is_formed_instead():
    """A node loss is two deaths a little apart: an idle rank forming generation 1 (waiting for its members at
    the store) hears of generation 2. That regroup ends the wait and is formed; the interrupt no longer escapes
    the handler and ends the rank (it did in the two-node SLURM test)."""
    second = Regroup(generation=2, new_rank=0, world_size=2, ranks=[0, 1], session="s2")
    w, _ = _rank([])
    calls: list = []

    def rebuild(*a):
        calls.append(a)
        if len(calls) == 1:  # generation 1's wait for its members reads control and finds generation 2
            w.pending_regroup = second
            raise CollectiveInterrupted("regroup to generation 2 arrived mid-collective")

    w.collective = SimpleNamespace(rebuild=rebuild)  # type: ignore[assignment]
    w.handle(Regroup(generation=1, new_rank=0, world_size=3, ranks=[0, 1, 3], session="s1"))
    assert calls == [(1, 0, 3, "s1"), (2, 0, 2, "s2")] and w.pending_regroup is None


def test_a_shutdown_mid_collective_stops_the_rank():
    w, _ = _rank([Shutdown(reason="done")])
    with pytest.raises(CollectiveInterrupted):
        w._poll_during_collective()
    assert w.stopping


def test_nothing_queued_keeps_the_collective_waiting():
    w, _ = _rank([])
    w._poll_during_collective()
    assert w.pending_regroup is None and not w.inbox.deferred


# ---------------------------------------------------------------- devices and launch
def test_the_user_cuda_visible_devices_survives_the_local_launcher():
    env = {"CUDA_VISIBLE_DEVICES": ""}  # what submitit's local executor sets
    restore_visible_devices("local", "4,5", env)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    restore_visible_devices("local", None, env)
    assert "CUDA_VISIBLE_DEVICES" not in env, "unset when launching means every GPU"
    env = {"CUDA_VISIBLE_DEVICES": "2"}
    restore_visible_devices("slurm", "MIG-abc", env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2", "SLURM's allocation stands"


def _cluster(executor: str, device: str, gpus: int) -> SimpleNamespace:
    return SimpleNamespace(executor=executor, device=device, slurm=SimpleNamespace(gpus_per_node=gpus))


def test_a_slurm_job_without_gpus_trains_on_cpu_and_says_so():
    dev, note = requested_device(_cluster("slurm", "auto", 0))
    assert dev == "cpu" and note and "gpus_per_node=0" in note
    assert requested_device(_cluster("slurm", "auto", 4)) == ("auto", None)
    assert requested_device(_cluster("local", "auto", 0)) == ("auto", None)
    assert requested_device(_cluster("slurm", "cuda", 0)) == ("cuda", None), "an explicit choice is the user's"


def test_more_ranks_than_gpus_share_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [str(pick_device("auto", r)) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert str(pick_device("cpu", 0)) == "cpu"


def test_nccl_on_slurm_needs_a_gpu_per_rank():
    from conftest import compose

    cfg = compose(["mode=nccl_cadence", "cluster=slurm", "cluster.ranks_per_node=4", "cluster.slurm.gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"cluster.slurm.gpus_per_node=2 .*ranks_per_node \(4\)"):
        validate(cfg)
    validate(compose(["mode=nccl_cadence", "cluster=slurm", "cluster.ranks_per_node=4", "cluster.slurm.gpus_per_node=2",
                      "cluster.collective=gloo"]))
    validate(compose(["mode=cpu_cadence", "cluster=slurm", "cluster.ranks_per_node=4", "cluster.slurm.gpus_per_node=2"]))
    with pytest.raises(ConfigError, match="cluster.collective='mpi'"):
        validate(compose(["cluster.collective=mpi"]))


# ---------------------------------------------------------------- snapshots through one staging buffer
def test_snapshots_stage_through_one_reused_buffer():
    be = CoordinatorBackend(bf16_wire=True)
    params = [torch.randn(3, 2), torch.randn(5)]
    bufs = [torch.randn(4)]
    out = be.stage(params, bufs, torch.bfloat16, pin=False)
    assert out["p0"].dtype == torch.bfloat16 and out["p0"].shape == (3, 2)
    assert torch.equal(out["p0"], params[0].to(torch.bfloat16)) and torch.equal(out["p1"], params[1].to(torch.bfloat16))
    assert out["b0"].dtype == torch.float32 and torch.equal(out["b0"], bufs[0])
    ptr = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptr) == 1, "every tensor is a view of the one staging buffer"
    again = be.stage(params, bufs, torch.bfloat16, pin=False)
    assert again["p0"].untyped_storage().data_ptr() in ptr, "the buffer is reused"
