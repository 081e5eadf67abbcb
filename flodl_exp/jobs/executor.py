"""Map the ``cluster`` config onto a submitit executor. Local and SLURM share one job function.

SLURM specifics (checked on a real slurmctld/slurmd/slurmdbd, see tests/test_e2e_slurm.py):

* one job of ``nodes x ranks_per_node`` tasks (``srun`` in the sbatch script); sbatch exports
  the submitting environment (``--export=ALL``), so ``FLODL_*`` variables reach every task.
* ``--signal=USR2@<s>``: submitit's preemption / time-limit signal. slurmctld checks time
  limits every 30 s, so the signal comes 0-30 s earlier than asked and the kill up to 30 s
  after the limit. The default delay (90 s) would be sent at once under a tiny limit, so it
  scales down with ``time_min``: ``min(90, max(15, time_min * 60 // 4))``. Override with
  ``cluster.slurm.additional_parameters={signal: "USR2@300"}`` (raw sbatch value).
* ``--gpus-per-node`` only when GPUs are asked for: some sites refuse the flag without GRES.
* ``--no-kill`` to sbatch *and* srun (``cluster.slurm.no_kill``, default on). Measured on the two-node test
  cluster (tests/test_e2e_slurm_multinode.py) when a node's slurmd stops: without it slurmctld cancels the
  job (NODE_FAIL) and every task dies; with it on sbatch only, the allocation shrinks but srun still
  force-terminates the step, the surviving node's tasks included; with it on both, the survivors run on.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional

from flodl_exp.constants import NODE_DEVICES_ENV

MAX_REQUEUES = 3
"""How many time-limit requeues a job may take (submitit's ``max_num_timeout``)."""


NO_KILL_SRUN_ARGS = ("--no-kill", "-k")
"""srun spellings of ``--no-kill`` (one given in ``srun_args`` is not added twice)."""


def signal_delay_s(time_min: int) -> int:
    """Seconds before the time limit at which SLURM sends USR2 (see the module doc)."""
    return int(min(90, max(15, int(time_min) * 60 // 4)))


def slurm_parameters(cluster: Any, job_name: str) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` keywords for ``cluster`` (pure: unit-testable)."""
    from flodl_exp.config import slurm_cpus_per_task

    s = cluster.slurm
    extra = s.additional_parameters
    if hasattr(extra, "_get_node"):  # an OmegaConf node: plain values for sbatch
        from omegaconf import OmegaConf

        extra = OmegaConf.to_container(extra, resolve=True)
    params: dict[str, Any] = dict(
        job_name=job_name, nodes=int(cluster.nodes), ntasks_per_node=int(cluster.ranks_per_node),
        cpus_per_task=slurm_cpus_per_task(s), time=int(s.time_min), signal_delay_s=signal_delay_s(s.time_min),
        srun_args=[str(a) for a in s.srun_args], setup=[str(c) for c in s.setup],
        additional_parameters={str(k): v for k, v in dict(extra or {}).items()},
    )
    if bool(s.no_kill):
        params["additional_parameters"].setdefault("no_kill", True)
        if not any(a in NO_KILL_SRUN_ARGS or a.startswith("--no-kill=") for a in params["srun_args"]):
            params["srun_args"].insert(0, "--no-kill")
    if int(s.gpus_per_node) > 0:
        params["gpus_per_node"] = int(s.gpus_per_node)
    if s.mem_gb is not None:
        mem = float(s.mem_gb)
        params["mem"] = f"{int(mem)}GB" if mem == int(mem) else f"{int(mem * 1024)}MB"
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if getattr(s, key):
            params[key] = str(getattr(s, key))
    if not params["additional_parameters"]:
        del params["additional_parameters"]
    return params


VISIBLE = "CUDA_VISIBLE_DEVICES"


def restore_visible_devices(executor: str, saved: Optional[str], env: MutableMapping[str, str], local_rank: int = 0) -> None:
    """Give a local task the GPUs the user selected when launching.

    submitit's local executor always sets ``CUDA_VISIBLE_DEVICES`` for its tasks (``0..n-1``
    with ``gpus_per_node``, else empty), so a user's ``CUDA_VISIBLE_DEVICES=4,5`` or MIG UUIDs
    would train on GPUs 0 and 1, or on none. The launcher records the user's value (``saved``;
    None = unset, all GPUs) and each local task puts it back before anything touches CUDA. On
    SLURM the allocation's own value stands.

    Several MIG UUIDs: CUDA shows a process only the first MIG device of its list, so every rank
    would train on the first slice. Each task then gets one entry, ``local_rank mod n`` (rank i
    on slice i mod n), and ``FLODL_NODE_DEVICES=n`` for the data plane's VRAM split.
    """
    if executor != "local":
        return
    env.pop(NODE_DEVICES_ENV, None)
    if saved is None:
        env.pop(VISIBLE, None)
        return
    entries = [e.strip() for e in saved.split(",") if e.strip()]
    if sum(e.upper().startswith("MIG-") for e in entries) >= 2:
        env[VISIBLE] = entries[int(local_rank) % len(entries)]
        env[NODE_DEVICES_ENV] = str(len(entries))
    else:
        env[VISIBLE] = saved


def make_executor(cluster: Any, folder: str, timeout_min: int, job_name: str) -> Any:
    import submitit

    from flodl_exp.config import cluster_size

    w = cluster_size(cluster)
    if cluster.executor == "local":
        ex = submitit.LocalExecutor(folder=folder)
        # No gpus_per_node: the tasks see the launching shell's GPUs (restore_visible_devices).
        ex.update_parameters(nodes=1, tasks_per_node=w, timeout_min=int(timeout_min))
        return ex
    from submitit.slurm.slurm import SlurmExecutor

    # SlurmExecutor directly (not AutoExecutor): its own parameter names, and no silent
    # fallback to the local executor when srun is missing (it raises "Could not detect srun").
    slurm_ex = SlurmExecutor(folder=folder, max_num_timeout=MAX_REQUEUES)
    slurm_ex.update_parameters(**slurm_parameters(cluster, job_name))
    return slurm_ex
