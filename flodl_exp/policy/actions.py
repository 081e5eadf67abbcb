"""Convergence actions: the verdict a guard hands the coordinator after a reduce.

Shared by the guards (which produce them), the LR meta-controller and ElChe
(which consume them), so it lives apart from all three.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["stable", "suppress_growth", "nudge_down"]


@dataclass(frozen=True)
class ConvergenceAction:
    """``stable`` | ``suppress_growth`` (hold anchor/overshoot growth) |
    ``nudge_down`` (multiply the anchor by ``factor``, e.g. 0.5 halves it)."""

    kind: ActionKind
    factor: float = 1.0

    @property
    def code(self) -> int:
        """Numeric code for metrics: 0 stable, 1 suppress_growth, 2 nudge_down."""
        return {"stable": 0, "suppress_growth": 1, "nudge_down": 2}[self.kind]


STABLE = ConvergenceAction("stable")
SUPPRESS_GROWTH = ConvergenceAction("suppress_growth")


def nudge_down(factor: float) -> ConvergenceAction:
    return ConvergenceAction("nudge_down", float(factor))
