"""Epoch aggregation: each epoch whose every pick was trained is closed in order, and its boundary answered.

An aggregated epoch's metrics (the ranks' reductions, the step count, the live ranks, the anchor) are recorded
and broadcast; then its boundary decides what runs there: a periodic or asked-for eval (not after the last
epoch, whose final eval answers every intent) and, in non-progressive modes, a periodic, at_epoch or asked-for
bundle, which holds the next epoch (CHECKPOINTING) until it is written. Kept apart from the core because it is
one rule with one input (``Dispatcher.pop_aggregated``) that the tick's step 10 applies; the eval itself and
the run's epoch count belong to core/run_end.py, which it is given.
"""
from __future__ import annotations

from flodl_exp import events as ev
from flodl_exp.core.checkpoints import Checkpoints
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.intents import Intents
from flodl_exp.core.lifecycle import TRAINING_PHASES, Lifecycle, Phase
from flodl_exp.core.run_end import RunEnd
from flodl_exp.core.seams import Ports, RunControl
from flodl_exp.protocol.messages import EpochAggregated


class EpochBoundaries:
    """Aggregating epochs and answering their boundaries; see the module docstring."""

    def __init__(self, *, eval_every: int, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle,
                 dispatch: Dispatcher, checkpoints: Checkpoints, intents: Intents, run_end: RunEnd,
                 ports: Ports, run: RunControl) -> None:
        self._eval_every = eval_every
        self._life = life
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._checkpoints = checkpoints
        self._intents = intents
        self._run_end = run_end
        self._out = ports.out
        self._obs = ports.obs
        self._run = run

    def aggregate(self) -> None:
        """Close every epoch ready to aggregate, in order, until a bundle holds the next one."""
        while self._life.phase in TRAINING_PHASES:
            agg = self._dispatch.pop_aggregated()
            if agg is None:
                return
            self._on_epoch_aggregated(agg.epoch, agg.metrics)
            if self._life.is_(Phase.CHECKPOINTING):
                return  # the next epoch waits for the bundle
            self._dispatch.advance()

    def _on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        metrics["global_step"] = float(self._cycle.global_step)
        metrics["alive_ranks"] = float(self._cohort.alive_count())
        anchor = self._cycle.anchor
        if anchor is not None:
            metrics["anchor"] = float(anchor)
        self._obs.on_epoch_aggregated(e, metrics)
        self._out.broadcast(EpochAggregated(epoch=e, metrics={k: v for k, v in metrics.items() if "/" not in k}))
        self._obs.emit(ev.Epoch(epoch=e, metrics=dict(metrics)))  # per-rank fields too: launch()'s metrics_fn and
        # RunHandle.latest_metrics() read this record, as the reference's EpochMetrics carries its per-rank vectors
        last = e == self._run_end.epochs - 1  # the final eval and bundle answer every intent
        periodic = self._eval_every > 0 and (e + 1) % self._eval_every == 0
        if (self._intents.due("eval", e) or periodic) and not last and self._run_end.send_eval(e):
            self._intents.answer("eval", e)
        # (progressive modes take both kinds of bundle at a reduce finish instead: Checkpoints.maybe_coverage_bundle)
        bundle = not last and not self._checkpoints.progressive and (
            self._intents.due("checkpoint", e) or self._checkpoints.periodic_due(e))
        if bundle or last:
            self._intents.answer("checkpoint", e)
        if last:
            self._intents.answer("eval", e)
        if bundle:
            self._checkpoints.begin_periodic(e)
            self._run.enter(Phase.CHECKPOINTING)
