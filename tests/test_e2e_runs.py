"""End-to-end runs on real processes: the CLI, submitit ranks, the coordinator, MLflow."""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flodl_exp.tracking import redact_uri

from conftest import (
    alive,
    assert_exact_coverage,
    base_overrides,
    job_dir_of,
    pids_of,
    read_result,
    run_cli,
    run_id_of,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _run(store, *args):
    r = run_cli([*base_overrides(store), *args])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r, job_dir_of(r.stdout), run_id_of(r.stdout)


SECRET = "S3cr3tPw0rd"


def test_single_rank_run_logs_to_mlflow(store):
    """Also (issue 14): a password in the tracking URI is written nowhere, and the job folder is owner-only."""
    uri = f"{store['uri']}?password={SECRET}"
    args = [a for a in base_overrides(store) if not a.startswith("tracking.uri=")]
    r = run_cli([*args, f"tracking.uri='{uri}'", "experiment=digits_mlp", "cluster.ranks_per_node=1", "experiment.epochs=5",
                 "tracking.log_model=true"])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    job, run_id = job_dir_of(r.stdout), run_id_of(r.stdout)
    _assert_private(store, job, uri, r.stdout, run_id)
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
    _assert_inputs_and_model(store, run_id, run.data.metrics["eval/accuracy"])


def _assert_inputs_and_model(store, run_id: str, accuracy: float) -> None:
    """Issue 17: the data sets are the run's MLflow inputs, and the consensus model loads back with
    mlflow.pytorch.load_model and evaluates to the run's own final eval accuracy."""
    import mlflow
    import mlflow.pytorch
    import torch

    from flodl_exp.zoo.digits import DigitsDataset, evaluate

    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.inputs is not None
    got = {(i.dataset.name, i.tags[0].value) for i in run.inputs.dataset_inputs}
    assert got == {("DigitsDataset/train", "training"), ("DigitsDataset/test", "eval")}
    assert all(len(i.dataset.digest) == 16 for i in run.inputs.dataset_inputs)
    # the model is exported after the run's end, in the background (the command did not wait for it)
    deadline = time.monotonic() + 180
    while run.data.tags.get("model_export") == "pending" and time.monotonic() < deadline:
        time.sleep(0.5)
        run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.data.tags.get("model_export") == "done", run.data.tags
    assert run.info.status == "FINISHED"  # the export did not reopen the run
    assert "log_model_error" not in run.data.tags
    mlflow.set_tracking_uri(store["uri"])
    model = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    info = mlflow.models.get_model_info(f"runs:/{run_id}/model")
    assert info.signature is not None and info.saved_input_example_info is not None
    assert evaluate(model, DigitsDataset("test"), torch.device("cpu"))["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def _assert_private(store, job, uri, stdout, run_id) -> None:
    assert SECRET not in stdout
    leaks = [str(p) for p in Path(store["dir"]).rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    # store["dir"] holds the MLflow database and artifacts, every job folder and Hydra's run folders
    assert leaks == [], "the password reached a file (store, artifacts or job folder)"
    spec = json.loads((job / "spec.json").read_text())
    assert spec["tracking_uri"] == redact_uri(uri) and spec["config"]["tracking"]["uri"] == redact_uri(uri)
    assert MlflowClient(store["uri"]).get_run(run_id).data.params["tracking.uri"] == redact_uri(uri)
    for p in (job, job / "submitit", job / "checkpoints", job / "ranks"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    for p in (job / "spec.json", job / "config.yaml"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    umask = os.umask(0o022)
    os.umask(umask)
    pieces = [p for p in (job / "checkpoints").iterdir() if p.name.startswith("final.")]
    assert pieces and {stat.S_IMODE(os.stat(p).st_mode) for p in pieces} == {0o666 & ~umask}, "bundles follow the umask"
