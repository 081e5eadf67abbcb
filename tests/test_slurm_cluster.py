"""Real SLURM (slurmctld + slurmd + slurmdbd accounting) on 127.0.0.1, driven by submitit.

The module fixture runs tests/slurm/up.sh (installs the Debian packages when missing,
needs root) and tests/slurm/down.sh at teardown. State dir: $FLODL_SLURM_DIR
(default /tmp/flodl-slurm). Set FLODL_SLURM_KEEP=1 to leave the cluster up afterwards.
Deselect with `-m "not slurm"`.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "slurm"
STATE_DIR = Path(os.environ.get("FLODL_SLURM_DIR") or "/tmp/flodl-slurm")
UP_TIMEOUT_S = 540  # cold: apt-get install (~15-30 s) + bring-up (~3 s)


def _load_jobs_module():
    """tests/slurm/jobs.py, pickled by value so the job never has to import it."""
    import cloudpickle

    name = "flodl_slurm_test_jobs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / "jobs.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        cloudpickle.register_pickle_by_value(mod)
    return sys.modules[name]


def _skip_loudly(reason: str) -> None:
    msg = f"SLURM tests skipped: {reason}"
    print(f"\n[test_slurm_cluster] {msg}", file=sys.stderr, flush=True)
    warnings.warn(msg, stacklevel=2)  # shows up in the warnings summary even without -s
    pytest.skip(msg)


def _run_script(script: str, timeout: float) -> tuple[int, str, float]:
    # Output goes to a file, not a pipe: daemons started by the script must never be able
    # to hold our read end open.
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            rc = subprocess.run(
                ["bash", str(SCRIPTS / script), str(STATE_DIR)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        return rc, out.read(), time.monotonic() - t0


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.name != "posix" or os.geteuid() != 0:
        _skip_loudly("not root (up.sh starts munged/mariadbd/slurm daemons and may apt-get install)")
    rc, out, dt = _run_script("up.sh", UP_TIMEOUT_S)
    if rc in (2, 3):  # 2: not root, 3: packages missing and apt-get could not install them
        _skip_loudly(f"up.sh could not install/find slurm (rc={rc}):\n{out[-3000:]}")
    if rc != 0:
        pytest.fail(f"tests/slurm/up.sh failed (rc={rc}) after {dt:.1f}s:\n{out[-6000:]}")
    print(f"\n[test_slurm_cluster] up.sh: {dt:.1f}s", file=sys.stderr, flush=True)

    conf = str(STATE_DIR / "slurm.conf")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if os.environ.get("FLODL_SLURM_KEEP") == "1":
            print("[test_slurm_cluster] FLODL_SLURM_KEEP=1: cluster left up", file=sys.stderr)
        else:
            rc, out, dt = _run_script("down.sh", 120)
            print(f"[test_slurm_cluster] down.sh: {dt:.1f}s (rc={rc})", file=sys.stderr, flush=True)
            if rc != 0:
                print(out, file=sys.stderr)


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
