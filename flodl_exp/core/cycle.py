"""The averaging cycle, coordinator side (algorithms.md 3.2-3.11): the owner of the window
ledger, the reduce in flight, the version and global step, and the controllers fed at each
reduce (ElChe, the convergence guard, the LR meta-controller).

Both backends finish when every live member answered:
* nccl: broadcast ``sync_now``; ranks all_reduce in place and ``sync_ack``.
* cpu: broadcast ``request_params``; ranks send ``snapshot``; the coordinator
  averages (work weights ``n^gamma``) and sends ``update`` to each rank.

:meth:`AveragingCycle.try_finish` returns a :class:`ReduceOutcome`; what the rest of
the run does with it (epoch metrics, window records, dispatch, checkpoints) is the
coordinator's business.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from flodl_exp.config import OuterSpec
from flodl_exp.core.averager import Averager
from flodl_exp.core.outbox import Outbox
from flodl_exp.outer_step import OuterStep
from flodl_exp.policy.actions import STABLE, ConvergenceAction
from flodl_exp.policy.elche import ElChe, WindowReport
from flodl_exp.policy.guards import ConvergenceGuard, DivergenceReport
from flodl_exp.policy.meta import LrEventMeta
from flodl_exp.policy.mode import Backend, Mode
from flodl_exp.protocol.messages import (
    Batch,
    NodeDrift,
    NodeDrop,
    NodePartial,
    NodeUpdate,
    RequestParams,
    SetGlobalStep,
    Snapshot,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)

log = logging.getLogger("flodl_exp.coordinator")

PROBE_STEPS = 3
"""Steps each rank is timed before ElChe re-sizes the first window (the first PROBE_WARMUP are left out)."""
PROBE_WARMUP = 1
"""Leading probe steps left out of the probe's median: warm-up (allocations, lazy initialisation)."""


@dataclass
class Ledger:
    """Per-rank window ledger since the last finished reduce (algorithms.md 3.2)."""

    steps: int = 0
    wall_ms: float = 0.0
    first_ms: Optional[float] = None
    delivered_ms: float = 0.0
    delivered_batches: int = 0
    window_batches: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    throttled: bool = False
    """A Throttle was sent this window (cpu backend, max_batch_diff); cleared at every finish."""
    late: int = 0
    """Batch reports still to come for steps a finished reduce already counted: a node's partial (on its leader's
    connection) can overtake its members' last reports (on their own). They belong to no later window."""

    def add(self, batch_ms: float, data_ms: float, loss: Optional[float] = None) -> None:
        if self.late > 0:
            self.late -= 1
            return
        if loss is not None and math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1
        self.steps += 1
        self.window_batches += 1
        self.wall_ms += batch_ms
        if self.first_ms is None:
            self.first_ms = batch_ms + data_ms
        else:
            self.delivered_ms += batch_ms + data_ms
            self.delivered_batches += 1

    def fill_excess(self) -> float:
        if self.first_ms is None or self.delivered_batches == 0:
            return 0.0
        return max(self.first_ms - self.delivered_ms / self.delivered_batches, 0.0)

    def reset_timing(self) -> None:
        self.wall_ms, self.first_ms, self.delivered_ms, self.delivered_batches, self.window_batches = 0.0, None, 0.0, 0, 0
        self.loss_sum, self.loss_count = 0.0, 0
        self.throttled = False


@dataclass
class Reduce:
    """A reduce in flight: who must answer, and what they answered."""

    backend: Backend
    started: float
    members: set[int]
    final: bool = False
    """A consensus reduce (end of training, epoch-boundary bundle, preemption): no EASGD blend."""
    lockstep: bool = False
    """Opened by the coordinator for the ranks' own reduce (a Lockstep license): its time runs from its first answer."""
    acks: dict[int, SyncAck] = field(default_factory=dict)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    partials: dict[int, NodePartial] = field(default_factory=dict)
    """cpu, ``cluster.node_reduce``: node leader -> its node's partial (core/node_groups.py)."""
    via: dict[int, int] = field(default_factory=dict)
    """Member -> the leader whose partial holds its share (a partial supersedes the member's own snapshot)."""
    awaiting: Optional[AwaitingDrift] = None
    """The consensus went out to node leaders: the reduce finishes when their drift read-outs are in."""
    resend: set[int] = field(default_factory=set)
    """Members of a partial that answered again themselves (their relay broke): sent their update directly."""
    awaited_dead: set[int] = field(default_factory=set)
    """Members that died before their leader's partial came: their steps are held until it shows whether it summed
    them (in: the picks stay covered; out: trained again)."""
    overlap: bool = False
    """``mode.overlap``: the members train on past their answer; what they report after it is their next window."""
    pledged: dict[int, int] = field(default_factory=dict)
    """Overlapped: each member's steps this reduce holds, as far as known (its steps at the trigger, then the
    ``n`` of its answer): the steps past them are its next window's (:meth:`AveragingCycle.window_steps`)."""

    def answered(self) -> set[int]:
        """The members whose share is in (cpu: a snapshot, or a node's partial)."""
        if self.backend is Backend.NCCL:
            return set(self.acks)
        return set(self.snapshots) | set(self.via)


