"""The reduce: the one place it fires, the gate's cheap test, the answers, and what its finish sets going.

``AveragingCycle.trigger`` refuses a second reduce in flight, and only :meth:`Reduces.fire` calls it, so the
rule "one reduce at a time, over the live ranks" is written once: the tick's gate (core/control_core.py), the end
of training (core/run_end.py) and a bundle's or preemption's consensus (core/checkpoints.py,
core/preemption.py, given the core's ``fire_reduce``) all ask here. A reduce finishes when every member
answered, or, after a death, when the cycle says the survivors' answers suffice; its finish moves dispatch
(held chunks, the next window's counts, the verdict), lets an armed preemption snapshot first, and takes a
progressive mode's coverage bundle. Kept apart from the core so that the tick reads as the order of steps
and this reads as one reduce's life.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

from flodl_exp import events as ev
from flodl_exp.core.checkpoints import Checkpoints
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle, Reduce, ReduceOutcome
from flodl_exp.core.dispatch import AnswerSnapshot, Dispatcher
from flodl_exp.core.lifecycle import TRAINING_PHASES, Lifecycle
from flodl_exp.core.seams import Ports
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import Lockstep, NodeDrift, NodePartial, Snapshot, SyncAck

log = logging.getLogger("flodl_exp.coordinator")


class Reduces:
    """Firing and finishing reduces; see the module docstring."""

    def __init__(self, *, mode: Mode, fold_updates: bool, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher,
                 checkpoints: Checkpoints, ports: Ports, preempt_snapshot: Callable[[], bool],
                 may_run_ahead: Callable[[], bool] = lambda: False,
                 preempt_armed: Callable[[], bool] = lambda: False) -> None:
        self._mode = mode
        self._fold_updates = fold_updates
        """cpu cadence: each rank's next chunk rides in its Update (algorithms.md 5.6)."""
        self._life = life
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._checkpoints = checkpoints
        self._out = ports.out
        self._obs = ports.obs
        self._clock = ports.clock
        self._preempt_snapshot = preempt_snapshot
        """``Preemption.on_reduce_finished``: True when an armed preemption takes the coverage now (no new chunk)."""
        self._may_run_ahead = may_run_ahead
        """The core's test that the lockstep license may be extended (nothing needs the cohort held soon)."""
        self._preempt_armed = preempt_armed
        """``Preemption.armed``: a request waits for a reduce finish to snapshot the coverage."""
        self._deaths_at_trigger = 0
        self._blocker: Optional[int] = None
        self._early_answers: dict[int, dict[int, AnswerSnapshot]] = {}
        """Per later lockstep reduce (version), each early answerer's training progress when its answer came."""

    def fire(self, *, final: bool = False) -> bool:
        """Start a reduce over the live ranks (a consensus one when ``final``); False when one is in flight
        (the caller asks again at the next tick). Every reduce of the run starts here: the gate in the core's
        tick, the end of training, and the requests for a bundle's consensus or preemption."""
        if self._cycle.in_flight is not None:
            return False
        if final or not self._cycle.overlap:
            self._cycle.trigger(self._cohort.alive_ranks(), final=final)
        else:
            with self._out.coalescing():  # overlapped: a rank's request and its next chunk leave in one frame
                self._cycle.trigger(self._cohort.alive_ranks())
                self._dispatch.on_overlapped_trigger()
        self._deaths_at_trigger = len(self._cohort.deaths)
        return True

    def gate_blocked(self, alive: list[int]) -> bool:
        """A cheap necessary condition for the gate to stay shut: a rank training a chunk below its count (not
        hit, not throttled, not quiesced). The last one found is checked first, so the gate costs O(1) a batch
        while it waits for it, where :meth:`AveragingCycle.should_average` scans every rank."""
        led = self._cycle.ledger
        target = self._mode.window_target
        counts = self._cycle.counts_view
        out = self._dispatch.chunks_by_rank  # chunks in flight per rank (Dispatcher.in_flight, indexed)
        b = self._blocker
        if (b is not None and self._cohort.alive(b) and out[b] > 0 and not led[b].throttled
                and led[b].steps < target(counts[b])):
            return True
        for r in alive:
            if out[r] > 0 and not led[r].throttled and led[r].steps < target(counts[r]):
                self._blocker = r
                return True
        self._blocker = None
        return False

    # -- answers ---------------------------------------------------------------------------
    def _answered(self, r: int) -> None:
        red = self._cycle.in_flight
        if red is not None and r in red.members:
            self._obs.on_answer(r, red.started)

    def on_ack(self, r: int, ack: SyncAck) -> None:
        red = self._cycle.in_flight
        if self._cycle.on_ack(r, ack) or (red is not None and ack.version is None):
            self._answered(r)
            self._dispatch.on_answer(r)
        elif ack.version is not None and self._cycle.answers_ahead(ack.version):
            # an answer to a later lockstep reduce: what the rank had trained by now is what that answer holds
            self._early_answers.setdefault(ack.version, {})[r] = self._dispatch.answer_snapshot(r)
        self.try_finish()

    def on_snapshot(self, r: int, snap: Snapshot) -> None:
        if self._cycle.on_snapshot(r, snap):
            self._answered(r)
            self._dispatch.on_answer(r)
        self.try_finish()

    def on_partial(self, leader: int, p: NodePartial) -> None:
        """A node leader answers for its node's ranks (``cluster.node_reduce``): each is answered as by its own
        snapshot."""
        for r in self._cycle.on_partial(leader, p):
            self._answered(r)
            self._dispatch.on_answer(r)
        self.try_finish()

    def on_drift(self, leader: int, m: NodeDrift) -> None:
        """A node leader's drift read-out: the last one in finishes the reduce (the guard reads every rank's)."""
        self._cycle.on_drift(leader, m)
        self.try_finish()

    # -- the finish ------------------------------------------------------------------------
    def try_finish(self) -> None:
        """Finish the reduce in flight if its answers are in; with a lockstep license, the next one opens at once
        and may be complete already (the ranks run ahead): finish those too, in order."""
        for _ in range(1 + self._cycle.lockstep_ahead):  # bounded: a license covers at most that many reduces ahead
            if not self._finish_one():
                return

    def _finish_one(self) -> bool:
        red = self._cycle.in_flight
        if red is None:
            return False
        if len(self._cohort.deaths) == self._deaths_at_trigger:  # every member alive: all must have answered
            if red.awaiting is None and len(red.answered()) < len(red.members):
                return False
        version, t = self._cycle.version, self._clock()
        # A hierarchical reduce finishes when the leaders' drift is in, its updates long sent: what the finish sends
        # each rank (its next chunk, its pace, the global step) leaves in one frame a rank, as behind an update.
        with self._out.coalescing() if red.awaiting is not None else self._out.folding_updates(self._fold_updates):
            out = self._cycle.try_finish(self._cohort.alive)
            if out is not None:
                self._after_reduce(red, out, version, t)
        return out is not None

    def _after_reduce(self, red: Reduce, out: ReduceOutcome, version: int, averaging_from: float) -> None:
        d = self._dispatch
        for r in out.dead_in:  # overlapped: what it trained past its answer is in no consensus
            d.release_held(r, out.n.get(r, 0) if red.overlap else None)
        for r in out.dead_out:  # its answer is not in the consensus: the survivors redid the collective without it
            picks = d.retrain_held(r)
            log.warning("rank %d's share of the reduce it answered before it died is not in the consensus (nccl: the "
                        "survivors completed it in a later generation; cpu: its node leader's partial left it out): "
                        "its %d picks are trained again", r, picks)
            self._obs.emit(ev.Retrain(rank=r, picks=picks, why="answer_not_in_consensus"))
        speeds = self._cycle.calibrated_speeds()
        if speeds is not None:
            self._cohort.elect_fastest_once(speeds)
        if self._cycle.has_elche:
            d.on_verdict(out.action)
        # nccl, or overlapped: a rank trains on after its answer, and a chunk it finished since holds batches in no
        # consensus yet (overlapped: the ledger's steps now are each member's batches past its answer)
        d.on_reduce_finished(out.n, keep_after_answer=self._mode.is_nccl or red.overlap,
                             past={r: self._cycle.steps(r) for r in out.n} if red.overlap else None)
        self._obs.on_reduce_finished(red, out, version, averaging_from, d.current_epoch())
        d.on_sync(out.sync_ms, out.d_max, out.action.code, out.outer)
        ahead = self._cycle.version < self._cycle.lockstep_until  # the ranks are in the next reduce already
        if red.overlap and (self._preempt_armed() or self._checkpoints.coverage_bundle_due()):
            # An overlapped consensus lacks what the ranks trained past their answers (the picks a bundle would call
            # covered): a barrier reduce now, the bundle at its finish, before any new chunk.
            self.fire(final=True)
            return
        if not ahead and self._preempt_snapshot():
            return  # an armed preemption snapshots the coverage now: no new chunk
        if self._life.phase in TRAINING_PHASES and not ahead:  # no bundle of a reduce the ranks are already past
            self._checkpoints.maybe_coverage_bundle()
        d.after_finish()
        self._lockstep()

    def _lockstep(self) -> None:
        """nccl_sync with ``mode.lockstep_ahead``: extend the ranks' license while nothing needs the cohort held, and
        open the next reduce when it is below the license (the ranks start it on their own, without a sync_now)."""
        cyc = self._cycle
        if cyc.lockstep_ahead <= 0:
            return
        until = cyc.extend_lockstep(self._may_run_ahead())
        if until is not None:
            self._out.broadcast(Lockstep(until=until))
        if cyc.in_flight is None and cyc.version < cyc.lockstep_until:
            snapshots = self._early_answers.pop(cyc.version, {})
            answered = cyc.open_lockstep(self._cohort.alive_ranks())
            self._deaths_at_trigger = len(self._cohort.deaths)
            for r in answered:
                self._answered(r)
                self._dispatch.on_answer(r, snapshots.get(r))  # try_finish's loop finishes it if every answer is in
