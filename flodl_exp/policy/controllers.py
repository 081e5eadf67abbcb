"""The run's controllers built from the typed config: ElChe and the convergence guard
(the pure modules take plain arguments; the mapping from config keys lives here, once)."""
from __future__ import annotations

from typing import Any, Optional

from flodl_exp.policy.elche import ElChe
from flodl_exp.policy.guards import ConvergenceGuard, build_guard, build_user_guard
from flodl_exp.policy.mode import Mode


def build_elche(mode: Any, world_size: int) -> ElChe:
    e = ElChe(world_size, mode.anchor, overhead_target=mode.overhead_target, max_anchor=mode.max_anchor,
              min_anchor=mode.min_anchor, max_batch_diff=mode.max_batch_diff,
              window_growth_applicable=Mode.parse(mode.policy, mode.backend).window_grows)
    if mode.speed_hint_rank is not None:
        e.with_speed_ratio(int(mode.speed_hint_rank), float(mode.speed_hint_ratio))
    ratios = mode.partition_ratios
    if ratios:
        e.with_initial_anchor(min(range(world_size), key=lambda r: ratios[r]))
    return e


def build_run_guard(g: Any, alpha: Optional[float]) -> ConvergenceGuard:
    """The run's guard: the user's class (``guard._target_``, with ``guard.args``) or the built-in ``guard.kind``."""
    target = getattr(g, "_target_", None)
    if target:
        return build_user_guard(str(target), dict(getattr(g, "args", None) or {}))
    msf: dict[str, Any] = {}
    if g.kind == "msf":
        msf = {"msf_alpha": g.msf_alpha, "msf_suppress_threshold": g.suppress_threshold,
               "msf_suppress_sustain": g.suppress_sustain, "msf_nudge_threshold": g.nudge_threshold,
               "msf_nudge_sustain": g.nudge_sustain, "msf_nudge_factor": g.nudge_factor, "msf_nudge": g.nudge}
    return build_guard(g.kind, threshold=g.threshold, easgd_alpha=alpha, **msf)


def guard_name(g: Any) -> str:
    """What records call the run's guard: the user's class path, or the built-in kind (a bundle restores a guard's
    history only into a guard of the same name)."""
    target = getattr(g, "_target_", None)
    return str(target) if target else str(g.kind)
