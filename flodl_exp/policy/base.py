"""What an averaging policy answers, as one object: the base class every policy (built-in or a user's) derives.

Every question the control core, the dispatcher, the config rules and the simulator ask about "when are
replicas averaged" is a member here, answered from the policy alone (and, where it matters, the backend), so a
rule for a policy lives in that policy's class and nowhere else. The defaults are cadence's: each rank steps
its ElChe count, then the replicas are averaged; epochs advance in lockstep.
"""
from __future__ import annotations

from typing import ClassVar, Optional

from flodl_exp.policy.backend import Backend


class AveragingPolicy:
    """Subclass, set :attr:`name`, override what differs from the defaults, and register an instance
    (:func:`flodl_exp.policy.registry.register_policy`)."""

    name: ClassVar[str] = ""
    """The ``mode.policy`` value (a mode is named ``<backend>_<name>``)."""

    window_grows: ClassVar[bool] = True
    """ElChe sizes windows of several steps from measured speed (sync: always one step)."""

    barrier_paced: ClassVar[bool] = True
    """Epochs advance in lockstep: no rank starts the next epoch's work before the others (async streams on)."""

    progressive_by_default: ClassVar[bool] = True
    """Chunks come from a pool sized to each rank's window unless ``mode.progressive_dispatch`` says otherwise."""

    requires_progressive: ClassVar[bool] = False
    """``mode.progressive_dispatch=false`` is an error (the policy streams chunks)."""

    streams: ClassVar[bool] = False
    """A rank may train past its count by an overshoot budget the guard's verdicts tune (``mode.max_overshoot``),
    the window may relax upward on the guard's word (``mode.relax_up``), and work streams across the epoch
    boundary within that budget."""

    default_anchor: ClassVar[int] = 10
    """ElChe's first window (``mode.anchor``) when a preset does not say (the simulator's unnamed modes)."""

    def window_target(self, count: int) -> int:
        """Steps a rank must have taken since the last reduce for the gate to count it as arrived, given its
        ElChe count."""
        return count

    def reduce_budget(self, count: int, overshoot: int) -> int:
        """Steps a rank with ``count`` may run between reduces (chunks never cross it); 0: no barrier."""
        if count == 0:
            return 0
        return count + overshoot if self.streams else count

    def unavailable_with(self, backend: Backend) -> Optional[str]:
        """Why this policy cannot run on ``backend`` (one line for the config error), or None when it can."""
        return None

    def guard_capable(self, backend: Backend) -> bool:
        """The convergence guard's verdict may reshape the window (ElChe's delivered timings are coherent)."""
        return True

    def lockstep_capable(self, backend: Backend) -> bool:
        """Every reduce is one step of every rank, so the ranks may run reduces on their own
        (``mode.lockstep_ahead``) instead of waiting for the coordinator's ``sync_now``."""
        return False

    def overlap_capable(self, backend: Backend) -> bool:
        """``mode.overlap``: a rank may train its next window while its answer is averaged (windows of several steps:
        the coordinator averages a cpu snapshot; an nccl all-reduce runs on the rank beside its training)."""
        return self.window_grows

    def folds_updates(self, backend: Backend, progressive: bool) -> bool:
        """Each rank's next chunk rides in its consensus update (algorithms.md 5.6)."""
        return False

    def default_easgd_alpha(self, backend: Backend) -> Optional[float]:
        """The EASGD blend weight when ``mode.easgd_alpha`` is unset; None: the consensus overwrites. A policy
        with a default here is the only one that accepts ``mode.easgd_alpha``."""
        return None

    def paces_reports(self, backend: Backend) -> bool:
        """Ranks may coalesce their batch reports (``report_pace``): the gate waits for a count of several
        steps, not for every single one."""
        return True

    def __repr__(self) -> str:
        return f"<averaging policy {self.name!r}>"

    def __str__(self) -> str:
        return self.name
