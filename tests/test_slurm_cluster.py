"""Real SLURM (slurmctld + slurmd + slurmdbd accounting) on 127.0.0.1, driven by submitit.

The module fixture runs tests/slurm/up.sh (installs the Debian packages when missing,
needs root) and tests/slurm/down.sh at teardown. State dir: $FLODL_SLURM_DIR
(default /tmp/flodl-slurm). Set FLODL_SLURM_KEEP=1 to leave the cluster up afterwards.
Deselect with `-m "not slurm"`.
"""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import slurm_cluster_up

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "slurm"


def _load_jobs_module():
    """tests/slurm/jobs.py, pickled by value so the job never has to import it."""
    import cloudpickle

    name = "flodl_slurm_test_jobs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / "jobs.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        cloudpickle.register_pickle_by_value(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def slurm_cluster():
    with slurm_cluster_up("test_slurm_cluster") as conf:
        yield conf


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _executor(folder: Path):
    import submitit

    ex = submitit.AutoExecutor(folder=folder)
    assert ex.cluster == "slurm", f"AutoExecutor picked {ex.cluster!r}, srun not on PATH?"
    ex.update_parameters(
        nodes=1,
        tasks_per_node=2,
        cpus_per_task=1,
        timeout_min=5,
        mem_gb=1,
        slurm_partition="debug",
        slurm_srun_args=["--kill-on-bad-exit=1"],
    )
    return ex


def _squeue_ids() -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20, check=True
    ).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(180)
def test_gloo_allreduce_across_two_slurm_tasks(slurm_cluster, tmp_path):
    jobs = _load_jobs_module()
    t0 = time.monotonic()
    job = _executor(tmp_path).submit(jobs.allreduce_rank, _free_port())
    results = job.results()
    dt = time.monotonic() - t0
    print(f"\n[test_slurm_cluster] 2-rank all_reduce job {job.job_id}: {dt:.1f}s", file=sys.stderr)

    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["sum"] == 3.0  # (0 + 1) + (1 + 1)
        assert r["world_size"] == 2
        assert r["job_id"] == str(job.job_id)
        assert r["env"] == "SlurmJobEnvironment"


@pytest.mark.timeout(180)
def test_raising_task_ends_the_whole_job(slurm_cluster, tmp_path):
    import submitit

    jobs = _load_jobs_module()
    t0 = time.monotonic()
    # Task 1 raises; task 0 would sleep 10 min: only --kill-on-bad-exit ends it early.
    job = _executor(tmp_path).submit(jobs.fail_on_rank, 1, 600)
    with pytest.raises((submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError)):
        job.results()
    dt = time.monotonic() - t0
    print(f"\n[test_slurm_cluster] failing job {job.job_id}: results() raised after {dt:.1f}s",
          file=sys.stderr)
    assert dt < 60, f"job {job.job_id} took {dt:.1f}s to end"

    # Task 1's own outcome is the exception it raised.
    err = job.task(1).exception()
    assert isinstance(err, submitit.core.utils.FailedJobError)
    assert "boom from rank 1" in str(err)

    deadline = t0 + 60
    while str(job.job_id) in _squeue_ids():
        assert time.monotonic() < deadline, f"squeue still lists job {job.job_id} after 60 s"
        time.sleep(0.5)
