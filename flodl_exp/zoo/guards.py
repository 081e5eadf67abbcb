"""An example convergence guard of your own (``guard._target_``): the Guard protocol of flodl_exp.policy.guards.

    python -m flodl_exp guard._target_=flodl_exp.zoo.guards.PatienceGuard +guard.args.patience=2

Copy it into your project and change the rule; only ``report`` is required.
"""
from __future__ import annotations

from typing import Any

from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, ConvergenceAction, nudge_down
from flodl_exp.policy.guards import DivergenceReport


class PatienceGuard:
    """Holds the window's growth once the worst replica drift rose ``patience`` reduces in a row, and halves the
    window when it also exceeds ``ceiling``; stable otherwise. Its streak is kept in bundles (state_dict)."""

    def __init__(self, patience: int = 3, ceiling: float = 0.5) -> None:
        if patience < 1:
            raise ValueError(f"patience={patience}: at least 1")
        self.patience, self.ceiling = int(patience), float(ceiling)
        self.last: float | None = None
        self.streak = 0

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> ConvergenceAction:
        d = report.max_relative_delta()
        self.streak = self.streak + 1 if self.last is not None and d > self.last else 0
        self.last = d
        if self.streak < self.patience:
            return STABLE
        return nudge_down(0.5) if d > self.ceiling else SUPPRESS_GROWTH

    def telemetry(self) -> list[tuple[str, float]]:
        return [("patience_streak", float(self.streak))]

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last, self.streak = state.get("last"), int(state.get("streak", 0))
