"""The job function every submitit task runs (local processes or SLURM tasks alike).

Task 0 first starts the coordinator as its own process (which dies with the
task: PR_SET_PDEATHSIG), then every task waits for rendezvous.json and runs
its rank. Kept import-light: torch is imported inside, after the thread
environment is set.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

COORDINATOR_LOG = "coordinator.log"


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def coordinator_host(spec: dict) -> str:
    cluster = spec["config"]["cluster"]
    if cluster.get("host"):
        return str(cluster["host"])
    if cluster["executor"] == "local":
        return "127.0.0.1"
    return socket.gethostname()


def spawn_coordinator(spec_path: str, host: str) -> subprocess.Popen:
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    log = open(os.path.join(job_dir, COORDINATOR_LOG), "ab")
    return subprocess.Popen([sys.executable, "-m", "flodl_exp.control.main", spec_path, host],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            return b"".join(fh.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""


def run_task(spec_path: str) -> dict:
    import submitit

    env = submitit.JobEnvironment()
    rank, local_rank = env.global_rank, env.local_rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", stream=sys.stderr)
    with open(spec_path) as fh:
        spec = json.load(fh)
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    if spec["config"]["cluster"]["device"] != "cuda":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    coord: Optional[subprocess.Popen] = None
    if rank == 0:
        coord = spawn_coordinator(spec_path, coordinator_host(spec))

    def coord_dead() -> Optional[str]:
        if coord is not None and coord.poll() is not None:
            return f"exit code {coord.returncode}; log tail:\n{_tail(os.path.join(job_dir, COORDINATOR_LOG))}"
        return None

    from .rendezvous import wait_rendezvous

    try:
        rdv = wait_rendezvous(job_dir, float(spec["config"]["cluster"]["rendezvous_timeout_s"]), coord_dead)
        from ..rank.worker import RankWorker

        worker = RankWorker(spec, rank, local_rank, rdv)
        out = worker.run()
    finally:
        if coord is not None:
            deadline = time.monotonic() + 120
            while coord.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if coord.poll() is None:
                coord.kill()
                coord.wait(10)
    if coord is not None and coord.returncode != 0:
        raise RuntimeError(f"coordinator failed (exit code {coord.returncode}):\n{_tail(os.path.join(job_dir, COORDINATOR_LOG))}")
    return out
