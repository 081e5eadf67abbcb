"""Checkpoint bundles on the coordinator side (algorithms.md 8): who writes which piece, the
meta, and the periodic and coverage-granular bundles.

* :class:`BundleWriter` owns the saves in flight: it removes what an earlier save left under the
  stem, sends ``save`` to every live rank (the primary writes the model and ``.optim.pt``, the
  others ``.optim.r<N>.pt``), collects ``save_result``s, writes ``<stem>.meta.json`` last (listing
  the pieces written) and logs the pieces to MLflow. A bundle with a failed piece (a rank's save
  error, the model piece written nowhere, the meta write failing) gets no meta: it is recorded in
  :attr:`BundleWriter.failed`, logged, and tagged ``bundle_failed.<name>`` on the run.
* :class:`Checkpoints` owns ``checkpoint.every`` (after epoch e with (e+1) % N == 0 is
  aggregated, the next epoch is held, a consensus reduce settles every live rank's
  steps, the bundle is written, training resumes: exactly the consensus at the epoch
  boundary) and ``checkpoint.at_epoch`` (progressive modes: at the first reduce finish
  where a live rank has reached epoch E, the coverage of every open epoch is snapshotted,
  in-flight chunks counting as uncovered; resuming trains only the uncovered picks). With
  ``experiment.checkpoint_fn`` set, a periodic or requested bundle also runs it on its model-piece rank
  (:class:`~.checkpoint_fn.CheckpointFnRole`) and stays in progress until it reported or was given up.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from flodl_exp import events as ev
from flodl_exp.bundle_meta import BundleMeta, MetaCoverage
from flodl_exp.bundle_names import file_name, model_path, optim_path, outer_path
from flodl_exp.core.checkpoint_fn import CheckpointFnRole
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.epoch_plan import EpochPlan
from flodl_exp.core.intents import Intents
from flodl_exp.core.seams import Ports, RunControl
from flodl_exp.policy.mode import Mode, variant_name
from flodl_exp.protocol.messages import Save, SaveResult

log = logging.getLogger("flodl_exp.coordinator")


@dataclass(frozen=True)
class MetaFacts:
    """What every meta records about the run itself (fixed for the run)."""

    world_size: int
    experiment: str
    guard_kind: str
    batch_size: int
    shuffle_seed: int
    mode: Mode
    """The run's policy and backend (the meta's ``mode``; the cpu backend's saves are of the consensus)."""


