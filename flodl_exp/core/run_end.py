"""Evals and the end of the run: the periodic (and asked-for) evals, the user's eval and stop intents, the
final consensus, the final eval and bundle, and the moment the run is complete.

These decisions share one state, :class:`EvalState` (which rank runs an eval now, the final eval's rank, the
final consensus taken), and one number, the run's epoch count, which ``w.request_stop()`` shortens: so they
live together, apart from the tick and the reduce machinery (core/control_core.py, core/reduces.py). The
component owns the epoch count; the stop rule passes the shortened count to every component that reads it
(dispatch, callback slack, checkpoints, the bundle meta). What it needs of the core it is given: the
components it reads, and the core's run-wide actions (``enter``, ``shutdown``, ``fire_reduce``: core/seams.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from flodl_exp import events as ev
from flodl_exp.core.callback_slack import CallbackSlack
from flodl_exp.core.checkpoint_fn import CheckpointFnRole
from flodl_exp.core.checkpoints import BundleWriter
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.epoch_plan import EpochPlan
from flodl_exp.core.intents import Intents
from flodl_exp.core.lifecycle import TRAINING_PHASES, Lifecycle, Phase, Status
from flodl_exp.core.seams import Ports, RunControl
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import INTENT_KINDS, EvalBroadcast, EvalResult, ExecuteEval, Intent, Save

log = logging.getLogger("flodl_exp.coordinator")


@dataclass
class EvalState:
    """Periodic evals and the end of the run: what is running where."""

    pending: Optional[int] = None
    """nccl: the rank running a periodic eval; no collective starts until it answers (its peers would wait in
    the all_reduce for as long as the eval takes)."""
    pending_epoch: Optional[int] = None
    """The epoch whose periodic eval is running (with ``pending``)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    final_rank: Optional[int] = None
    """Finishing: the rank running the final eval and writing the consensus model (None once it reported)."""
    final_overwrite_done: bool = False


@dataclass(frozen=True)
class RunEndSettings:
    """What the run's end depends on besides the run's state."""

    world_size: int
    blended: bool
    """EASGD: replicas are blends of the average, so the final consensus is taken even with no step since."""
    mode: Mode


