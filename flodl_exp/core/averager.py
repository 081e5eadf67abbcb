"""The control core's averaging port: the cpu backend's consensus of the ranks' snapshots.

The core decides when a reduce fires, who is in it, what each rank's mass is worth and what every rank is sent;
the arithmetic on tensors (the weighted average, each replica's relative drift, the outer optimizer's step) is
the :class:`Averager`'s, so the core never imports torch. The shell's implementation is
:class:`~.cpu_averager.TorchAverager` (the coordinator and the simulator); a test may bring its own.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from flodl_exp.outer_step import OuterStep
from flodl_exp.protocol.messages import NodePartial, Snapshot


@dataclass(frozen=True)
class Consensus:
    """One reduce's answer (algorithms.md 4.1-4.4)."""

    tensors: Optional[Mapping[str, Any]]
    """The consensus frame every rank adopts (``p<i>`` parameters after the outer step, ``b<j>`` buffers);
    None when nobody moved (total mass 0): each rank keeps its own state."""
    drift: Sequence[tuple[float, Optional[float]]] = ()
    """Per snapshot, in the order given: (||replica - consensus|| / ||consensus||, ||replica||)."""
    post: Optional[float] = None
    """||consensus|| (before the outer step), the same for every rank."""
    outer: Optional[OuterStep] = None
    """The outer optimizer's step (None: outer=avg, or a round nobody moved in)."""
    leader_tensors: Optional[Mapping[str, Any]] = None
    """With node partials: the frame node leaders are sent (``tensors``, and the average before the outer step as
    ``c<i>`` when one stepped, for their drift read-out)."""


class Averager(Protocol):
    """The cpu backend's tensor arithmetic, and the outer optimizer's state that lives with it."""

    def average(self, snapshots: Sequence[Snapshot], *, gamma: float, idle_mean: bool,
                partials: Sequence[NodePartial] = ()) -> Consensus:
        """The mass-weighted consensus of ``snapshots`` and the node ``partials`` (mass ``n ** gamma``; the
        partials' ranks are none of the snapshots'). ``idle_mean``: when nobody moved, the plain mean instead of
        no consensus (EASGD's final round), with no outer step. ``drift`` covers ``snapshots`` only: a partial's
        ranks are measured by their leader (NodeDrift)."""
        ...

    def outer_state(self) -> dict[str, Any]:
        """The outer optimizer's state, for the bundle's ``.outer.pt`` sidecar."""
        ...

    def restore_outer(self, state: dict[str, Any]) -> float:
        """Load a sidecar's state; the momentum's norm (for the log)."""
        ...