class BundleWriter:
    def __init__(self, *, stem: str, facts: MetaFacts, plan: EpochPlan, cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher,
                 ports: Ports) -> None:
        self._stem = stem
        self._wall_clock = ports.wall_clock
        """Unix time, for the meta's ``unix_time`` (the shell's clock: the core reads none itself)."""
        self.facts = facts
        self._plan = plan
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._out = ports.out
        self._obs = ports.obs
        self._store = ports.store
        """The files: pieces removed, the outer sidecar and the meta written, artifacts logged."""
        self._pending: Counter[int] = Counter()
        """rank -> ``save_result``s outstanding for the bundle in progress (a retried piece adds one)."""
        self.stem_in_progress: Optional[str] = None
        self._model_rank: Optional[int] = None
        """The rank writing the bundle's model piece (a failed write moves to another live rank)."""
        self.model_tried: set[int] = set()
        self._failed: dict[str, str] = {}
        """stem -> why the bundle failed (no meta was written for it)."""
        self._expected: dict[int, deque[list[str]]] = {}
        """rank -> the pieces each of its outstanding saves writes (file names), in send order."""
        self._written: set[str] = set()
        self._errors: list[str] = []
        self._model_error: Optional[str] = None
        self._concluded: Optional[str] = None
        """The stem in progress once its saves settled and its outcome was decided."""
        self._deferred: dict[str, BundleMeta] = {}
        """Metas asked for before their pieces were written (ShutdownWithSave): written when they settle."""
        self.completed: set[str] = set()
        """Stems whose meta this writer wrote."""

    @property
    def stem(self) -> str:
        return self._stem

    @property
    def failed(self) -> dict[str, str]:
        return self._failed

    @property
    def model_rank(self) -> Optional[int]:
        return self._model_rank

    def stem_for(self, kind: str, epoch: Optional[int] = None) -> str:
        if kind == "final":
            return self._stem
        if kind == "epoch":
            return f"{self._stem}_epoch{epoch}"
        if kind == "at_epoch":
            return f"{self._stem}_at{epoch}"
        if kind == "requested":
            return f"{self._stem}_requested{epoch}"
        return f"{self._stem}_{kind}"

    @property
    def settled(self) -> bool:
        return not +self._pending

    @property
    def pending(self) -> list[int]:
        """Ranks with a save outstanding."""
        return sorted(r for r, n in self._pending.items() if n > 0)

    def _pieces(self, r: int, primary: bool, model: bool) -> list[str]:
        stem = self.stem_in_progress or self._stem
        names = [optim_path(stem, r, primary)]
        if model:
            names.insert(0, model_path(stem))
            if self._cycle.ranks_keep_outer_state:
                names.insert(1, outer_path(stem))  # the outer optimizer is replicated on the ranks
        return [file_name(n) for n in names]

    def _write_outer_sidecar(self, stem: str) -> None:
        """cpu backend: the outer optimizer's state lives here, so its sidecar is written here."""
        state = self._cycle.outer_state()
        if state is None:
            return
        try:
            name = self._store.save_outer(state, stem)
        except OSError as e:
            self._errors.append(f"the outer optimizer's sidecar could not be written ({e})")
            return
        self._written.add(name)

    def expect(self, r: int, *, primary: bool = True, model: bool = True) -> None:
        """One more ``save_result`` from ``r``; by default for a model + ``.optim.pt`` save (the coordinator's
        re-sent final model piece)."""
        self._pending[r] += 1
        self._expected.setdefault(r, deque()).append(self._pieces(r, primary, model))

    def _settle(self, r: int) -> None:
        if self._pending[r] > 0:
            self._pending[r] -= 1

    def send_saves(self, stem: str, *, model_rank: Optional[int] = None) -> None:
        alive = self._cohort.alive_ranks()
        primary = self._cohort.primary() if model_rank is None else model_rank
        self._pending = Counter()
        self._expected = {}
        self.stem_in_progress, self._model_rank, self.model_tried = stem, primary, {primary}
        self._written, self._errors, self._model_error, self._concluded = set(), [], None, None
        self._failed.pop(stem, None)
        self.completed.discard(stem)
        try:
            gone = self._store.remove_bundle(stem)  # before any piece is written: old and new pieces never mix
            if gone:
                log.warning("bundle %s: removed %d piece(s) of an earlier save", stem, len(gone))
        except OSError as e:
            self._errors.append(f"could not remove the earlier pieces: {e}")
        self._write_outer_sidecar(stem)
        for r in alive:
            self.expect(r, primary=r == primary, model=r == primary)
            self._out.send(r, Save(stem=stem, primary=r == primary, model=r == primary, consensus=self._consensus,
                                   reduces=self._cycle.version))

    @property
    def _consensus(self) -> bool:
        return self.facts.mode.is_cpu  # the consensus frame, not a blended replica

    def on_result(self, r: int, res: SaveResult) -> None:
        q = self._expected.get(r)
        pieces = q.popleft() if q else []
        current = res.stem == self.stem_in_progress
        if res.error:
            log.warning("rank %d could not save %s: %s", r, res.stem, res.error)
            self._obs.set_tags({f"save_error.rank{r}": str(res.error)[:2000]})
            if current:
                if r == self._model_rank:
                    self._model_error = f"rank {r}: {res.error}"  # recovered if another rank writes the model
                else:
                    self._errors.append(f"rank {r}: {res.error}")
        elif current:
            self._written.update(pieces)
        self._settle(r)
        if res.error and r == self._model_rank and current:
            self._retry_model_piece(res.stem, res.error)
        self._maybe_conclude()

    def _retry_model_piece(self, stem: str, error: str) -> None:
        """The model piece failed on its rank: write it from another live rank (its replica is the same
        consensus after a reduce), before the bundle gives up on it."""
        left = [q for q in self._cohort.alive_ranks() if q not in self.model_tried]
        if not left:
            log.error("bundle %s: no live rank could write the model piece (last error: %s)", stem, error)
            self._obs.set_tags({"save_failed": stem[-200:]})
            self._model_rank = None
            return
        q = left[0]
        self._model_rank = q
        self.model_tried.add(q)
        self.expect(q)
        log.warning("bundle %s: the model piece goes to rank %d instead", stem, q)
        self._out.send(q, Save(stem=stem, primary=True, model=True, consensus=self._consensus))

    def drop(self, r: int) -> None:
        self._pending.pop(r, None)
        self._expected.pop(r, None)
        self._maybe_conclude()

    def on_rank_dead(self, r: int) -> None:
        """``r`` died with saves outstanding: they are forfeit, the bundle never waits for them; when it owed
        the model piece, that piece goes to another live rank (every replica holds the same consensus)."""
        owed_model = self._pending.get(r, 0) > 0 and r == self._model_rank and self.stem_in_progress is not None
        self._pending.pop(r, None)
        self._expected.pop(r, None)
        if owed_model:
            assert self.stem_in_progress is not None
            self._retry_model_piece(self.stem_in_progress, f"rank {r} died before it wrote it")
        self._maybe_conclude()

    def _maybe_conclude(self) -> None:
        """Once the saves of the bundle in progress settled: decide whether it failed; write a deferred meta."""
        stem = self.stem_in_progress
        if stem is None or not self.settled or self._concluded == stem:
            return
        self._concluded = stem
        errors = list(self._errors)
        if file_name(model_path(stem)) not in self._written:
            errors.insert(0, f"the model piece was not written ({self._model_error or 'no live rank wrote it'})")
        if errors:
            self._fail(stem, "; ".join(errors))
        elif stem in self._deferred:
            self._write(stem, self._deferred.pop(stem))

    def _fail(self, stem: str, error: str) -> None:
        self._failed[stem] = error
        self._deferred.pop(stem, None)
        log.error("bundle %s FAILED, no meta written (not resumable): %s", stem, error)
        self._obs.set_tags({f"bundle_failed.{file_name(stem)[:200]}": f"{stem}: {error}"[:5000]})

    def _write(self, stem: str, meta: BundleMeta) -> None:
        try:
            self._store.write_meta(stem, dataclasses.replace(meta, pieces=tuple(sorted(self._written))))
        except OSError as e:
            self._fail(stem, f"the meta could not be written ({e})")
            return
        self.completed.add(stem)

    def write_meta(self, reason: str, stem: Optional[str] = None, *, epoch: Optional[int] = None,
                   coverage_epochs: Optional[list[dict[str, Any]]] = None) -> None:
        """The meta of ``stem``, written last: at once when its saves settled and none failed, after they
        settle when they are still to come (ShutdownWithSave asks first), never for a failed bundle."""
        from flodl_exp.partition import PERMUTATION_ALGORITHM

        stem = stem or self._stem
        f = self.facts
        elche_state, guard_state = self._cycle.controller_state()
        global_step, sync_round = self._cycle.trajectory()
        meta = BundleMeta(
            epoch=self._plan.epochs if epoch is None else int(epoch), global_step=global_step, sync_round=sync_round,
            world_size_at_save=f.world_size, mode=variant_name(f.mode.name, self._cycle.overlap), save_reason=reason,
            unix_time=self._wall_clock(), experiment=f.experiment, total_picks=self._dispatch.total,
            elche_state=elche_state, guard_kind=f.guard_kind, guard_state=guard_state,
            coverage=MetaCoverage(seed=f.shuffle_seed, algorithm=PERMUTATION_ALGORITHM, batch_size=f.batch_size,
                                  per_epoch=tuple(coverage_epochs or ())))
        if stem in self._failed:
            log.error("bundle %s: no meta (%s)", stem, self._failed[stem])
            return
        if stem != self.stem_in_progress or not self.settled:
            self._deferred[stem] = meta
            return
        self._maybe_conclude()
        if stem in self._failed:
            return
        self._write(stem, meta)

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        if stem in self.completed:  # failed, or its meta still to come: nothing resumable to log
            self._store.log_bundle(stem, artifact_path)


