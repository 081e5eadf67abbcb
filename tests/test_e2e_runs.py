"""End-to-end runs on real processes: the CLI, submitit ranks, the coordinator, MLflow."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import (
    alive,
    assert_exact_coverage,
    base_overrides,
    job_dir_of,
    pids_of,
    read_events,
    read_result,
    run_cli,
    run_id_of,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _run(store, *args):
    r = run_cli([*base_overrides(store), *args])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r, job_dir_of(r.stdout), run_id_of(r.stdout)


def test_single_rank_run_logs_to_mlflow(store):
    r, job, run_id = _run(store, "experiment=digits_mlp", "cluster.ranks_per_node=1", "experiment.epochs=5")
    c = MlflowClient(store["uri"])
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(run_id, "loss")] == [0, 1, 2, 3, 4]
    assert run.data.metrics["eval/accuracy"] >= 0.90
    assert run.data.params["experiment.name"] == "digits_mlp"
    assert run.data.tags["mode"] == "nccl_cadence" and run.data.tags["world_size"] == "1"
    res = read_result(job)
    assert (job / "checkpoints" / "final.pt").exists() and (job / "checkpoints" / "final.meta.json").exists()
    assert "run summary" in r.stdout and "mlflow ui" in r.stdout
    arts = {a.path for a in c.list_artifacts(run_id, "checkpoints")}
    assert "checkpoints/final.pt" in arts
    assert_exact_coverage(res, 32)
    assert not any(alive(p) for p in pids_of(job))


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_sync_modes_average_replicas(store, mode, ranks):
    r, job, run_id = _run(store, f"mode={mode}", "experiment=digits_mlp", "experiment.epochs=5",
                          f"cluster.ranks_per_node={ranks}")
    c = MlflowClient(store["uri"])
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["eval/accuracy"] >= 0.90
    for rank in range(ranks):
        # Telemetry too, though these epochs are far shorter than a report interval (the flush at exit).
        for key in ("batch_share", "samples_per_s", "data_starve_ms", "idle_frac", "cpu_pct", "rss_gb"):
            assert f"rank{rank}/{key}" in m, sorted(m)
    assert sum(x.value for x in c.get_metric_history(run_id, "syncs")) > 0
    if mode.startswith("nccl"):  # CPU ranks: the coordinator chose Gloo for the cohort, once, from the hellos
        chosen = [e for e in read_events(job) if e.get("event") == "collective"]
        assert [e["backend"] for e in chosen] == ["gloo"] and run.data.tags["collective"] == "gloo"
    res = read_result(job)
    hashes = {f["hash"] for f in res["finals"].values()}
    assert len(res["finals"]) == ranks and len(hashes) == 1, "replicas differ after the final consensus"
    assert_exact_coverage(res, 32)
    assert not any(alive(p) for p in pids_of(job))
