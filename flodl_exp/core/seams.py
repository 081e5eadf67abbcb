"""The two values every component of the core is built with besides its peers: the shell's ports, and the run's
own actions.

A component needs the shell (to send, to record, to read the time, to write a bundle) and, for some decisions, the
run as a whole (to change phase, to shut down, to save and stop, to fire a reduce: each has one owner, the core).
Passing those as nine separate arguments made every constructor a list of 12-18 names; these two values keep each
component's arguments to what is its own: its settings and the peers it asks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # ports.py imports the cycle, which takes Ports: the names are for annotations only
    from flodl_exp.core.bundle_store import BundleStore
    from flodl_exp.core.lifecycle import Phase
    from flodl_exp.core.outbox import Outbox
    from flodl_exp.core.ports import CoreObserver


def _nowhere(r: int) -> bool:
    return False


@dataclass(frozen=True)
class Ports:
    """What the shell implements for the core (core/control_core.py's module docstring lists who implements what).

    A component keeps the ones it uses as its own fields when it is built; none reads them through this record."""

    out: Outbox
    """Messages to ranks."""
    obs: CoreObserver
    """What the shell records of the core's decisions (write-only)."""
    clock: Callable[[], float]
    """Monotonic seconds: the time every decision reads."""
    wall_clock: Callable[[], float]
    """Unix seconds, for the records the core writes (the bundle meta, death records)."""
    store: BundleStore
    """Bundle files, the outer optimizer's sidecar and the preemption mark."""
    is_local: Callable[[int], bool] = field(default=_nowhere)
    """Whether a rank runs on the coordinator's node (a local death is the node's, not the network's)."""


class RunControl(Protocol):
    """The run-wide actions a component may take, each owned by the core (ControlCore implements them): the one way
    the phase changes, the one place a reduce fires, and the two ways a run ends early."""

    def enter(self, phase: Phase) -> None:
        """Move to ``phase`` (the lifecycle checks the transition; dispatch's gate follows it)."""

    def shutdown(self) -> None:
        """Tell every rank to go (with the failure, if any)."""

    def shutdown_with_save(self, reason: str, detail: str) -> None:
        """Unrecoverable: every survivor saves its bundle pieces, the meta records why, the run ends FAILED."""

    def fire_reduce(self, *, final: bool = False) -> bool:
        """Start a reduce over the live ranks (a consensus one when ``final``); False when one is in flight."""