@dataclass
class PeriodicBundle:
    epoch: int
    """The epoch a resume starts from (the one after the aggregated boundary)."""
    stem: str
    saving: bool = False
    """False while the consensus reduce settles; True once the saves went out."""
    written: bool = False
    """Its saves settled and its meta was written (the user's checkpoint_fn may still be running)."""


@dataclass
class CoverageBundle:
    stem: str
    epoch: int
    """The lowest open epoch: where a resume starts (only the uncovered picks are trained)."""
    reason: str
    """``at_epoch`` or ``periodic`` (the meta's save_reason)."""
    artifact_path: str
    coverage: list[dict[str, Any]] = field(default_factory=list)
    written: bool = False
    """Its saves settled and its meta was written (the user's checkpoint_fn may still be running)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """``checkpoint.*`` as the core reads it."""

    every: int
    at_epoch: Optional[int]
    progressive: bool
    world_size: int


class Checkpoints:
    """Periodic and at_epoch bundles.

    Progressive modes take both at a reduce finish, from the state the ranks hold then (no extra
    reduce, no hold, EASGD untouched): ``checkpoint.every=N`` at the first finish after the cohort
    reached epoch k*N (algorithms.md 8.3, "arm at the first reduce whose cohort epoch crosses a
    multiple of N"), ``checkpoint.at_epoch=E`` at the first finish after a rank reached epoch E. Both
    record the coverage of every open epoch, so a resume trains exactly the picks they lacked.
    While the at_epoch bundle is pending no rank crosses into epoch E+1 and epoch E is not
    aggregated, so the bundle lands inside epoch E however short epochs are.
    Non-progressive modes keep the epoch-boundary consensus bundle (hold, one consensus reduce,
    save, resume): exact, and harmless there since those modes never blend.
    """

    def __init__(self, *, settings: CheckpointSettings, epochs: Union[int, EpochPlan], writer: BundleWriter,
                 cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher, intents: Intents, ports: Ports,
                 run: RunControl, checkpoint_fn: Optional[CheckpointFnRole] = None) -> None:
        every, progressive = settings.every, settings.progressive
        self.every = every
        self.at_epoch = settings.at_epoch if progressive else None
        self._plan = EpochPlan.of(epochs)
        self._progressive = progressive
        self.world_size = settings.world_size
        self._writer = writer
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._obs = ports.obs
        self.periodic: Optional[PeriodicBundle] = None
        """Non-progressive: the epoch-boundary bundle in progress."""
        self.next_periodic: Optional[int] = every if progressive and 0 < every < self._plan.epochs else None
        """Progressive: the epoch whose first reduce finish takes the next periodic bundle."""
        self.coverage_bundle: Optional[CoverageBundle] = None
        """A coverage bundle whose pieces are being written (its meta follows)."""
        self.at_epoch_done = False
        self._intents = intents
        """Progressive: a cooperative loop's ``w.request_checkpoint()`` is taken at the next reduce finish."""
        self._run = run
        """The core's run-wide actions: its one way to start a reduce, asked for a bundle's consensus."""
        self.checkpoint_fn = checkpoint_fn
        """``experiment.checkpoint_fn`` is set: periodic and requested bundles run it (None: not set)."""
        if self.at_epoch is not None:
            dispatch.hold_after(self.at_epoch)

    @property
    def progressive(self) -> bool:
        return self._progressive

    @property
    def epochs(self) -> int:
        """The run's epoch count (the shared :class:`EpochPlan`: lowered once by a stop)."""
        return self._plan.epochs

    @property
    def busy(self) -> bool:
        return self.periodic is not None or self.coverage_bundle is not None

    def periodic_due(self, e: int) -> bool:
        """Non-progressive: after aggregating epoch e, hold and write the boundary bundle."""
        return not self._progressive and self.every > 0 and (e + 1) % self.every == 0 and e + 1 < self.epochs

    def begin_periodic(self, e: int) -> None:
        """Hold dispatch of epoch e+1 (the caller moves to CHECKPOINTING) until the bundle of epoch e is written."""
        self.periodic = PeriodicBundle(e + 1, self._writer.stem_for("epoch", e + 1))

    def tick_periodic(self) -> bool:
        """Advance the periodic bundle; True when it is complete (the caller resumes training)."""
        ck = self.periodic
        if ck is None or self._cycle.in_flight is not None:
            return False
        if not ck.saving:
            alive = self._cohort.alive_ranks()
            if self.world_size > 1 and self._cycle.any_steps(alive):
                self._run.fire_reduce(final=True)
                return False
            ck.saving = True
            self._writer.send_saves(ck.stem)
            self._fire_checkpoint_fn(ck.epoch)
            return False
        if not ck.written:
            if not self._writer.settled:
                return False
            ck.written = True
            self._writer.write_meta("periodic", ck.stem, epoch=ck.epoch)
            self._writer.log_bundle(ck.stem, f"checkpoints/epoch{ck.epoch}")
            self._obs.emit(ev.Checkpoint(stem=ck.stem, epoch=ck.epoch))
        if not self.fn_settled:
            return False  # training stays held: a failover runs on the same boundary state
        self.periodic = None
        return True

    @property
    def fn_settled(self) -> bool:
        """No ``checkpoint_fn`` result is owed (or none is configured)."""
        return self.checkpoint_fn is None or self.checkpoint_fn.settled

    def _fire_checkpoint_fn(self, version: int) -> None:
        """Right after a periodic or requested bundle's saves went out: ``checkpoint_fn(version, model)`` on its
        model-piece rank, which runs it after writing that piece, on the same state (algorithms.md 8.3)."""
        rank = self._writer.model_rank
        if self.checkpoint_fn is not None and rank is not None:
            self.checkpoint_fn.fire(version, rank)

    def _due(self) -> tuple[Optional[str], int]:
        """Which coverage bundle is due now (``at_epoch``, ``periodic``, ``requested`` or None) and the epoch the
        cohort reached."""
        if not self._progressive or self.busy:
            return None, -1
        reached = max((self._dispatch.rank_epoch[r] for r in self._cohort.alive_ranks()), default=-1)
        if self.at_epoch is not None and not self.at_epoch_done and reached >= self.at_epoch:
            return "at_epoch", reached
        if self.next_periodic is not None and reached >= self.next_periodic and self.next_periodic < self.epochs:
            # (a stop that lowered the plan below the next periodic epoch leaves it untaken)
            return "periodic", reached
        return ("requested" if self._intents.waiting("checkpoint", reached) else None), reached

    def coverage_bundle_due(self) -> bool:
        """:meth:`maybe_coverage_bundle` would take a bundle now (an overlapped reduce's finish asks first: its
        consensus lacks what the ranks trained past their answers, so the bundle waits for a barrier reduce)."""
        return self._due()[0] is not None

    def maybe_coverage_bundle(self) -> None:
        """At a reduce finish, before any new chunk is dispatched: an at_epoch or periodic bundle when due."""
        kind, reached = self._due()
        if kind == "at_epoch":
            assert self.at_epoch is not None
            self.at_epoch_done = True
            self._take(self._writer.stem_for("at_epoch", self.at_epoch), "at_epoch", "checkpoints/at_epoch", self.at_epoch)
        elif kind == "periodic":
            assert self.next_periodic is not None
            due = self.next_periodic
            nxt = (reached // self.every + 1) * self.every
            self.next_periodic = nxt if nxt < self.epochs else None
            self._take(self._writer.stem_for("epoch", due), "periodic", f"checkpoints/epoch{due}", due)
        elif kind == "requested" and self._intents.due("checkpoint", reached):
            self._take(self._writer.stem_for("requested", reached), "requested", f"checkpoints/requested{reached}", reached)

    def _take(self, stem: str, reason: str, artifact_path: str, asked: int) -> None:
        reached = max((self._dispatch.rank_epoch[r] for r in self._cohort.alive_ranks()), default=-1)
        self._intents.answer("checkpoint", reached)  # any bundle answers the requests of the epochs it covers
        coverage = self._dispatch.open_coverage()
        lowest = min((p["epoch"] for p in coverage), default=self._dispatch.current_epoch())
        self.coverage_bundle = CoverageBundle(stem, lowest, reason, artifact_path, coverage)
        self._writer.send_saves(stem)
        if reason != "at_epoch":
            self._fire_checkpoint_fn(asked)
        self._obs.emit(ev.CheckpointArmed(stem=stem, epoch=asked, reason=reason))

    def on_saves_settled(self) -> None:
        """Every piece of the bundle in progress is written: its meta, its artifacts; release the epoch ceiling."""
        cb = self.coverage_bundle
        if cb is None:
            return
        if not cb.written:
            cb.written = True
            self._writer.write_meta(cb.reason, cb.stem, epoch=cb.epoch, coverage_epochs=cb.coverage)
            self._writer.log_bundle(cb.stem, cb.artifact_path)
            self._obs.emit(ev.Checkpoint(stem=cb.stem, epoch=cb.epoch, reason=cb.reason))
        if not self.fn_settled:
            return  # in progress until the checkpoint_fn reported (or was given up): called again then
        self.coverage_bundle = None
        if self.at_epoch_done:
            self._dispatch.hold_after(None)
        elif self.at_epoch is not None and not self._cycle.any_steps(self._cohort.alive_ranks()):
            self.maybe_coverage_bundle()  # the at_epoch bundle waited on this one, and nothing moved since