class RunEnd:
    """Evals, intents, the stop rule and the run's end; see the module docstring."""

    def __init__(self, *, settings: RunEndSettings, epochs: EpochPlan, life: Lifecycle, cohort: Cohort,
                 cycle: AveragingCycle, dispatch: Dispatcher, writer: BundleWriter, checkpoint_fn: CheckpointFnRole,
                 slack: CallbackSlack, intents: Intents, ports: Ports, run: RunControl) -> None:
        self._plan = epochs
        """The run's epoch count, shared with dispatch, slack, checkpoints and the writer (core/epoch_plan.py)."""
        self._evals = EvalState()
        self._w = settings.world_size
        self._blended = settings.blended
        self._mode = settings.mode
        self._life = life
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._writer = writer
        self._checkpoint_fn = checkpoint_fn
        self._slack = slack
        self._intents = intents
        self._out = ports.out
        self._obs = ports.obs
        self._run = run
        """The core's run-wide actions: the phase change to finishing, the shutdown, the final consensus reduce."""

    @property
    def epochs(self) -> int:
        """The run's epoch count (the shared :class:`EpochPlan`: lowered once by a stop)."""
        return self._plan.epochs

    # -- evals -----------------------------------------------------------------------------
    def send_eval(self, e: int) -> bool:
        """A periodic (or asked-for) eval of epoch e on the callback rank; False when that rank is dead. nccl:
        no collective starts until it answers (``evals.pending``)."""
        cb = self._cohort.callback_rank
        if not self._cohort.alive(cb):
            return False
        self._evals.pending, self._evals.pending_epoch = cb, e
        self._obs.on_eval_sent(cb, e)
        self._out.send(cb, ExecuteEval(epoch=e))
        return True

    @property
    def eval_pending(self) -> Optional[int]:
        """The periodic eval in flight (its epoch), if any."""
        return self._evals.pending

    def eval_outcome(self) -> dict[str, Any]:
        """The evals' part of the run's outcome: the final eval's metrics and every periodic eval's."""
        return {"final_eval": self._evals.final, "evals": self._evals.history}

    def eval_holds_sync(self) -> bool:
        """nccl: a periodic eval is running on a live rank, so no collective may start yet."""
        r = self._evals.pending
        return self._mode.is_nccl and r is not None and self._cohort.alive(r)

    def callback_slack(self) -> dict[int, float]:
        """The slack to stage at this reduce (``AveragingCycle.stage_slack_from``)."""
        # The epoch whose last chunk is out; or, when it aggregated before this reduce finished (its chunks
        # done first, as in nccl cadence), the epoch whose eval is running now: the next window overlaps it.
        e = self._dispatch.closing_epoch(self._cohort.callback_rank)
        if e is None and self._evals.pending is not None:
            e = self._evals.pending_epoch
        due = self._slack.due(e, self._cohort.callback_rank)
        for r, ms in due.items():
            log.info("callback slack: rank %d gets %.0f ms less work in the window of the eval after epoch %s", r, ms, e)
            self._obs.emit(ev.CallbackSlack(rank=r, epoch=e, ms=ms))
        return due

    def on_eval(self, r: int, f: EvalResult) -> None:
        state = self._evals
        self._obs.on_eval_result(r, f.epoch, f.final)
        if not f.final:
            self._slack.on_elapsed(r, f.elapsed_ms, kind="eval")
        if not f.final and state.pending == r:
            state.pending = None
        if f.error:
            log.warning("eval on rank %d failed: %s", r, f.error)
            self._obs.set_tags({"eval_error": f.error})
        metrics = {f"eval/{k}": v for k, v in f.metrics.items()}
        if metrics:
            self._obs.log_metrics(metrics, f.epoch)
        state.history.append({"epoch": f.epoch, **metrics})
        self._obs.emit(ev.Eval(epoch=f.epoch, final=f.final, metrics=metrics))
        if not f.error:  # every rank hears it (a cooperative loop's w.poll_eval())
            self._out.broadcast(EvalBroadcast(epoch=f.epoch, metrics=dict(f.metrics), final=f.final))
        if f.final:
            state.final = metrics
            state.final_rank = None
            self.maybe_complete()

    # -- intents -----------------------------------------------------------------------------
    def on_intent(self, r: int, i: Intent) -> None:
        """The user's loop asked for an eval or a bundle: folded into the next boundary (an epoch's aggregation
        for an eval and, in non-progressive modes, a bundle; the next reduce finish for a progressive bundle)."""
        if i.kind not in INTENT_KINDS:
            log.warning("rank %d asked for %r: not an intent (one of %s): ignored", r, i.kind, ", ".join(INTENT_KINDS))
            return
        self._obs.emit(ev.IntentEvent(rank=r, kind=i.kind, epoch=i.epoch))
        if i.kind == "stop":
            if self._life.phase in TRAINING_PHASES:
                self.stop_early(r, i.epoch)
            return
        if self._life.phase not in TRAINING_PHASES or not self._intents.ask(i.kind, i.epoch):
            return  # the run's end (its final eval and bundle) answers it, or a boundary already did
        if i.kind == "eval" and self._intents.due("eval", self._dispatch.last_aggregated):
            # its boundary passed before the intent came (a sync loop asks once the next epoch's plan is in):
            # evaluate now, not an epoch late
            e = self._dispatch.last_aggregated
            self._intents.answer("eval", e)
            if e != self.epochs - 1 and self._evals.pending is None:
                self.send_eval(e)

    def stop_early(self, r: int, asked: int) -> None:
        """``w.request_stop()``: the furthest epoch started (no chunk of a later one is out) becomes the last, so
        every epoch the run trains is trained whole; then the run ends as at its planned end (the final reduce,
        eval and bundle; FINISHED). The final bundle's epoch is where it stopped: resuming it trains the rest."""
        d = self._dispatch
        last = max(asked, d.last_aggregated, *(e for e in d.accs if e > d.last_aggregated))
        if last + 1 >= self.epochs:
            return  # already the last epoch (or a later stop asked for less)
        log.info("rank %d asked to stop (in epoch %d): epoch %d is the last of %d planned", r, asked, last, self.epochs)
        self._plan.end_after(last)
        self._obs.set_tags({"stopped_early": f"after epoch {last} (asked by rank {r} in epoch {asked})"})
        self._obs.emit(ev.Stop(rank=r, asked_epoch=asked, last_epoch=last))

    # -- the end -----------------------------------------------------------------------------
    def drain_or_finish(self) -> None:
        """Every epoch aggregated: one last consensus reduce if replicas may differ, then the final eval and bundle."""
        if self._dispatch.any_in_flight():
            return  # a dead rank's picks are being retrained: the last reduce waits for them
        if not self._checkpoint_fn.settled:
            return  # a bundle's checkpoint_fn is owed (a failover): the final bundle does not start under it
        alive = self._cohort.alive_ranks()
        blended = self._blended and not self._evals.final_overwrite_done
        if self._w > 1 and (blended or self._cycle.any_steps(alive)):
            self._evals.final_overwrite_done = True
            self._run.fire_reduce(final=True)
        else:
            self.finish_run()

    def finish_run(self) -> None:
        """Every epoch aggregated and the last reduce settled: final eval and bundle, then shutdown."""
        self._run.enter(Phase.FINISHING)
        cb = self._cohort.primary()
        self._evals.final_rank = cb
        self._obs.on_eval_sent(cb, self.epochs - 1, final=True)
        self._out.send(cb, ExecuteEval(epoch=self.epochs - 1, final=True))
        self._writer.send_saves(self._writer.stem, model_rank=cb)

    def move_final(self, r: int) -> bool:
        """Rank ``r`` died while finishing: when it ran the final eval and owed the consensus model, both move
        to another survivor (True); False when it did not (its pieces are the writer's to settle)."""
        alive = self._cohort.alive_ranks()
        if not (self._life.is_(Phase.FINISHING) and self._evals.final_rank == r and alive):
            return False
        w = self._writer
        w.drop(r)
        cb = alive[0]
        w.expect(cb)
        self._evals.final_rank = cb
        self._obs.on_eval_sent(cb, self.epochs - 1, final=True)
        self._out.send(cb, ExecuteEval(epoch=self.epochs - 1, final=True))
        self._out.send(cb, Save(stem=w.stem, primary=True, model=True))
        return True

    def maybe_complete(self) -> bool:
        """Finishing, the final eval reported and every save settled: the run ends and the ranks are told (True)."""
        w = self._writer
        if not (self._life.is_(Phase.FINISHING) and self._evals.final_rank is None and w.settled):
            return False
        w.write_meta("completed", w.stem, epoch=self.epochs)
        err = w.failed.get(w.stem)
        if err:  # the final bundle could not be written: the run says so rather than end FINISHED on nothing
            self._life.end(Status.FAILED, f"bundle {w.stem} failed: {err}", end_reason="bundle_failed")
        else:
            self._life.end(Status.FINISHED)
        self._run.shutdown()
        return True
