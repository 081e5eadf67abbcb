"""Issue 14 item 9: a refused submission is one line (sbatch's message, what to check), exit 2 for a missing
sbatch or an unreachable / unconfigured SLURM, exit 1 for a refused job, and the MLflow run ends FAILED."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flodl_exp.jobs.launcher import submit_error

from conftest import run_cli

pytestmark = [pytest.mark.timeout(240)]


def _bin(tmp_path: Path, sbatch_stderr: str | None) -> str:
    b = tmp_path / "bin"
    b.mkdir()
    (b / "srun").write_text("#!/bin/sh\nexit 0\n")
    if sbatch_stderr is not None:
        (b / "sbatch").write_text(f"#!/bin/sh\necho '{sbatch_stderr}' >&2\nexit 1\n")
    for p in b.iterdir():
        p.chmod(0o755)
    return str(b)


def _cli(tmp_path: Path, path: str, name: str):
    d = tmp_path / "store"
    args = [f"tracking.uri=sqlite:///{d}/mlflow.db", f"tracking.experiment_name={name}", f"run.job_root={d}/jobs",
            f"hydra.run.dir={tmp_path}/hydra", "cluster=slurm", "experiment=digits_mlp"]
    env = {"PATH": f"{path}{os.pathsep}{Path(sys.executable).parent}"}
    return run_cli(args, env=env), f"sqlite:///{d}/mlflow.db"


def _run_of(uri: str, name: str):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(name)
    assert exp is not None, f"no experiment {name!r} in {uri}"
    return c.search_runs([exp.experiment_id])[0]


def _one_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip() and " INFO mlflow" not in x]  # a new store logs its tables
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


@pytest.mark.e2e
def test_a_refused_job_is_one_line_exit_1_and_a_failed_run(tmp_path):
    msg = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
    r, uri = _cli(tmp_path, _bin(tmp_path, msg), "refused")
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert "Invalid account" in line and "cluster.slurm" in line
    run = _run_of(uri, "refused")
    assert run.info.status == "FAILED" and "Invalid account" in run.data.tags["error"]


def test_an_unreachable_controller_is_exit_2():
    e = RuntimeError("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)")
    err = submit_error(e, "slurm")
    assert err.exit_code == 2 and "Unable to contact slurm controller" in str(err) and "scontrol ping" in str(err)
    assert submit_error(FileNotFoundError(2, "No such file", "sbatch"), "slurm").exit_code == 2
    no_srun = submit_error(RuntimeError("Could not detect srun, are you indeed on a slurm cluster?"), "slurm")
    assert no_srun.exit_code == 2 and "\n" not in str(no_srun)  # submitit's own check when srun is not on PATH
    refused = submit_error(RuntimeError("sbatch: error: QOSMaxWallDurationPerJobLimit"), "slurm")
    assert refused.exit_code == 1 and "\n" not in str(refused)
