"""LR-aware meta-controller (``LrEventMeta``, algorithms.md section 6.6).

Sits above ElChe and the convergence guard. Once per reduce it sees the LR
(first rank that reported one), ElChe's anchor, the guard's verdict and ElChe's
phase, and may shrink the anchor. It exists because ElChe's overhead auto-tune
reacts too slowly to two events: a sharp LR drop (a scheduler step changes the
drift regime before the divergence shows) and a guard that keeps objecting
cycle after cycle. Recovery is left to ElChe's own feedback; this layer only
adds reactive nudges. Pure logic, no I/O; not persisted in checkpoints.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.policy.actions import ConvergenceAction, nudge_down

PHASES = ("probe", "warmup", "stable", "mature")

# Per-phase sustain count K and base factor of the convergence watcher:
# low-trust phases want more evidence and then react harder; trusted phases
# react sooner and more gently.
SUSTAIN_K = {"warmup": 5, "stable": 3, "mature": 2}
BASE_FACTOR = {"warmup": 0.3, "stable": 0.5, "mature": 0.7}
# The LR-cliff watcher always starts from "halve the anchor".
LR_CLIFF_BASE_FACTOR = 0.5

_OBJECTING = ("nudge_down", "suppress_growth")


@dataclass(frozen=True)
class LrEventMetaConfig:
    """Window sizes, cliff threshold and factor clamps (reference defaults)."""

    lr_window_cap: int = 3
    anchor_window_cap: int = 5
    guard_window_cap: int = 5  # must cover the longest sustain (K = 5 in warmup)
    sharp_drop_threshold: float = 0.3  # catches MultiStep 5x/10x drops, not cosine decay
    effective_factor_min: float = 0.1
    effective_factor_max: float = 0.95

    def __post_init__(self) -> None:
        for name in ("lr_window_cap", "anchor_window_cap", "guard_window_cap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"meta {name}: expected an integer >= 1, got {v!r}")
        if not 0.0 < self.effective_factor_min <= self.effective_factor_max <= 1.0:
            raise ValueError(
                "meta effective_factor_min/max: expected 0 < min <= max <= 1, got "
                f"{self.effective_factor_min!r}/{self.effective_factor_max!r}"
            )


def _phase_name(phase: Any) -> str:
    """Accept ElChe's Phase enum or its string value."""
    name = str(getattr(phase, "value", phase)).lower()
    if name not in PHASES:
        raise ValueError(f"meta phase: unknown {phase!r} (expected one of: {', '.join(PHASES)})")
    return name


class LrEventMeta:
    """Two watchers, one actuator (``nudge_anchor_down``).

    * LR-cliff watcher (precautionary): the LR fell by more than
      ``sharp_drop_threshold`` of its previous value in one cycle.
    * Convergence watcher (corrective): the last K guard verdicts were all
      NudgeDown or SuppressGrowth, K depending on the phase.

    Each factor is corrected by the anchor trend so the meta layer does not
    pile on while ElChe is already shrinking the anchor, and pushes harder
    while the overhead auto-tune is climbing. Phases modulate, they do not
    gate, except Probe (no calibration yet, every signal is noise).
    """

    def __init__(self, config: Optional[LrEventMetaConfig] = None) -> None:
        self.config = config or LrEventMetaConfig()
        self._lr: deque[float] = deque(maxlen=self.config.lr_window_cap)
        self._anchor: deque[float] = deque(maxlen=self.config.anchor_window_cap)
        self._guard: deque[ConvergenceAction] = deque(maxlen=self.config.guard_window_cap)

    @property
    def lr_window(self) -> tuple[float, ...]:
        return tuple(self._lr)

    @property
    def anchor_window(self) -> tuple[float, ...]:
        return tuple(self._anchor)

    @property
    def guard_window(self) -> tuple[ConvergenceAction, ...]:
        return tuple(self._guard)

    def reset(self) -> None:
        self._lr.clear()
        self._anchor.clear()
        self._guard.clear()

    def observe(
        self, lr: float, anchor: float, verdict: ConvergenceAction, phase: Any
    ) -> Optional[ConvergenceAction]:
        """Record one cycle and return a ``nudge_down`` action, or None (Noop).

        The windows are filled even in Probe so the first post-probe cycle
        already sees real history. When both watchers fire, the two effective
        factors compound (product, clamped again).
        """
        name = _phase_name(phase)
        self._lr.append(float(lr))
        self._anchor.append(float(anchor))
        self._guard.append(verdict)
        if name == "probe":
            return None
        trend = self.anchor_trend()
        cliff = self._effective(LR_CLIFF_BASE_FACTOR, trend) if self._sharp_drop() else None
        conv = self._effective(BASE_FACTOR[name], trend) if self._sustained(SUSTAIN_K[name]) else None
        if cliff is not None and conv is not None:
            return nudge_down(self._clamp(cliff * conv))
        factor = cliff if cliff is not None else conv
        if factor is not None:
            return nudge_down(factor)
        return None

    def anchor_trend(self) -> float:
        """``(anchor_now - mean) / mean`` over the anchor window, current
        anchor included. Negative: ElChe already shrank the anchor (dampen);
        positive: the auto-tune is climbing (amplify). 0 with < 2 samples or
        a non-positive mean."""
        if len(self._anchor) < 2:
            return 0.0
        mean = sum(self._anchor) / len(self._anchor)
        if mean <= 0.0:
            return 0.0
        return (self._anchor[-1] - mean) / mean

    def _sharp_drop(self) -> bool:
        """Single-cycle relative LR drop above the threshold; rises never fire."""
        if len(self._lr) < 2:
            return False
        prev, now = self._lr[-2], self._lr[-1]
        if not prev > 0.0 or not now < prev:
            return False
        return (prev - now) / prev > self.config.sharp_drop_threshold

    def _sustained(self, k: int) -> bool:
        """The last ``k`` verdicts all objected; one noisy verdict never fires."""
        if len(self._guard) < k:
            return False
        recent = list(self._guard)[-k:]
        return all(v.kind in _OBJECTING for v in recent)

    def _effective(self, base: float, trend: float) -> float:
        """``base - (1 - base) * trend``, clamped: symmetric around trend 0."""
        return self._clamp(base - (1.0 - base) * trend)

    def _clamp(self, f: float) -> float:
        return min(self.config.effective_factor_max, max(self.config.effective_factor_min, f))
