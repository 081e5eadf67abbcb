"""End to end on one GPU (issue 13): two ranks sharing it (Gloo, said once; a forced NCCL refused in one
line), one CUDA rank with GPU telemetry that resumes from its bundle, and cpu_cadence with bf16 on the wire."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import base_overrides, job_dir_of, read_events, read_result, run_cli, run_id_of

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


MlflowClient = pytest.importorskip("mlflow.tracking", reason="the end-to-end GPU cases need the project's dependencies").MlflowClient


def _uuid() -> str:
    return str(torch.cuda.get_device_properties(0).uuid)


def _one_gpu_env() -> dict:
    """Every run here sees exactly the first GPU, named by its UUID (CUDA_VISIBLE_DEVICES wants the GPU- prefix)."""
    u = _uuid()
    return {"CUDA_VISIBLE_DEVICES": u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}"}


def _run(store, *args, ok: bool = True):
    r = run_cli([*base_overrides(store, "gpu"), "experiment=digits_mlp", *args], env=_one_gpu_env())
    if ok:
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def test_two_ranks_on_one_gpu_average_through_gloo(store):
    r = _run(store, "mode=nccl_cadence", "cluster.ranks_per_node=2", "cluster.device=cuda", "experiment.epochs=2")
    job = job_dir_of(r.stdout)
    ev = [e for e in read_events(job) if e.get("event") == "collective"]
    assert len(ev) == 1 and ev[0]["backend"] == "gloo" and "share one GPU" in ev[0]["reason"]
    res = read_result(job)
    assert len({f["hash"] for f in res["finals"].values()}) == 1
    assert all(e.get("device", "").startswith("cuda") for e in read_events(job) if e.get("event") == "joined")


def test_a_forced_nccl_on_one_gpu_is_refused_in_one_line(store):
    r = _run(store, "mode=nccl_cadence", "cluster.ranks_per_node=2", "cluster.device=cuda", "cluster.collective=nccl",
             "experiment.epochs=1", ok=False)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "cluster.collective=nccl is not possible" in ln]
    assert lines, r.stdout[-2000:] + r.stderr[-2000:]


def test_one_cuda_rank_logs_gpu_telemetry_and_resumes_on_cuda(store):
    r = _run(store, "mode=nccl_cadence", "cluster.ranks_per_node=1", "cluster.device=cuda", "experiment.epochs=2")
    job, run_id = job_dir_of(r.stdout), run_id_of(r.stdout)
    m = MlflowClient(store["uri"]).get_run(run_id).data.metrics
    assert "rank0/gpu_util" in m and "rank0/mem_gb" in m, sorted(m)
    stem = read_result(job)["saved_stem"] if "saved_stem" in read_result(job) else str(job / "checkpoints" / "final")
    meta = json.loads(open(stem + ".meta.json").read())
    r2 = _run(store, "mode=nccl_cadence", "cluster.ranks_per_node=1", "cluster.device=cuda",
              f"experiment.epochs={int(meta['epoch']) + 1}", f"checkpoint.resume_from={stem}")
    res2 = read_result(job_dir_of(r2.stdout))
    assert res2["status"] == "FINISHED" and res2["resumed_from"] == stem
    assert res2["final_eval"]["eval/accuracy"] >= 0.85


def test_cpu_cadence_with_bf16_wire_on_a_shared_gpu_ends_with_equal_replicas(store):
    r = _run(store, "mode=cpu_cadence", "mode.bf16_wire=true", "cluster.ranks_per_node=2", "cluster.device=cuda",
             "experiment.epochs=2")
    res = read_result(job_dir_of(r.stdout))
    assert res["status"] == "FINISHED" and len({f["hash"] for f in res["finals"].values()}) == 1


def test_the_launch_keeps_the_users_device_selection(store):
    """submitit's local executor would set CUDA_VISIBLE_DEVICES itself; the ranks must see the user's UUID."""
    r = _run(store, "mode=cpu_cadence", "cluster.ranks_per_node=1", "cluster.device=cuda", "experiment.epochs=1")
    job = job_dir_of(r.stdout)
    want = _one_gpu_env()["CUDA_VISIBLE_DEVICES"]
    assert json.loads((job / "spec.json").read_text())["cuda_visible_devices"] == want
    joined = [e for e in read_events(job) if e.get("event") == "joined"]
    assert [e["device_uuid"] for e in joined] == [_uuid()], "the rank trained on the GPU the user named"
