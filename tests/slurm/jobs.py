"""Functions submitted to the test SLURM cluster by tests/test_slurm_cluster.py.

The test loads this file by path and registers it with
``cloudpickle.register_pickle_by_value``, so submitit ships the functions' code inside
the job pickle: the job (``<python> -m submitit.core._submit``, run from the submitting
cwd) does not need ``tests/`` on its sys.path. Only torch and submitit must be importable
by the job's python, which is the submitting interpreter.
"""
from __future__ import annotations

import datetime
import os
import socket
import time


def allreduce_rank(port: int) -> dict:
    """Each task all_reduces (global_rank + 1) over gloo; returns what it saw."""
    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.JobEnvironment()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        rank=env.global_rank,
        world_size=env.num_tasks,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        t = torch.tensor([float(env.global_rank + 1)])
        dist.all_reduce(t)
        total = float(t.item())
    finally:
        dist.destroy_process_group()
    return {
        "rank": env.global_rank,
        "local_rank": env.local_rank,
        "world_size": env.num_tasks,
        "job_id": str(env.job_id),
        "sum": total,
        "env": type(env).__name__,
        "hostname": socket.gethostname(),
    }


def fail_on_rank(bad_rank: int, sleep_s: float) -> int:
    """Task `bad_rank` raises at once; the others would sleep `sleep_s` (ended by srun)."""
    import submitit

    env = submitit.JobEnvironment()
    if env.global_rank == bad_rank:
        raise RuntimeError(f"boom from rank {env.global_rank}")
    time.sleep(sleep_s)
    return env.global_rank
