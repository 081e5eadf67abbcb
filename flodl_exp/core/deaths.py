"""A rank's death, as it reaches the work in progress.

The fault rules, the recovery plan (picks to the survivors, a regroup on nccl) and ShutdownWithSave are
:class:`~.faults.FaultHandler`'s. What a death then does to the rest of the run is here, in the order the
core applies it: while a bundle is being written (finishing, ShutdownWithSave, preemption) only that
bundle's pieces, its ``checkpoint_fn`` and the final eval move to a survivor; in training, after recovery,
the picks it had trained are reported retrained or lost, a bundle in progress stops waiting for it, and the
reduce in flight is finished without it. Kept apart from the core so that one death reads in one place;
what it needs of the core (settling saves, finishing a reduce) it is given as callables.
"""
from __future__ import annotations

from collections.abc import Callable

from flodl_exp import events as ev
from flodl_exp.core.checkpoint_fn import CheckpointFnRole
from flodl_exp.core.checkpoints import BundleWriter
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.faults import FaultHandler
from flodl_exp.core.lifecycle import Lifecycle, Phase
from flodl_exp.core.ports import CoreObserver
from flodl_exp.core.reduces import Reduces
from flodl_exp.core.run_end import RunEnd


class Deaths:
    """What a death does to the work in progress; see the module docstring."""

    def __init__(self, *, life: Lifecycle, faults: FaultHandler, dispatch: Dispatcher, writer: BundleWriter,
                 checkpoint_fn: CheckpointFnRole, run_end: RunEnd, obs: CoreObserver, reduces: Reduces,
                 after_saves: Callable[[], None]) -> None:
        self._life = life
        self._faults = faults
        self._dispatch = dispatch
        self._writer = writer
        self._checkpoint_fn = checkpoint_fn
        self._run_end = run_end
        self._obs = obs
        self._after_saves = after_saves
        """The core's ``after_saves``: a bundle whose pieces are all in (or forfeit) is concluded."""
        self._reduces = reduces

    def on_death(self, r: int, reason: str) -> None:
        """Rank ``r`` is gone (its connection closed, its heartbeat went stale, it was evicted): recover
        without it (its picks to the survivors, a regroup on nccl, the reduce in flight finished without it),
        or end the run with a bundle when the loss is unrecoverable (algorithms.md 7)."""
        death = self._faults.record_death(r, reason)
        if death is None or self._life.ending:
            return
        if self._life.is_(Phase.FINISHING, Phase.SAVING, Phase.PREEMPTING):
            self._drop_pending_of(r)
            return
        lost, retrained = self._dispatch.lost_picks, self._dispatch.retrained_picks
        if not self._faults.recover(death):
            return
        self._report_picks_of_the_dead(r, lost, retrained)
        owed_fn = self._checkpoint_fn.on_rank_dead(r)  # its checkpoint_fn result moves to another live rank
        if r in self._writer.pending:  # a bundle in progress (periodic, coverage) does not wait for its pieces
            self._writer.on_rank_dead(r)
            self._after_saves()
        elif owed_fn:
            self._after_saves()
        self._reduces.try_finish()

    def _report_picks_of_the_dead(self, r: int, lost_before: int, retrained_before: int) -> None:
        """What a death did to trained picks of epochs already aggregated: retrained by the survivors (an event),
        or, with none left to do it, lost, which the run says in a metric, a tag and its result."""
        d = self._dispatch
        if d.retrained_picks > retrained_before:
            self._obs.emit(ev.Retrain(rank=r, picks=d.retrained_picks - retrained_before))
        if d.lost_picks > lost_before:
            self._obs.set_tags({"lost_picks": d.lost_picks})
            self._obs.log_metrics({"lost_picks": float(d.lost_picks)}, d.current_epoch())
            self._obs.emit(ev.LostPicks(rank=r, picks=d.lost_picks - lost_before))

    def _drop_pending_of(self, r: int) -> None:
        """A rank died while a bundle was being written: its pieces are forfeit; the final eval and the
        consensus model move to another survivor."""
        self._checkpoint_fn.on_rank_dead(r)
        if not self._run_end.move_final(r):
            self._writer.on_rank_dead(r)  # a model piece it owed moves to another survivor
            self._after_saves()
