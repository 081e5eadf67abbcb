"""GPU paths, second round (issue 28), the device side, on CPU with the device facts faked: MIG slices average
through Gloo and each local task gets its own slice (item 3), a GPU job's tasks get more than one core (item 4),
per-task GPU binding does not split the VRAM budget (item 7), and a GPU the torch build has no kernels for is
skipped or refused in one line (item 8)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flodl_exp.constants import NODE_DEVICES_ENV
from flodl_exp.devices import CollectiveRefused, RankDevice, arch_runs_on, choose_collective
from flodl_exp.jobs.executor import VISIBLE, restore_visible_devices
from flodl_exp.protocol.hello import Hello
from flodl_exp.rank import worker
from flodl_exp.rank.data.budget import ranks_sharing_device

# -- item 3: MIG -------------------------------------------------------------------------------------------


def _props(uuid: str, name: str = "NVIDIA A100-SXM4-40GB", major: int = 8, minor: int = 0) -> SimpleNamespace:
    return SimpleNamespace(uuid=uuid, name=name, major=major, minor=minor, total_memory=40 * 2**30)


def _fake_props(monkeypatch, by_index: dict[int, SimpleNamespace]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: by_index[torch.device(d).index or 0])


def test_a_mig_slice_reports_a_mig_uuid(monkeypatch):
    """torch gives a slice's bare UUID; the rank marks it (by the device's name, or its CUDA_VISIBLE_DEVICES entry)."""
    monkeypatch.delenv(VISIBLE, raising=False)
    _fake_props(monkeypatch, {0: _props("1f2e-aa", name="NVIDIA A100-SXM4-40GB MIG 1g.5gb")})
    assert worker.device_uuid(torch.device("cuda:0")) == "MIG-1f2e-aa"
    _fake_props(monkeypatch, {0: _props("1f2e-aa")})
    assert worker.device_uuid(torch.device("cuda:0")) == "1f2e-aa", "a whole GPU keeps torch's UUID"
    monkeypatch.setenv(VISIBLE, "MIG-1f2e-aa")
    assert worker.device_uuid(torch.device("cuda:0")) == "MIG-1f2e-aa"


def test_ranks_on_distinct_mig_slices_average_through_gloo_and_a_forced_nccl_is_refused(monkeypatch):
    """Two slices have two UUIDs, so the old rule saw two devices of their own and chose NCCL (which has no MIG)."""
    monkeypatch.delenv(VISIBLE, raising=False)
    hellos = []
    for rank, uuid in enumerate(["aaaa-1", "bbbb-2"]):
        _fake_props(monkeypatch, {0: _props(uuid, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb")})
        hellos.append(Hello(rank=rank, host="n1", device="cuda:0", device_uuid=worker.device_uuid(torch.device("cuda:0"))))
    devices = [RankDevice.of(h.rank, h) for h in hellos]
    choice = choose_collective(devices)
    assert choice.backend == "gloo" and "MIG" in choice.reason and "\n" not in choice.reason, choice
    with pytest.raises(CollectiveRefused, match="MIG"):
        choose_collective(devices, "nccl")
    whole = [RankDevice(0, "n1", "cuda:0", "GPU-a"), RankDevice(1, "n1", "cuda:1", "GPU-b")]
    assert choose_collective(whole).backend == "nccl", "whole GPUs of their own still get NCCL"


def test_each_local_task_gets_its_own_mig_slice():
    """CUDA shows a process only the first MIG device of its list: without the split every rank trained on slice 0."""
    saved = "MIG-aaaa,MIG-bbbb"
    seen = []
    for local_rank in range(4):
        env = {VISIBLE: "0,1"}  # what submitit's local executor leaves
        restore_visible_devices("local", saved, env, local_rank)
        seen.append(env[VISIBLE])
        assert env[NODE_DEVICES_ENV] == "2"
        assert ranks_sharing_device(4, 1, local_rank, env) == 2  # ranks 0, 2 on slice a; 1, 3 on slice b
    assert seen == ["MIG-aaaa", "MIG-bbbb", "MIG-aaaa", "MIG-bbbb"]
    env = {VISIBLE: "0", NODE_DEVICES_ENV: "2"}
    restore_visible_devices("local", "4,5", env, 1)
    assert env == {VISIBLE: "4,5"}, "whole GPUs: the user's list as it was, no stale slice count"
    env = {VISIBLE: "MIG-x"}
    restore_visible_devices("slurm", saved, env, 1)
    assert env == {VISIBLE: "MIG-x"}, "SLURM's own value stands"


# -- item 4: cpus_per_task ----------------------------------------------------------------------------------


def test_a_gpu_job_asks_for_cores_for_its_threads():
    from flodl_exp.config import GPU_TASK_CPUS, ConfigError
    from flodl_exp.config_rules import validate
    from flodl_exp.jobs.executor import slurm_parameters

    from conftest import compose

    def cpus(*overrides: str) -> int:
        cfg = compose(["cluster=slurm", "mode=cpu_cadence", *overrides])
        validate(cfg)
        return int(slurm_parameters(cfg.cluster, "j")["cpus_per_task"])

    assert cpus("cluster.slurm.gpus_per_node=2") == GPU_TASK_CPUS == 6  # main + 4 readers + NCCL proxy / coordinator
    assert cpus() == 1, "a CPU job still packs onto small nodes"
    assert cpus("cluster.slurm.gpus_per_node=2", "cluster.slurm.cpus_per_task=3") == 3
    with pytest.raises(ConfigError, match=r"cluster.slurm.cpus_per_task=0 is not allowed: an integer >= 1") as e:
        cpus("cluster.slurm.cpus_per_task=0")
    assert "\n" not in str(e.value)


# -- item 7: per-task GPU binding -----------------------------------------------------------------------------


@pytest.mark.parametrize("env, want", [
    ({}, 4),  # 4 ranks, one GPU, nothing says otherwise: they share it
    ({"SLURM_GPUS_PER_TASK": "1"}, 1),  # --gpus-per-task: each task its own GPU
    ({"SLURM_GPUS_PER_TASK": "a100:1"}, 1),
    ({"SLURM_STEP_GPUS": "0,1,2,3"}, 1),  # --gpu-bind over the step's 4 GPUs: one each
    ({"SLURM_STEP_GPUS": "0,1"}, 2),  # 2 GPUs bound round-robin to 4 tasks
    ({"SLURM_JOB_GPUS": "0"}, 4),
])
def test_per_task_gpu_binding_does_not_split_the_vram_budget(env, want):
    assert ranks_sharing_device(4, 1, 0, env) == want


def test_ranks_seeing_all_gpus_are_counted_as_before():
    assert ranks_sharing_device(4, 2, 1, {"SLURM_GPUS_PER_TASK": "1"}) == 2
    assert ranks_sharing_device(3, 2, 0, {}) == 2 and ranks_sharing_device(3, 2, 1, {}) == 1
    assert ranks_sharing_device(1, 1, 0, {"SLURM_STEP_GPUS": "0,1"}) == 1


# -- item 8: a GPU the wheel has no kernels for ---------------------------------------------------------------


def test_which_architectures_a_build_runs_on():
    wheel = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert not arch_runs_on((3, 7), wheel)  # a K80 under a wheel without sm_37
    assert arch_runs_on((8, 9), wheel)  # sm_86's cubin runs on 8.9 (same major)
    assert not arch_runs_on((10, 0), wheel)  # no PTX: nothing for a newer major
    assert arch_runs_on((10, 0), [*wheel, "compute_90"])  # PTX is compiled for newer devices
    assert arch_runs_on((9, 0), ["sm_90a"]) and not arch_runs_on((9, 1), ["sm_90a"])
    assert arch_runs_on((12, 0), ["sm_100", "sm_120"])
    assert arch_runs_on((3, 5), []) and arch_runs_on((9, 0), ["gfx90a"]), "nothing to judge by: not refused"


def _fake_box(monkeypatch, caps: list[tuple[int, int]], arch: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i or 0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Tesla K80" if caps[i or 0] < (5, 0) else "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch)


def test_an_older_gpu_without_kernels_is_skipped_with_a_warning(monkeypatch, caplog):
    _fake_box(monkeypatch, [(3, 7), (8, 0)], ["sm_50", "sm_80", "sm_90"])
    with caplog.at_level("WARNING", logger="flodl_exp.rank"):
        picked = [worker.pick_device("auto", r) for r in range(3)]
        assert worker.pick_device("cuda", 0) == torch.device("cuda:1")
    assert picked == [torch.device("cuda:1")] * 3
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs and all("cuda:0 (Tesla K80, compute capability 3.7)" in m and "sm_80" in m for m in msgs), msgs


def test_no_gpu_with_kernels_refuses_cuda_in_one_line_and_auto_trains_on_cpu(monkeypatch, caplog):
    _fake_box(monkeypatch, [(3, 7)], ["sm_50", "sm_80"])
    with pytest.raises(RuntimeError) as e:
        worker.pick_device("cuda", 0)
    msg = str(e.value)
    assert "\n" not in msg and "Tesla K80" in msg and "3.7" in msg and "sm_50 sm_80" in msg, msg
    with caplog.at_level("WARNING", logger="flodl_exp.rank"):
        assert worker.pick_device("auto", 0) == torch.device("cpu")
    assert any("training on CPU" in r.getMessage() and "3.7" in r.getMessage() for r in caplog.records)


def test_supported_gpus_are_picked_by_local_rank(monkeypatch):
    _fake_box(monkeypatch, [(8, 0), (9, 0)], ["sm_80", "sm_90"])
    assert [worker.pick_device("auto", r) for r in range(3)] == [torch.device(f"cuda:{i}") for i in (0, 1, 0)]
    assert worker.pick_device("cpu", 0) == torch.device("cpu")
