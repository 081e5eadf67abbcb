"""Map the ``cluster`` config onto a submitit executor. Local and SLURM share one job function."""
from __future__ import annotations

from typing import Any


def make_executor(cluster: Any, folder: str, timeout_min: int, gpus_per_node: int, job_name: str):
    import submitit

    w = int(cluster.nodes) * int(cluster.ranks_per_node)
    if cluster.executor == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(nodes=1, tasks_per_node=w, timeout_min=int(timeout_min), gpus_per_node=gpus_per_node)
        return ex
    s = cluster.slurm
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params: dict[str, Any] = dict(
        name=job_name, nodes=int(cluster.nodes), tasks_per_node=int(cluster.ranks_per_node),
        cpus_per_task=int(s.cpus_per_task), gpus_per_node=int(s.gpus_per_node), timeout_min=int(s.time_min),
        slurm_srun_args=list(s.srun_args), slurm_setup=list(s.setup),
        slurm_additional_parameters=dict(s.additional_parameters),
    )
    if s.mem_gb is not None:
        params["mem_gb"] = float(s.mem_gb)
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    ex.update_parameters(**params)
    return ex
