"""Fault injection for tests (the torchft habit: ``fail_at(rank, step)``).

``FLODL_FAULT_INJECT="<rank>:<step>:<kind>[,...]"`` makes a rank fail on purpose
after its ``step``-th batch, the way a real crash, OOM kill or hung device would.

Kinds: ``raise`` | ``exit`` | ``kill`` | ``hang`` (SIGSTOP: the whole process freezes) |
``killsync`` (SIGKILL at the start of the rank's next averaging once ``step`` is reached: a death
during a reduce, its answer never sent) | ``killsave`` (SIGKILL on the next bundle ``save`` it is
sent once ``step`` is reached: a death while a bundle is being written) |
``stall`` (only the main thread stops, for at most :data:`STALL_MAX_S`, while the heartbeat
thread beats on: a read hung on a network mount), and ``gate:<path>``: at/after
its ``step``-th batch the rank blocks until the file ``<path>`` exists (polled
every :data:`GATE_POLL_S`, for at most :data:`GATE_MAX_WAIT_S`), then trains on.
A test holds a run open with it (by a mechanism, not by hoping the machine is
slow) and releases it by creating the file. The path may contain ``:`` but not
``,`` (the entry separator). ``<step>`` = ``connect`` fires in the task before the
rank dials the coordinator (a rank lost during rendezvous); parsed as step -1.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Optional

log = logging.getLogger("flodl_exp.rank")

GATE_POLL_S = 0.05
"""How often a gated rank looks for its gate file."""
GATE_MAX_WAIT_S = 600.0
"""A gate never opened gives up after this long (with a log line) and the rank trains on."""

STALL_MAX_S = 3600.0
"""A stalled main thread resumes after this long (the coordinator evicts it long before)."""

KINDS = ("raise", "exit", "kill", "hang", "stall", "gate", "killsync", "killsave")
ARMED_KINDS = ("killsync", "killsave")
"""Kinds that fire later than the step that arms them, where the rank's code calls :func:`fire_armed`."""


def fire_armed(armed: Optional[str], where: str, rank: int) -> None:
    """SIGKILL this process when ``armed`` (a kind of :data:`ARMED_KINDS`, or None) fires at ``where``."""
    if armed is not None and armed == where:
        log.error("rank %d: injected fault %r", rank, armed)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

_gates_done: set[str] = set()
"""Gate paths this process already passed (released or given up): later steps do not wait again."""


def parse_fault(spec: Optional[str], rank: int) -> Optional[tuple[int, str]]:
    """``FLODL_FAULT_INJECT="<rank>:<step>:<kind>[,...]"`` -> (step, kind) for this rank, or None.

    kind is ``raise`` | ``exit`` | ``kill`` | ``hang`` | ``gate:<path>``; the gate's
    path stays in the kind string (``(step, "gate:/tmp/open")``), so callers pass
    ``kind`` to :func:`inject_fault` unchanged. The first entry for ``rank`` wins.

    The test hook for failure paths: a rank fails on purpose after its
    ``step``-th batch, the way a real crash, OOM kill or hung device would.
    """
    for item in (spec or "").split(","):
        parts = item.strip().split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) != rank:
            continue
        if parts[1] == "connect":
            parts[1] = "-1"
        elif not parts[1].isdigit():
            continue
        kind = parts[2]
        if split_kind(kind)[0] not in KINDS or kind in ("gate", "gate:"):
            log.warning("rank %d: ignoring fault spec %r (kind: raise|exit|kill|hang|stall|killsync|killsave|gate:<path>)", rank, item.strip())
            continue
        return int(parts[1]), kind
    return None


CONNECT_STEP = -1
"""The step :func:`parse_fault` returns for ``<rank>:connect:<kind>``."""


def split_kind(kind: str) -> tuple[str, Optional[str]]:
    """``"gate:/tmp/x"`` -> ("gate", "/tmp/x"); ``"raise"`` -> ("raise", None)."""
    name, sep, arg = kind.partition(":")
    return name, (arg if sep else None)


def wait_gate(path: str, rank: int, step: int, max_wait_s: float = GATE_MAX_WAIT_S, poll_s: float = GATE_POLL_S,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              serve: Optional[Callable[[], bool]] = None) -> bool:
    """Block until ``path`` exists (True) or ``max_wait_s`` passed (False, logged). Bounded in time and count.

    ``serve`` runs at every poll (the rank reads its control there, as between batches: a gated rank is a
    slow rank, not a deaf one, so a save, a shutdown or a lost coordinator reach it); it returns True when
    the rank is stopping, which ends the wait (False)."""
    if os.path.exists(path):
        return True
    log.warning("rank %d: gated at step %d until %s exists (at most %.0f s)", rank, step, path, max_wait_s)
    deadline = clock() + max_wait_s
    for _ in range(int(max_wait_s / max(poll_s, 1e-3)) + 2):
        if os.path.exists(path):
            log.warning("rank %d: gate %s open, training on", rank, path)
            return True
        if clock() >= deadline:
            break
        if serve is not None and serve():
            return False
        sleep(poll_s)
    if os.path.exists(path):
        return True
    log.error("rank %d: gate %s did not open within %.0f s; giving up and training on", rank, path, max_wait_s)
    return False


def inject_fault(kind: str, rank: int, step: int, max_wait_s: float = GATE_MAX_WAIT_S,
                 serve: Optional[Callable[[], bool]] = None) -> None:
    """Do the fault ``kind`` (as returned by :func:`parse_fault`); called after every step from ``step`` on.
    ``serve``: see :func:`wait_gate` (gates only)."""
    name, arg = split_kind(kind)
    if name == "gate":
        if arg is None or arg in _gates_done:
            return
        wait_gate(arg, rank, step, max_wait_s=max_wait_s, serve=serve)
        _gates_done.add(arg)
        return
    log.error("rank %d: injected fault %r at step %d", rank, kind, step)
    if name == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if name == "exit":
        os._exit(3)
    if name == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    if name == "stall":
        end = time.monotonic() + STALL_MAX_S
        while time.monotonic() < end:
            time.sleep(0.5)