@dataclass
class AwaitingDrift:
    """A hierarchical cpu reduce between its consensus sent and its drift read-outs in (see NodeDrift)."""

    n: dict[int, int]
    div: dict[int, Optional[float]]
    pre: dict[int, Optional[float]]
    post: Optional[float]
    outer: Optional[OuterStep]
    sync_ms: float
    """Trigger to consensus sent: the wait the ranks saw (ElChe's overhead), not the drift's return trip."""
    leaders: dict[int, list[int]]
    """Leader -> the ranks whose drift it owes."""
    update: Callable[[int], Update]
    """The Update a member gets directly when its leader died before handing it on (it ignores a second one)."""
    held_ms: Optional[float] = None
    """``mode.overlap``: what the reduce cost the ranks that trained on (:func:`_held_ms`)."""


@dataclass
class ReduceOutcome:
    n: dict[int, int]
    """Steps of each member that went into the consensus."""
    k_used: int
    sync_ms: float
    divergence: dict[int, Optional[float]]
    action: ConvergenceAction
    anchor_before: int
    anchor_after: int
    window_loss: float
    """Mean training loss over the window (NaN when no batch reported a finite loss)."""
    window_s: float
    """Wall time since the previous reduce finished."""
    final: bool
    outer: Optional[OuterStep] = None
    """The outer optimizer's step (None: outer=avg, or a round nobody moved in)."""
    held_ms: Optional[float] = None
    """``mode.overlap``: the most any rank's training stood still for this reduce (:func:`_held_ms`), ElChe's
    overhead in place of :attr:`sync_ms` (the reduce's length, which the ranks trained through); None otherwise."""
    dead_in: list[int] = field(default_factory=list)
    """Members that answered and died since, whose share the consensus holds (nccl: the survivors' collective of the
    same generation; cpu: their node leader's partial)."""
    dead_out: list[int] = field(default_factory=list)
    """Members that died with their answer in doubt, whose share is not in the consensus (nccl: the survivors redid
    the collective without them in a later generation; cpu: their leader's partial left them out): their answered
    batches must be trained again."""

    @property
    def d_max(self) -> Optional[float]:
        return max((float(v) for v in self.divergence.values() if v is not None), default=None)


@dataclass(frozen=True)
class CycleSettings:
    """The averaging cycle's settings: the mode and its ``mode.*`` knobs, resolved once (RunShape, config.py)."""

    world_size: int
    mode: Mode
    gamma: float
    """``mode.gamma``: the weight of the consensus in a cpu reduce's update."""
    alpha: Optional[float]
    """EASGD's elastic alpha (None: plain averaging)."""
    progressive: bool
    relax_up: bool = False
    max_batch_diff: Optional[int] = None
    outer: Optional[OuterSpec] = None
    lockstep_ahead: int = 0
    overlap: bool = False
    """``mode.overlap``: the ranks train their next window while a reduce is in flight (cpu backend)."""


def _held_ms(red: Reduce, held: list[Optional[float]]) -> Optional[float]:
    """What an overlapped reduce cost the ranks, ElChe's overhead (``sync_ms``) for it: they trained on through it,
    so its length is not what they lost; each answer says how long averaging held that rank (``held_ms``,
    rank/hold_clock.py), and the most any was is the reduce's cost. None without overlap (the ranks waited the
    reduce out: its length is the cost) or when no answer says (the length, as before)."""
    said = [max(0.0, h) for h in held if h is not None]
    return max(said) if red.overlap and said else None


