"""What the ranks report beside training: errors, the epoch hook's result, exits, telemetry, loop notices.

The core records these (the cohort's books, the observer's tags, metrics and events) and decides on one
of them only: a cooperative loop's exception ends the run when ``cluster.loop_error`` is ``fail`` (a
ShutdownWithSave, given as a callable); otherwise the rank is lost when its process exits, which the
shell reports as a death. Kept apart from the core so that its message table routes decisions to the
components that make them and records to here.
"""
from __future__ import annotations

import logging

from flodl_exp import events as ev
from flodl_exp.core.callback_slack import CallbackSlack
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.ports import CoreObserver
from flodl_exp.core.seams import RunControl
from flodl_exp.protocol.messages import EpochFnResult, Exiting, LoopNotice, RankError, Telemetry

log = logging.getLogger("flodl_exp.coordinator")


class RankReports:
    """The ranks' reports other than training's; see the module docstring."""

    def __init__(self, *, loop_error: str, cohort: Cohort, dispatch: Dispatcher, slack: CallbackSlack,
                 obs: CoreObserver, run: RunControl) -> None:
        self._loop_error = loop_error
        """cluster.loop_error: a cooperative loop's exception loses its rank, or fails the run."""
        self._cohort = cohort
        self._dispatch = dispatch
        self._slack = slack
        self._obs = obs
        self._run = run
        """The core's run-wide actions (a loop error that fails the run saves and stops)."""

    def on_error(self, r: int, e: RankError) -> None:
        self._cohort.record_error(r, {"error": e.error, "traceback": e.traceback})
        log.error("rank %d reported: %s", r, e.error)
        if not e.loop:
            return
        # the user's own loop raised (cluster.loop_error): a lost rank (its process exits; the survivors recover
        # when its connection closes), or the end of the run
        self._obs.set_tags({f"loop_error.rank{r}": f"{e.error}\n{e.traceback}"[:5000]})
        if self._loop_error == "fail":
            self._obs.set_tags({"error": f"rank {r}: {e.error}\n{e.traceback}"[:5000]})
            self._run.shutdown_with_save("loop_error", f"rank {r}'s training loop raised {e.error}\n{e.traceback}")

    def on_epoch_fn(self, r: int, f: EpochFnResult) -> None:
        self._slack.on_elapsed(r, f.elapsed_ms, kind="epoch_fn")
        if f.error:
            log.warning("experiment.epoch_fn on rank %d before epoch %d failed: %s", r, f.epoch, f.error)
            self._obs.set_tags({"epoch_fn_error": f.error[:5000]})
        self._obs.log_metrics({"epoch_fn/elapsed_ms": f.elapsed_ms, **{f"epoch_fn/{k}": v for k, v in f.metrics.items()}},
                              f.epoch)
        self._obs.emit(ev.EpochFn(rank=r, epoch=f.epoch, elapsed_ms=f.elapsed_ms, error=f.error, metrics=f.metrics))

    def on_exiting(self, r: int, x: Exiting) -> None:
        self._cohort.mark_exited(r, {"rank": x.rank, "pid": x.pid, "hash": x.hash, "steps": x.steps,
                                     "global_step": x.global_step})

    def on_telemetry(self, r: int, t: Telemetry) -> None:
        d = self._dispatch
        if d.on_telemetry(r, t) is None and d.last_aggregated >= 0:
            # No epoch open (the run's tail, or epochs shorter than a report): the last epoch gets it.
            self._obs.log_metrics({f"rank{r}/{k}": v for k, v in t.values().items()}, d.last_aggregated)

    def on_loop_notice(self, r: int, n: LoopNotice) -> None:
        log.error("%s", n.message)
        self._obs.set_tags({f"loop_warning.rank{r}": n.message[:4000]})
        self._obs.emit(ev.LoopStalled(rank=r, held_s=n.held_s, message=n.message))
