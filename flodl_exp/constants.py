"""Values shared by the launcher, the job tasks and the coordinator (light on purpose: the coordinator imports
this before torch, and each value has exactly one definition)."""
from __future__ import annotations

COORDINATOR_LOG = "coordinator.log"
"""The coordinator's stdout/stderr, in the job folder."""
PREEMPT_EXIT = 3
"""Coordinator exit status: PREEMPTED (bundle written, MLflow run still RUNNING)."""
PREEMPT_MARK = "preempted.json"
"""Written by the coordinator once the preemption bundle is complete: ``{attempt, stem, epoch}``."""
PARENT_ENV = "FLODL_PARENT_RUN_ID"
"""Set by the sweep callback for the jobs of a ``-m`` sweep: their MLflow parent run."""
FAULT_ENV = "FLODL_FAULT_INJECT"
"""Test hook: ``<rank>:<step>:<kind>`` makes a rank fail on purpose (see rank/fault_inject.py)."""
RANK_ENV = "FLODL_RANK"
"""Set in every rank's process (one rank a process) to its global rank: user code called with no rank argument
(``experiment.checkpoint_fn``) reads it."""
JOB_DIR_ENV = "FLODL_JOB_DIR"
"""Set in every rank's process to the job folder (a rank's working directory is the one it was launched from)."""
LOST_GRACE_S = 10.0
"""After the coordinator's connection breaks (or it exits), a rank's main thread has this long to end before
the process is ended without it: it may sit in a call that reads no control (a TCPStore connect to a store
gone with task 0 retries for minutes)."""

NODE_DEVICES_ENV = "FLODL_NODE_DEVICES"
"""Set by ``jobs/executor.restore_visible_devices`` when it gave each local task one MIG slice: how many slices the
node's ranks are spread over (rank/data/budget.ranks_sharing_device counts the ranks on this task's slice from it)."""