class AveragingCycle:
    def __init__(self, *, settings: CycleSettings, elche: Optional[ElChe], guard: ConvergenceGuard,
                 meta: Optional[LrEventMeta], outbox: Outbox, clock: Callable[[], float],
                 averager: Optional[Averager] = None) -> None:
        world_size, mode = settings.world_size, settings.mode
        self.world_size = world_size
        self._mode = mode
        self.policy, self.backend = mode.policy, mode.backend
        self.gamma = settings.gamma
        self.alpha = settings.alpha
        self.progressive = settings.progressive
        self._elche = elche
        self._guard = guard
        self.meta = meta
        self.relax_up = settings.relax_up
        self.max_batch_diff = settings.max_batch_diff
        self._out = outbox
        self._clock = clock
        self._ledger = [Ledger() for _ in range(world_size)]
        self._in_flight: Optional[Reduce] = None
        self._version = 0
        """Finished reduces (the bundle's ``sync_round``)."""
        self._global_step = 0
        """Batches averaged into the consensus so far, all ranks together."""
        self.lr_seen: Optional[float] = None
        self._window_t0 = clock()
        self._slack_source: Callable[[], dict[int, float]] = dict
        """Callback slack (ms per rank) to stage before ElChe sizes the next window (the coordinator's)."""
        self._outer_spec = settings.outer or OuterSpec()
        self._averager = averager
        """cpu backend: the consensus arithmetic and the outer optimizer's state (the shell's port; nccl: None,
        the ranks average and hold the outer optimizer themselves)."""
        self._probe: Optional[list[list[float]]] = (
            [[] for _ in range(world_size)] if elche is not None and mode.window_grows else None)
        """Compute ms of each rank's first steps, until the cold-start probe has been taken (then None)."""
        self._probe_full = 0
        """Ranks that have timed PROBE_STEPS steps (the probe is due when every live rank has)."""
        self._ones = [1] * world_size
        self._overlap = settings.overlap and mode.overlap_capable
        """``mode.overlap``: non-final reduces let the ranks train on (RequestParams.overlap)."""
        self._lockstep_ahead = settings.lockstep_ahead if mode.lockstep_capable and world_size >= 2 else 0
        """nccl_sync: how many reduces the ranks may run ahead on their own (``mode.lockstep_ahead``; 0: off)."""
        self._lockstep_until = 0
        """The license granted so far (Lockstep): the ranks start every reduce below this version on their own, and
        the coordinator never sends a sync_now below it."""
        self._early: dict[int, dict[int, SyncAck]] = {}
        """Lockstep answers to reduces after the one in flight (version -> rank -> ack), applied as each opens."""
        self._early_t: dict[int, float] = {}
        """When each of those reduces' first answer came (its start, for sync_ms and the stall ceiling)."""
        self._left: Optional[int] = None
        """The fewest steps any member's chunk had left at the last finished reduce (None: unknown)."""
        self._lockstep_syncs = 0
        """Reduces the ranks started on their own (result.json ``lockstep_syncs``)."""
        self._leader_of: dict[int, int] = {}
        """``cluster.node_reduce``: rank -> its node's leader (grouped ranks only)."""
        self._members_of: dict[int, list[int]] = {}
        """Leader -> its node's ranks."""
        self._handed: Optional[tuple[int, set[int], Callable[[int], Update]]] = None
        """The last finished hierarchical reduce: its version, the ranks its partials held, and each one's update."""

    @property
    def elche(self) -> Optional[ElChe]:
        return self._elche

    @property
    def in_flight(self) -> Optional[Reduce]:
        return self._in_flight

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def version(self) -> int:
        return self._version

    @property
    def averager(self) -> Optional[Averager]:
        return self._averager

    @property
    def guard(self) -> ConvergenceGuard:
        return self._guard

    @property
    def ledger(self) -> list[Ledger]:
        return self._ledger

    @property
    def overlap(self) -> bool:
        """``mode.overlap``: the reduces that are not final let the ranks train on (their next window's chunk goes
        with the request)."""
        return self._overlap

    @property
    def lockstep_ahead(self) -> int:
        return self._lockstep_ahead

    @property
    def lockstep_until(self) -> int:
        return self._lockstep_until

    @property
    def probe_full(self) -> int:
        return self._probe_full

    @property
    def lockstep_syncs(self) -> int:
        return self._lockstep_syncs

    # -- state ------------------------------------------------------------
    @property
    def counts(self) -> list[int]:
        return self._elche.batch_counts if self._elche is not None else [1] * self.world_size

    @property
    def anchor(self) -> Optional[int]:
        """ElChe's anchor (the slowest rank's window length); None without ElChe (one rank)."""
        return self._elche.anchor if self._elche is not None else None

    @property
    def counts_view(self) -> Sequence[int]:
        """:attr:`counts` without the copy, for per-chunk reads (see ElChe.counts_view)."""
        return self._elche.counts_view if self._elche is not None else self._ones

    @property
    def probing(self) -> bool:
        """The cold-start probe is still open (every rank's first steps being timed)."""
        return self._probe is not None

    # -- ElChe, the guard and the averager, asked through the cycle (nothing reaches past it to them) ----------
    @property
    def window_t0(self) -> float:
        """When the current averaging window began (the last reduce's finish, or the start)."""
        return self._window_t0

    def stage_slack_from(self, source: Callable[[], dict[int, float]]) -> None:
        """Where each reduce's callback slack comes from (RunEnd.callback_slack: built after the cycle)."""
        self._slack_source = source

    @property
    def has_elche(self) -> bool:
        """ElChe sizes the windows (2+ ranks)."""
        return self._elche is not None

    def calibrated(self) -> bool:
        """ElChe has measured every rank (its speeds are the ranks' own, not a guess)."""
        return self._elche is not None and self._elche.is_calibrated

    def has_speed_hint(self) -> bool:
        """ElChe was given the ranks' relative speeds (mode.speed_hint) before measuring them."""
        return self._elche is not None and self._elche.has_speed_hint()

    def speed_known(self) -> bool:
        """The ranks' relative speeds are known, measured or hinted: windows and epochs are sized by them."""
        return self.calibrated() or self.has_speed_hint()

    def calibrated_speeds(self) -> Optional[Callable[[int], Optional[float]]]:
        """Each rank's smoothed ms per batch once ElChe is calibrated (for electing the fastest), else None."""
        return self._elche.smoothed_ms if self._elche is not None and self._elche.is_calibrated else None

    def ms_per_batch(self) -> list[float]:
        """Each rank's time per batch as the sizes of an epoch's plans weigh it: measured when calibrated, else
        the inverse of the hinted counts (a rank with twice the count takes half the time)."""
        elche = self._elche
        assert elche is not None and self.speed_known(), "ms_per_batch needs ElChe's speeds (speed_known)"
        return [max(elche.smoothed_ms(r), 1e-3) if elche.is_calibrated else 1.0 / c
                for r, c in enumerate(elche.batch_counts)]

    def set_max_total_batches(self, n: int) -> None:
        """An epoch's batch count caps ElChe's windows (no window longer than an epoch)."""
        if self._elche is not None:
            self._elche.set_max_total_batches(n)

    def seed_anchor(self, r: int) -> bool:
        """A cold-start anchor (the slowest device's rank) unless ElChe has one already; True when it took."""
        elche = self._elche
        if elche is None or elche.anchor_rank is not None:
            return False
        elche.with_initial_anchor(r)
        return True

    def controller_state(self) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
        """What a bundle keeps of ElChe (with the guard's trend history) and of the guard."""
        guard_state = self._guard.state_dict()
        trend = guard_state.get("trend_history") or None
        elche_state = dict(self._elche.state_dict(), trend_history=trend) if self._elche is not None else None
        return elche_state, guard_state

    def restore_controllers(self, elche_state: Optional[dict[str, Any]], guard_state: Optional[dict[str, Any]]) -> None:
        """ElChe's and the guard's state from a bundle (either may be absent: a bundle of another guard)."""
        if self._elche is not None and elche_state:
            st = dict(elche_state)
            st.pop("trend_history", None)
            self._elche.load_state_dict(st)
        if guard_state:
            self._guard.load_state_dict(guard_state)

    @property
    def wants_outer_state(self) -> bool:
        """The core's averager keeps an outer optimizer's state (cpu backend, a stateful outer): a bundle's
        ``.outer.pt`` sidecar is the core's to take, and to restore on resume."""
        return self._mode.is_cpu and self._outer_spec.stateful

    def outer_state(self) -> Optional[dict[str, Any]]:
        """The outer optimizer's state for a bundle's sidecar, when the core keeps it (:attr:`wants_outer_state`)."""
        if not self.wants_outer_state or self._averager is None:
            return None
        return self._averager.outer_state()

    @property
    def ranks_keep_outer_state(self) -> bool:
        """nccl backend with a stateful outer optimizer: each rank holds it, and a bundle has its sidecar."""
        return self._mode.is_nccl and self._outer_spec.stateful

    def restore_outer(self, state: dict[str, Any]) -> Optional[float]:
        """cpu backend: the outer optimizer's momentum from a bundle's sidecar; its norm (None when this mode
        keeps none here: the nccl ranks hold theirs, ``outer=avg`` has none)."""
        if not self.wants_outer_state or self._averager is None:
            return None
        return self._averager.restore_outer(state)

    def restore(self, global_step: int, version: int) -> None:
        self._global_step, self._version = global_step, version

    def steps(self, r: int) -> int:
        return self._ledger[r].steps

    def window_steps(self, r: int) -> int:
        """Steps of ``r``'s window in progress: with an overlapped reduce in flight, those past what it answered (or,
        before its answer came, past its steps at the trigger), which its next chunk is sized against; else every
        step since the last finish."""
        red = self._in_flight
        steps = self._ledger[r].steps
        if red is None or not red.overlap:
            return steps
        return max(0, steps - red.pledged.get(r, 0))

    def any_steps(self, ranks: Iterable[int]) -> bool:
        return any(self._ledger[r].steps > 0 for r in ranks)

    def window_loss(self) -> float:
        n = sum(led.loss_count for led in self._ledger)
        return sum(led.loss_sum for led in self._ledger) / n if n else float("nan")

    def stalled(self, now: float, ceiling_s: float) -> bool:
        return self._in_flight is not None and now - self._in_flight.started > ceiling_s

    # -- rank reports -------------------------------------------------------
    def on_batch(self, r: int, b: Batch, *, speaks_for_lr: bool) -> None:
        self._ledger[r].add(b.ms, b.data_ms, b.loss)
        if speaks_for_lr and b.lr is not None:
            self.lr_seen = b.lr
        if self._probe is not None and len(self._probe[r]) < PROBE_STEPS:
            self._probe[r].append(b.ms)
            if len(self._probe[r]) == PROBE_STEPS:
                self._probe_full += 1

    def seed_from_probe(self, alive: list[int]) -> Optional[list[float]]:
        """Cold start (once per run): when every live rank has timed :data:`PROBE_STEPS` steps and no reduce
        has calibrated ElChe yet, ElChe re-sizes the window in progress by those speeds (the median of each
        rank's steps after its first), so the fast ranks do not idle through an equal first window. Returns
        the per-rank ms it used when it did (the caller then hands the fast ranks the rest of their window),
        None otherwise."""
        probe, elche = self._probe, self._elche
        if probe is None or elche is None or not alive or any(len(probe[r]) < PROBE_STEPS for r in alive):
            return None
        self._probe = None
        ms = {r: statistics.median(probe[r][PROBE_WARMUP:]) for r in alive}
        slowest = max(ms.values())
        per_rank = [ms.get(r, slowest) for r in range(self.world_size)]  # a dead rank weighs as the slowest
        return per_rank if elche.seed_from_probe(per_rank) else None

    def on_ack(self, r: int, ack: SyncAck) -> bool:
        """Book an answer; True when it answers the reduce in flight (a lockstep answer to a later reduce waits
        for that one to open; one to a reduce already finished, or that no license covers, is dropped)."""
        red = self._in_flight
        v = ack.version
        if v is not None and v != self._version:
            if self.answers_ahead(v):
                self._early.setdefault(v, {})[r] = ack
                self._early_t.setdefault(v, self._clock())
            else:
                log.debug("rank %d answered reduce %d while %d is the current one: dropped", r, v, self._version)
            return False
        if red is not None and red.backend is Backend.NCCL and r in red.members:
            if red.lockstep and not red.acks:  # a lockstep reduce's time runs from its first answer, not its opening
                red.started = self._clock()
            red.acks[r] = ack
            if red.overlap:
                red.pledged[r] = int(ack.n)
            return True
        return False

    def answers_ahead(self, version: Optional[int]) -> bool:
        """An answer to ``version`` is one to a later lockstep reduce (kept until that one opens)."""
        return version is not None and self._version < version < self._lockstep_until

    def open_lockstep(self, alive: list[int]) -> list[int]:
        """The ranks start the next reduce on their own (it is below the license): open it here without a sync_now,
        over the live ranks and any that answered it before dying, with the answers that came early. Returns the
        ranks whose answers it holds already."""
        if self._in_flight is not None or self._version >= self._lockstep_until:
            raise RuntimeError(f"no lockstep reduce to open at version {self._version} (license {self._lockstep_until})")
        early = self._early.pop(self._version, {})
        started = self._early_t.pop(self._version, self._clock())
        self._lockstep_syncs += 1
        self._in_flight = Reduce(self.backend, started, set(alive) | set(early), lockstep=True)
        self._in_flight.acks.update(early)
        return sorted(early)

    def extend_lockstep(self, allowed: bool) -> Optional[int]:
        """After a finish: raise the license to ``ahead`` reduces past the current one, within the steps every
        member's chunk has left, once half of it is used (not every step: a message per rank each time). Returns
        the new license to broadcast, or None. Not ``allowed`` (a bundle, a preemption, a death, an eval wants the
        cohort held): the license runs out by itself, at most ``ahead`` steps later."""
        if not allowed or self._lockstep_ahead <= 0 or not self._left:
            return None
        if self._lockstep_until - self._version > self._lockstep_ahead // 2:
            return None
        target = self._version + min(self._lockstep_ahead, self._left)
        if target <= self._lockstep_until:
            return None
        self._lockstep_until = target
        return target

    def on_snapshot(self, r: int, snap: Snapshot) -> bool:
        """A rank's own answer; False when it answers nothing (no reduce in flight, another version's, or its
        share came in its node's partial already)."""
        red = self._in_flight
        handed = self._handed
        if handed is not None and snap.version == handed[0] and r in handed[1]:
            # its share was in a finished reduce's partial, but its relay broke before the leader handed it the
            # update (the drift came first): it gets it directly, and ignores a second copy by version
            self._out.send(r, handed[2](r))
            return False
        if red is None or red.backend is not Backend.CPU or r not in red.members:
            return False
        if snap.version is not None and snap.version != self._version:
            return False
        if r in red.via:
            # Its share is in its node's partial, but its relay broke before the leader handed it the update:
            # it gets the update directly (now, or with the others), and ignores a second copy by its version.
            red.resend.add(r)
            if red.awaiting is not None:
                self._out.send(r, red.awaiting.update(r))
            return False
        if red.awaiting is not None:
            return False
        red.snapshots[r] = snap
        if red.overlap:
            red.pledged[r] = int(snap.n)
        return True

    def on_partial(self, leader: int, p: NodePartial) -> list[int]:
        """A node leader's partial for the reduce in flight; the members it newly answers for. It supersedes
        a member's own snapshot (sent when its relay broke): the partial's sums hold that share already."""
        red = self._in_flight
        if (red is None or red.backend is not Backend.CPU or p.version != self._version or leader in red.partials
                or red.awaiting is not None or len(p.ranks) != len(p.ns) or len(p.ranks) != len(p.pre)
                or any(r in red.via or r not in red.members for r in p.ranks)):
            if red is not None and p.version == self._version:
                log.warning("node partial from rank %d for reduce %d ignored: ranks %s are not all its to answer",
                            leader, p.version, list(p.ranks))
            return []
        red.partials[leader] = p
        # a member that answered itself too (its relay broke after the leader summed it) gets its update directly
        red.resend |= {r for r in p.ranks if r in red.snapshots}
        fresh = [r for r in p.ranks if r not in red.snapshots]
        for r, n in zip(p.ranks, p.ns):
            red.snapshots.pop(r, None)
            red.via[r] = leader
            if red.overlap:
                red.pledged[r] = int(n)
        return fresh

    def on_drift(self, leader: int, m: NodeDrift) -> None:
        """A node leader's drift read-out of the members it handed the consensus to."""
        red = self._in_flight
        wait = red.awaiting if red is not None else None
        if wait is None or m.version != self._version or leader not in wait.leaders:
            return
        for r, d in zip(m.ranks, m.drift):
            if r in wait.leaders[leader]:
                wait.div[r] = d
        del wait.leaders[leader]

    def acked_steps(self, r: int) -> int:
        """Steps of ``r`` in an answer to the reduce in flight that its death cannot take back (0: none): its nccl
        ack, or its share in a node's partial (the sum cannot be split again)."""
        red = self._in_flight
        if red is None:
            return 0
        if red.backend is Backend.NCCL:
            return min(red.acks[r].n, self._ledger[r].steps) if r in red.acks else 0
        if red.awaiting is not None and r in red.awaiting.n and r not in red.via:
            # it answered itself and the consensus went out with its share (the leaders' drift is still due)
            return min(red.awaiting.n[r], self._ledger[r].steps)
        leader = red.via.get(r)
        if leader is None:
            return self._ledger[r].steps if self._awaits_partial(red, r) else 0
        p = red.partials[leader]
        return min(p.ns[list(p.ranks).index(r)], self._ledger[r].steps)

    def _awaits_partial(self, red: Reduce, r: int) -> bool:
        """``r`` is a member of the cpu reduce in flight whose node leader has not answered yet (it may sum r)."""
        leader = self._leader_of.get(r)
        return (red.backend is Backend.CPU and red.awaiting is None and r in red.members and r not in red.snapshots
                and leader is not None and leader != r and leader not in red.partials)

    def set_node_groups(self, members: dict[int, list[int]]) -> None:
        """``cluster.node_reduce``: leader -> its node's ranks (core/node_groups.py), told to the ranks at start."""
        self._leader_of = {r: q for q, ranks in members.items() for r in ranks}
        self._members_of = {q: list(ranks) for q, ranks in members.items()}

    def unreduced_steps(self, r: int) -> int:
        """Steps of ``r`` that are in no finished reduce nor in its answer to the one in flight (an nccl ack holds
        its share, if the survivors' collective holds it: see :attr:`ReduceOutcome.dead_out`)."""
        return max(0, self._ledger[r].steps - self.acked_steps(r))

    def forget(self, r: int) -> None:
        """A dead rank's unreduced steps never reach the consensus. Its answers to reduces after the one in flight
        are dropped too: the death counted their steps as unreduced (its picks go to the survivors), so booking them
        when their reduce opens would count those steps twice."""
        red = self._in_flight
        if red is not None and self._awaits_partial(red, r):
            red.awaited_dead.add(r)
        self._ledger[r].steps = 0
        self._ledger[r].late = 0
        for acks in self._early.values():
            acks.pop(r, None)
        leader = self._leader_of.get(r)
        if leader is not None and leader != r:
            self._out.send(leader, NodeDrop(rank=r))  # its leader must not wait for it (a frozen rank's socket stays open)
        for q in self._members_of.get(r, []):
            if q != r:
                self._out.send(q, NodeDrop(rank=r))  # the leader is gone: its members answer directly

    # -- the gate -------------------------------------------------------------
    def should_average(self, alive: list[int], quiesced: Callable[[int], bool],
                       working: Callable[[int], bool] = lambda r: True) -> bool:
        """Every live rank reached its count (sync: stepped once), is throttled, or has no work left (``working``:
        a chunk in flight)."""
        if self.world_size < 2 or self._in_flight is not None:
            return False
        any_mover = False
        counts = self.counts
        target = self._mode.window_target
        held = self.max_batch_diff is not None and any(self._ledger[r].throttled for r in alive)  # throttles need it
        for r in alive:
            s = self._ledger[r].steps
            if s > 0:
                any_mover = True
            hit = s >= target(counts[r])
            # A throttled rank is held at max_batch_diff ahead of the slowest on purpose: it waits for
            # this reduce, so it counts as arrived (else the gate and the throttle wait on each other).
            # The reference fires on the count only (or quiesced): held short of its count, with its chunk
            # in flight, a rank can never arrive there (README, "Differences from flodl 0.7.0").
            hit = hit or self._ledger[r].throttled
            # With ranks held by a throttle, a rank with nothing in flight (its epoch share done) counts as arrived
            # too: it steps again only after this reduce or the epoch's end, and the held ranks' chunks keep the
            # epoch open. cpu_sync with 3+ ranks wedged so in most runs (tests/test_fault_fuzz.py).
            hit = hit or (held and not working(r))
            if not (hit or (self.progressive and quiesced(r))):
                return False
        return any_mover

    def throttle(self, alive: list[int], working: Callable[[int], bool] = lambda r: True) -> None:
        """cpu backend, ``max_batch_diff``: hold ranks that ran that far ahead of the slowest (full cohort only).

        The slowest among the ranks still ``working`` (a chunk in flight): a rank without one (its epoch share
        done, or at its count waiting for the reduce) steps again only after the reduce or the epoch's end,
        which a rank held behind it would block. The reference takes the minimum over every rank, and
        cpu_sync wedged: the fast rank done with its share at 0 steps this window, the slow one held at
        ``max_batch_diff + 1`` with its share unfinished, the sync gate waiting for the fast rank's step."""
        mbd = self.max_batch_diff
        if not self._mode.is_cpu or mbd is None or len(alive) < self.world_size or self.world_size < 2:
            return
        busy = [r for r in alive if working(r)]
        if not busy:
            return
        low = min(self._ledger[r].steps for r in busy)
        for r in alive:
            led = self._ledger[r]
            if led.steps > low + int(mbd) and not led.throttled:
                led.throttled = True
                self._out.send(r, Throttle())

    def trigger(self, members: list[int], *, final: bool = False) -> None:
        """Start a reduce over ``members``. Only the control core calls this (ControlCore.fire_reduce), and
        never with one in flight: a second would overwrite the first's answers."""
        if self._in_flight is not None:
            raise RuntimeError(f"a reduce is already in flight (version {self._version}): one at a time")
        if self._version < self._lockstep_until:
            raise RuntimeError(f"reduce {self._version} is the ranks' own (lockstep license {self._lockstep_until}): "
                               "a sync_now for it would pair it twice")
        overlap = self._overlap and not final
        self._in_flight = red = Reduce(self.backend, self._clock(), set(members), final=final, overlap=overlap)
        if overlap:
            # mode.overlap: every rank trains on and applies the consensus as a correction (W += avg - W_sent), so
            # nothing trained after its answer is lost; its next window starts at its answer.
            red.pledged = {r: self._ledger[r].steps for r in members}
        if self._mode.is_nccl:
            # overlapped: the all-reduce runs on the rank while it trains on; it acks once the consensus landed
            self._out.broadcast(SyncNow(version=self._version, divergence=True, overlap=overlap))
        elif overlap:
            self._out.broadcast(RequestParams(version=self._version, barrier=False, overlap=True))
        else:
            # Ranks wait for the update unless EASGD blends it in: under a full overwrite a batch trained
            # after the snapshot would be overwritten, trained but in no consensus (lost work). In cadence the
            # wait costs nothing (a rank at its count has no chunk left); async streams on by design, its
            # post-snapshot batches surviving at weight (1 - alpha) (algorithms.md 3.9).
            barrier = final or not self.progressive or self.alpha is None
            self._out.broadcast(RequestParams(version=self._version, barrier=barrier))

    # -- the finish -----------------------------------------------------------
    def try_finish(self, alive: Callable[[int], bool]) -> Optional[ReduceOutcome]:
        """Finish the reduce in flight once every live member answered (None: not yet, or none in flight)."""
        red = self._in_flight
        if red is None:
            return None
        live = sorted(r for r in red.members if alive(r))
        if red.backend is Backend.NCCL:
            if not set(live).issubset(red.acks):
                return None
            # A member that acked and died since completed the collective of its generation. Its share is in the
            # consensus when the survivors completed that same one; when they redid it in a later generation
            # (regrouped without it), it is not: not counted, and its answered batches are trained again.
            gen = max((red.acks[r].generation for r in live), default=None)
            dead_acked = sorted(set(red.acks) - set(live))
            dead_out = [r for r in dead_acked if gen is not None and red.acks[r].generation != gen]
            dead_in = [r for r in dead_acked if r not in dead_out]
            live = sorted(set(live) | set(dead_in))
            n = {r: red.acks[r].n for r in live}
            lefts = [red.acks[r].left for r in live if r in red.acks]
            self._left = min(lefts) if lefts and all(x is not None for x in lefts) else None  # type: ignore[type-var]
            div: dict[int, Optional[float]] = {r: red.acks[r].d for r in live}
            pre: dict[int, Optional[float]] = {r: red.acks[r].pre for r in live}
            post = next((red.acks[r].post for r in live if red.acks[r].post is not None), None)
            # Every rank stepped the same outer optimizer on the same consensus: any ack speaks for all.
            outer = next((OuterStep(a.outer_step, a.outer_momentum or 0.0, seeded=False)
                          for a in (red.acks[r] for r in live) if a.outer_step is not None), None)
        else:
            if red.awaiting is None:
                if not set(live).issubset(red.answered()):
                    return None
                self._average_cpu(red, live, alive)
            wait = red.awaiting
            assert wait is not None
            for leader in [q for q in wait.leaders if not alive(q)]:
                # The leader died holding the consensus: its live members get it directly (a member that had it
                # from the leader ignores the second copy, by version); their drift is not known.
                for r in wait.leaders.pop(leader):
                    if alive(r):
                        self._out.send(r, wait.update(r))
            if wait.leaders:
                return None
            self._handed = (self._version, set(red.via), wait.update) if red.via else None
            out = self._finish(red, wait.n, wait.div, wait.pre, wait.post, wait.sync_ms, alive, wait.outer,
                               held_ms=wait.held_ms)
            out.dead_in = sorted(r for r in wait.n if not alive(r))  # in the consensus: direct or through a partial
            out.dead_out = sorted(red.awaited_dead - set(red.via))
            return out
        held = _held_ms(red, [red.acks[r].held_ms for r in live if r in red.acks])
        out = self._finish(red, n, div, pre, post, (self._clock() - red.started) * 1e3, alive, outer, held_ms=held)
        out.dead_in, out.dead_out = dead_in, dead_out
        return out

    def _average_cpu(self, red: Reduce, live: list[int], alive: Callable[[int], bool]) -> None:
        """The consensus of the live members' snapshots and the node partials, sent: an Update to each rank that
        answered itself, a NodeUpdate to each live leader (which hands it on and answers its members' drift). Sets
        ``red.awaiting``: the reduce finishes when the drift is in (a flat reduce at once: no leader owes any)."""
        direct = [r for r in live if r in red.snapshots]
        partials = [red.partials[q] for q in sorted(red.partials)]
        snaps = [red.snapshots[r] for r in direct]
        n = {r: s.n for r, s in zip(direct, snaps)}
        div: dict[int, Optional[float]] = {}
        pre: dict[int, Optional[float]] = {}
        for p in partials:
            for r, k, norm in zip(p.ranks, p.ns, p.pre):
                n[r], pre[r], div[r] = k, norm, None
        version = self._version
        held = _held_ms(red, [s.held_ms for s in snaps] + [p.held_ms for p in partials])
        if not n:
            red.awaiting = AwaitingDrift(n, div, pre, None, None, (self._clock() - red.started) * 1e3, {},
                                         lambda r: Update(n=0, skip=True, version=version), held)
            return
        if self._averager is None:
            raise RuntimeError("the cpu backend's reduce needs an Averager: the shell builds the core with one "
                               "(flodl_exp.torch_averager.TorchAverager)")
        # EASGD leaves replicas apart even when nobody stepped: the final consensus is then their plain mean.
        idle_mean = red.final and self.alpha is not None
        res = self._averager.average(snaps, gamma=self.gamma, idle_mean=idle_mean, partials=partials)
        alpha = None if red.final else self.alpha
        tensors = dict(res.tensors) if res.tensors is not None else None  # one frame object for every rank

        def update(r: int) -> Update:
            if tensors is None:  # nobody moved: release barrier waits; each rank keeps its own state
                return Update(n=n[r], skip=True, version=version)
            return Update(n=n[r], alpha=alpha, tensors=tensors, version=version)

        for r, (d, pre_n) in zip(direct, res.drift):
            div[r], pre[r] = d, pre_n
        if tensors is None:
            for r in direct:
                div[r], pre[r] = 0.0, None
        lead = NodeUpdate(version=version, ranks=[], ns=[], alpha=alpha, skip=tensors is None,
                          tensors=dict(res.leader_tensors) if res.leader_tensors is not None else {})
        leaders = self._send_consensus(red, direct, update, lead, alive)
        red.awaiting = AwaitingDrift(n, div, pre, res.post, res.outer, (self._clock() - red.started) * 1e3, leaders,
                                     update, held)

    def _send_consensus(self, red: Reduce, direct: list[int], update: Callable[[int], Update], lead: NodeUpdate,
                        alive: Callable[[int], bool]) -> dict[int, list[int]]:
        """Each direct answerer its Update; each live leader a NodeUpdate (``lead`` with its node's ranks and
        steps), a dead leader's members their Update directly; members whose relay broke theirs too. Returns the
        leaders that owe a drift read-out, and for which ranks."""
        leaders: dict[int, list[int]] = {}
        with self._out.sharing_tensors():
            for r in direct:
                self._out.send(r, update(r))
            for q, p in sorted(red.partials.items()):
                msg = dataclasses.replace(lead, ranks=list(p.ranks), ns=list(p.ns))
                if alive(q) and self._out.send(q, msg):
                    leaders[q] = list(p.ranks)
                    continue
                for r in p.ranks:
                    if alive(r):
                        self._out.send(r, update(r))
            for r in sorted(red.resend):
                if alive(r) and red.via.get(r) in leaders:
                    self._out.send(r, update(r))
        return leaders

    def _finish(self, red: Reduce, n: dict[int, int], div: dict[int, Optional[float]], pre: dict[int, Optional[float]],
                post: Optional[float], sync_ms: float, alive: Callable[[int], bool],
                outer: Optional[OuterStep] = None, held_ms: Optional[float] = None) -> ReduceOutcome:
        action = STABLE
        anchor_before = self._elche.anchor if self._elche is not None else 0
        if self._elche is not None:
            action = self._feed_controllers(n, div, pre, post, sync_ms if held_ms is None else held_ms, alive)
        now = self._clock()
        k_used = sum(n.values())
        outcome = ReduceOutcome(n=n, k_used=k_used, sync_ms=sync_ms, divergence=div, action=action,
                                anchor_before=anchor_before, anchor_after=self._elche.anchor if self._elche else 0,
                                window_loss=self.window_loss(), window_s=max(now - self._window_t0, 1e-6), final=red.final,
                                outer=outer, held_ms=held_ms)
        self._version += 1
        self._global_step += k_used
        for r in n:
            if red.backend is Backend.NCCL:
                # A rank trains on after its ack while its peers finish the collective: those batches are
                # in no consensus yet and count toward the next window (else the final reduce may be skipped
                # with replicas apart).
                self._ledger[r].steps = max(0, self._ledger[r].steps - n[r])
            elif red.overlap:
                # Overlapped: the update corrects a replica that trained on, so the steps after the snapshot
                # survive and count toward the next window; those the snapshot held and whose reports are still
                # to come (a node's partial overtook them) count toward none.
                led = self._ledger[r]
                left = led.steps - n[r]
                led.late += max(0, -left)
                led.steps = max(0, left)
            else:
                # Adoption resets the window (algorithms.md 3.7, 3.10): batches trained after a cpu snapshot
                # were overwritten (or blended away) by the update, so they count toward no later window.
                self._ledger[r].late += max(0, n[r] - self._ledger[r].steps)
                self._ledger[r].steps = 0
        for led in self._ledger:
            led.reset_timing()
        self._in_flight = None
        self._window_t0 = now
        self._out.broadcast(SetGlobalStep(global_step=self._global_step))
        if outcome.anchor_after != anchor_before:
            log.info("anchor %d -> %d", anchor_before, outcome.anchor_after)
        return outcome

    def _feed_controllers(self, n: dict[int, int], div: dict[int, Optional[float]], pre: dict[int, Optional[float]],
                          post: Optional[float], sync_ms: float, alive: Callable[[int], bool]) -> ConvergenceAction:
        """ElChe's timing feed, the guard's verdict, the meta-controller's veto, in the reference's order."""
        elche = self._elche
        assert elche is not None
        led = self._ledger
        w = range(self.world_size)
        movers = [r for r in w if alive(r) and led[r].window_batches > 0]
        capable = self._mode.guard_capable
        for r, ms in self._slack_source().items():
            elche.stage_callback_slack(r, ms)
        elche.report_window(WindowReport(
            wall_ms=[led[r].wall_ms if alive(r) else 0.0 for r in w],
            steps=[led[r].window_batches if alive(r) else 0 for r in w],
            delivered_ms=[led[r].delivered_ms for r in w],
            delivered_batches=[led[r].delivered_batches for r in w],
            fill_ms=[led[r].fill_excess() for r in w],
            sync_ms=sync_ms,
            delivered_coherent=capable and bool(movers) and all(led[r].delivered_batches >= 1 for r in movers),
        ))
        pres = [pre.get(r) for r in w]
        report = DivergenceReport([float(div.get(r) or 0.0) for r in w],
                                  pres if all(p is not None for p in pres) else None, post)  # type: ignore[arg-type]
        action = self._guard.report(report, sum(n.values()), max(n.values(), default=0))
        if self.meta is not None and self.lr_seen is not None:
            meta_action = self.meta.observe(self.lr_seen, elche.anchor, action, elche.phase)
            if meta_action is not None:
                elche.nudge_anchor_down(meta_action.factor)
                elche.discard_proposed_anchor()
        elche.apply_verdict(action, relax_up=self._mode.streams and self.relax_up)
        return action

    def trajectory(self) -> tuple[int, int]:
        """(global_step, sync_round): where the averaged trajectory stands, as a bundle's meta records it."""
        return self._global_step, self._version
