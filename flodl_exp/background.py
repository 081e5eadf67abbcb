"""Background work yields the CPU to training.

A run's side work (the MLflow sink process and its imports, the launcher's simulator import and prediction, the
background model export) used to run at the ranks' priority. On a machine whose cores the ranks fill (the 2-core
CI kind, a workstation where every GPU rank also feeds its GPU from a core) that work took CPU from the train
steps: in a 10-epoch 1:1 run a rank's train step took 10-11 ms against 8.1 ms for the DDP baseline's same step
(docs/reference/measurements.md, "Side work yields the CPU"). The side processes (the sink, the model export) run
in the idle scheduling class and take only what the ranks leave idle (syncs, window edges, the end of the run); the
launcher's side threads, which share its interpreter, are made nicer only. The ranks' and the coordinator's own
priority is unchanged.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""How much less priority side work gets than the process that started it (POSIX niceness, 0-19 on Linux), on top
of the idle scheduling class where the kernel grants it."""


def yield_to_training(increment: int = BACKGROUND_NICE, *, idle: bool = True) -> bool:
    """Lower the CPU priority of the calling thread by ``increment`` and put it in the idle scheduling class
    (``SCHED_IDLE``: it runs when the ranks leave a core idle); the threads and processes it starts afterwards
    inherit both. A process's first thread calling it lowers the whole process in practice. It is never raised
    back (an unprivileged process cannot): call it only in a thread or a process that does nothing but side work.
    False off Linux (a thread id is no process id elsewhere) or where the system refuses (the work then runs at the
    normal priority, as before).

    ``idle=False``: the niceness only. For a thread that shares its interpreter with others (the launcher's, which
    may be a user's own process through ``flodl_exp.launch``): an idle-class thread preempted while it holds the
    GIL or an import lock can keep every other thread of the process waiting as long as the ranks fill the cores;
    a niceness of 10 still lets it run a tenth of a contended core, so it lets go soon."""
    if increment <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        return False
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + int(increment)))
    except OSError as e:  # a sandbox without the syscall
        log.debug("could not lower the priority of side work: %s", e)
        return False
    if not idle:
        return True
    try:
        # SCHED_IDLE: CPU only when no normal thread wants it. A niceness of 10 alone still gave side work about a
        # tenth of a contended core, which delayed one rank's step at a time: its peer waited in the next reduce.
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as e:  # a kernel or container that refuses it: the niceness stays
        log.debug("side work keeps the normal scheduling class: %s", e)
    return True
