"""Background work yields the CPU to training.

A run's side work (the MLflow sink process and its imports, the launcher's simulator import and prediction, the
background model export) used to run at the ranks' priority. On a machine whose cores the ranks fill (the 2-core
CI kind, a workstation where every GPU rank also feeds its GPU from a core) that work took CPU from the train
steps: in a 10-epoch 1:1 run a rank's train step took 10-11 ms against 8.1 ms for the DDP baseline's same step
(docs/reference/measurements.md, "Side work at a lower priority"). Run at a higher niceness, it takes only what the
ranks leave idle (syncs, window edges, the end of the run), and the ranks' and the coordinator's own priority is
unchanged.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""How much less priority side work gets than the process that started it (POSIX niceness, 0-19 on Linux)."""


def yield_to_training(increment: int = BACKGROUND_NICE) -> bool:
    """Lower the CPU priority of the calling thread by ``increment`` (and of the threads it starts afterwards:
    Linux threads take their creator's niceness). A process's first thread calling it lowers the whole process
    in practice, as every later thread inherits it. It is never raised back (an unprivileged process cannot):
    call it only in a thread or a process that does nothing but side work. False off Linux (no per-thread priority
    through this call) or where the system refuses (the work then runs at the normal priority, as before)."""
    if increment <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        return False
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + int(increment)))
        return True
    except OSError as e:  # a sandbox without the syscall, a platform where the id is not a thread's
        log.debug("could not lower the priority of side work: %s", e)
        return False
