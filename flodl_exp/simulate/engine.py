"""The what-if engine: the coordinator's own components paced by a discrete-event clock.

What is real and what is modelled:

* **Real**: the coordinator's own :class:`~flodl_exp.core.control_core.ControlCore`, every decision of the
  run (the reduce gate, throttle, ElChe and its cold-start probe, the guard, the LR meta-controller,
  dispatch, chunk pools, final-window plans, async overshoot, in-order epoch aggregation and its metrics,
  the final consensus), built from the rig's run config by the same ``ControlCore.from_config``, with the
  run-shape derivations and validation of flodl_exp.config. It reads :class:`SimClock` (its injected clock)
  and runs on its events' time; the engine drives it only through ``handle`` (each rank message, then a
  ``Tick``, as the coordinator ticks after each batch of arrivals) and hands the commands it returns to the
  simulated ranks after the link latency. It reads the core only through its view and keeps no decision of
  its own.
* **Modelled**: each rank is a small state machine that behaves as ``rank/control.py`` does: control is
  handled between batches (at the top of each one, and at once while idle, at a barrier or throttled);
  ``sync_now`` blocks the rank in the collective until every member entered (then the ring all-reduce
  time, costs.py); ``request_params`` sends a snapshot (through the coordinator's NIC) and, with
  ``barrier``, waits for the update; ``throttle`` waits for the update. Step, data and link times come
  from the declared rig (costs.py). Nothing is trained: the divergence the guard sees comes from
  ``DivergenceConfig`` (per-step drift x steps x LR factor), the loss is not modelled. On the nccl
  backend each ack carries its rank's drift; on the cpu backend the real average computes it from the
  snapshots, so each snapshot is a 2-vector ``[1, x]``: every rank ``x = 0`` but the lightest mover k,
  ``x = a``; with k's weight w the consensus is ``[1, w a]`` and k's relative delta, the largest,
  is ``a (1 - w) / sqrt(1 + w^2 a^2)``, so ``a = D / sqrt((1 - w)^2 - D^2 w^2)`` makes it the drift D.

Not modelled: evals, checkpoints and their callback slack, stage advisories (sent, as the coordinator sends them,
and ignored: no timing effect), deaths
and regroups, CPU contention between ranks sharing a host, the launcher's start-up (wall = from the
first chunks to the last epoch aggregated, as experiments/bench_hetero.py measures).
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from flodl_exp import events as ev
from flodl_exp.config import Config, RunShape
from flodl_exp.core.averager import Consensus
from flodl_exp.core.commands import Broadcast, Event, RankJoined, RankMessage, Send, Tick, TrainingStarts
from flodl_exp.core.control_core import ControlCore
from flodl_exp.core.cycle import Reduce, ReduceOutcome
from flodl_exp.core.lifecycle import Phase
from flodl_exp.core.ports import NullObserver
from flodl_exp.policy.mode import Mode, configured_variant
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    ExtendPartition,
    Lockstep,
    NodePartial,
    Payload,
    RequestParams,
    SetGlobalStep,
    Snapshot,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)
from flodl_exp.simulate.clock import EventQueue, SimClock
from flodl_exp.simulate.costs import Costs
from flodl_exp.simulate.fast import SimDispatcher
from flodl_exp.simulate.topology import SimulateConfig, lr_factor, rank_steps, run_config
from flodl_exp.torch_averager import TorchAverager

RANK_MSG, BATCH_END, COLL_DONE, COORD_MSG, COORD_FINISH = range(5)
IDLE, BUSY, COLLECTIVE, BARRIER, THROTTLED = range(5)


@dataclass
class SimRank:
    r: int
    step_ms: float
    data_ms: float
    jitter: float
    state: int = IDLE
    plans: deque[StartEpoch] = field(default_factory=deque)
    mailbox: deque[Payload] = field(default_factory=deque)
    chunk: Optional[list[Any]] = None
    """[plan, batches, done, t0_s, compute_ms, data_ms]"""
    steps_since_avg: int = 0
    global_step: int = 0
    steps_in_flight: int = 0
    """``mode.overlap``: the steps of the rank's answer to the reduce in flight (the LR's position counts them)."""
    sent: bool = False
    """``mode.overlap``: the rank answered a reduce and trains on; its update is a correction (rank/control.py)."""
    landed: Optional[tuple[int, int]] = None
    """nccl, ``mode.overlap``: the all-reduce (version, n) that finished while the rank ran a batch: acked after it."""
    held_ms: float = 0.0
    """``mode.overlap``: the rank's idle while its answer was unresolved, since its last answer (its ``held_ms``)."""
    idle_since: Optional[float] = None
    """When the rank went idle with its answer unresolved (None: it is not)."""
    batches: int = 0
    busy_ms: float = 0.0
    synced: int = 0
    """Reduces taken part in (the next one's version), as rank/control.py counts them."""
    lockstep_until: int = 0
    """nccl_sync's license (Lockstep): a reduce after every step while :attr:`synced` is below."""


@dataclass
class RunStats:
    """What one simulated mode did (the report's row)."""

    mode: str
    world_size: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """One 'epoch' event per aggregated epoch, with ``t`` (simulated s), as events.jsonl holds."""
    syncs: list[tuple[float, float, int]] = field(default_factory=list)
    """(t_s, sync_ms, anchor after) per finished reduce."""
    batches: list[int] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    events: int = 0
    probe: Optional[list[float]] = None


class _Stats(NullObserver):
    """What the engine keeps of the core's decisions: each aggregated epoch and each finished reduce."""

    def __init__(self, stats: RunStats, clock: SimClock) -> None:
        self.stats, self.clock = stats, clock

    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None:
        self.stats.syncs.append((self.clock.t, out.sync_ms, out.anchor_after))

    def emit(self, event: ev.EventRecord) -> None:
        if isinstance(event, ev.Epoch):
            self.stats.epochs.append({**event.record(), "t": self.clock.t})
            self.stats.wall_s = self.clock.t
        elif isinstance(event, ev.Probe):
            self.stats.probe = list(event.ms_per_batch)


class Engine:
    def __init__(self, cfg: SimulateConfig, mode: str, *, check: bool = False, run: Optional[Config] = None) -> None:
        """``run``: ``mode``'s run config of ``cfg`` (topology.run_config), built beforehand; unset: built here."""
        steps = rank_steps(cfg)
        w = len(steps)
        if run is None:
            run = run_config(cfg, mode, w)
        elif run.cluster.ranks_per_node != w or configured_variant(run.mode) != mode:
            raise ValueError(f"simulate: the run config given is {configured_variant(run.mode)} on "
                             f"{run.cluster.ranks_per_node} ranks, not {mode} on {w}")
        self.cfg, self.mode, self.W = cfg, mode, w
        self.gamma = run.mode.gamma
        self.clock = SimClock()
        self.q = EventQueue(self.clock, cfg.max_events)
        nbytes = cfg.model_mb * 1e6 * (0.5 if run.mode.bf16_wire else 1.0)
        self.costs = Costs(cfg.link, nbytes)
        self.lat = self.costs.latency_s
        self.bs = cfg.batch_size
        self.lrf = lr_factor(cfg)
        self.rng = random.Random(cfg.seed)
        self.ranks = [SimRank(r, ms, d, j) for r, (ms, d, j) in enumerate(steps)]
        self.stats = RunStats(mode, w)
        self._check = check
        self.books: Optional[SimDispatcher] = None
        """The dispatcher the engine gave the core (with ``check``, it compares its running books to full scans)."""
        self._model_drift = False
        """Set while :meth:`run` drives the simulated ranks: their cpu snapshots then read the modelled drift."""
        averager = _ModelledDrift(TorchAverager(RunShape.of(run).outer), self) if Mode.of(run).is_cpu else None
        self.core = ControlCore.from_config(
            run, wall_clock=lambda: self.clock.t, observer=_Stats(self.stats, self.clock),
            dispatcher=self._dispatcher, averager=averager, start=0.0)
        self.view = self.core.view
        for r in range(w):
            self.handle(RankJoined(r, 0.0))
        self.alive = self.view.alive_ranks()
        self._colls: dict[int, dict[int, tuple[float, int]]] = {}
        """nccl: per reduce (its version), who entered its collective, when, with how many steps."""
        self._coll_n: dict[int, dict[int, int]] = {}
        """Per completed collective (version): each member's steps, read as its ack goes out."""
        self._nic_free = 0.0

    def _dispatcher(self, **kw: Any) -> SimDispatcher:
        self.books = SimDispatcher(check=self._check, **kw)
        return self.books

    @property
    def done(self) -> bool:
        """Training is over once the core asks for the final eval (evals are not modelled), or the core ended it
        another way (the stall ceiling's ShutdownWithSave: :meth:`run` then says so)."""
        return self.view.phase not in (Phase.TRAINING, Phase.DRAINING)

    def handle(self, event: Event) -> None:
        """One event to the core; what it sends goes to the simulated ranks."""
        for c in self.core.handle(event):
            if isinstance(c, Send):
                self._to_rank(c.rank, c.payload)
            elif isinstance(c, Broadcast):
                for r in c.to:
                    self._to_rank(r, c.payload)

    # -- the run ------------------------------------------------------------------
    def run(self) -> RunStats:
        self.stats.epochs.append({**ev.Started(world_size=self.W, epochs=self.cfg.epochs).record(), "t": 0.0})
        self._model_drift = True
        self.handle(TrainingStarts(self.cfg.samples, None, self.clock.t))
        self.handle(Tick(self.clock.t))
        handlers: dict[int, Callable[[int, Any], None]] = {RANK_MSG: self._rank_msg, BATCH_END: self._batch_end, COLL_DONE: self._coll_done,
                    COORD_MSG: self._coord_msg, COORD_FINISH: self._coord_finish}
        while not self.done:
            if not len(self.q):
                raise RuntimeError(f"simulation of {self.mode} stalled at t={self.clock.t:.3f}s: no event pending "
                                   f"(epochs aggregated {self.view.epochs_aggregated}/{self.cfg.epochs})")
            kind, r, payload = self.q.pop()
            handlers[kind](r, payload)
        view = self.view
        if not view.is_(Phase.FINISHING) or view.ending:
            # the core ended the run as a real one would (a reduce past the stall ceiling): a report of the epochs
            # done so far would read as a finished run
            raise RuntimeError(f"simulation of {self.mode} ended in phase {view.phase.value} at t={self.clock.t:.3f}s "
                               f"after {view.epochs_aggregated}/{self.cfg.epochs} epochs: "
                               f"{view.failure or 'no final eval was asked for'}")
        st = self.stats
        st.events = self.q.popped
        st.batches = [rk.batches for rk in self.ranks]
        st.busy_ms = [rk.busy_ms for rk in self.ranks]
        return st

    # -- coordinator -> rank ------------------------------------------------------
    def _to_rank(self, r: int, p: Payload) -> None:
        if isinstance(p, RequestParams):
            self._nic_free = max(self._nic_free, self.clock.t)
        self.q.after(self.lat, RANK_MSG, r, p)

    # -- the rank side ------------------------------------------------------------
    def _rank_msg(self, r: int, p: Payload) -> None:
        rk = self.ranks[r]
        rk.mailbox.append(p)
        if rk.state in (IDLE, BARRIER, THROTTLED):
            self._advance(rk)

    def _handle(self, rk: SimRank, p: Payload) -> None:
        if isinstance(p, StartEpoch):
            rk.plans.append(p)
        elif isinstance(p, ExtendPartition):
            rk.plans.append(StartEpoch(epoch=p.epoch, offset=p.offset, size=p.size, chunk=p.chunk))
        elif isinstance(p, SyncNow):
            if p.overlap:  # the all-reduce runs while the rank trains on: the steps from here are the next window's
                self._enter_collective(rk, p.version, overlapped=True)
                rk.sent, rk.steps_in_flight, rk.steps_since_avg = True, rk.steps_since_avg, 0
            else:
                self._enter_collective(rk, p.version)
        elif isinstance(p, Lockstep):
            rk.lockstep_until = max(rk.lockstep_until, p.until)
        elif isinstance(p, RequestParams):
            held = self._take_held(rk)
            self._send_snapshot(rk, held_ms=held if p.overlap else None)
            if p.overlap:  # trains on: the steps from here are the next window's
                rk.sent, rk.steps_in_flight, rk.steps_since_avg = True, rk.steps_since_avg, 0
            if p.barrier:
                rk.state = BARRIER
        elif isinstance(p, Update):
            if not rk.sent:
                rk.steps_since_avg = 0
            rk.sent = False
            if rk.state in (BARRIER, THROTTLED):
                rk.state = IDLE
        elif isinstance(p, Throttle):
            if rk.state == IDLE:
                rk.state = THROTTLED
        elif isinstance(p, SetGlobalStep):
            rk.global_step, rk.steps_in_flight = p.global_step, 0

    def _advance(self, rk: SimRank) -> None:
        """The rank's loop from where it stands: control between batches, the next batch, the next chunk."""
        self._end_idle(rk)
        if rk.state in (BARRIER, THROTTLED):
            while rk.mailbox and rk.state != IDLE:  # wait_until: handle control as it comes
                self._handle(rk, rk.mailbox.popleft())
            if rk.state != IDLE:
                return
        rk.state = IDLE
        for _ in range(100_000):  # bounded: each pass ends a chunk, opens one, or starts a batch and returns
            if rk.chunk is not None and rk.chunk[2] >= rk.chunk[1]:
                if rk.synced < rk.lockstep_until:  # the license's rest, with nothing (rank/control.py's run-out)
                    self._enter_collective(rk, rk.synced)
                    return
                self._end_chunk(rk)
                continue
            if rk.chunk is None and rk.plans:
                plan = rk.plans.popleft()
                rk.chunk = [plan, plan.size // self.bs, 0, self.clock.t, 0.0, 0.0]
            while rk.mailbox:
                self._handle(rk, rk.mailbox.popleft())
                if rk.state != IDLE:
                    return
            if rk.chunk is None:
                if rk.plans:
                    continue
                if rk.synced < rk.lockstep_until:  # a license that found the rank between chunks: run out now
                    self._enter_collective(rk, rk.synced)
                elif rk.sent:  # idle with its answer unresolved: the reduce holds it (rank/control.py wait_for_plans)
                    rk.idle_since = self.clock.t
                return
            if rk.chunk[1] == 0:
                continue
            self._start_batch(rk)
            return
        raise RuntimeError(f"rank {rk.r}: its loop did not settle (a flood of empty chunks?)")

    def _start_batch(self, rk: SimRank) -> None:
        ch = rk.chunk
        assert ch is not None
        step = rk.step_ms
        if rk.jitter > 0:
            step = max(0.05 * step, step * (1.0 + rk.jitter * self.rng.gauss(0.0, 1.0)))
        data = rk.data_ms + (self.cfg.chunk_start_ms if ch[2] == 0 else 0.0)
        rk.state = BUSY
        self.q.after((data + step + self.cfg.link.batch_message_ms) / 1e3, BATCH_END, rk.r, (step, data))

    def _batch_end(self, r: int, p: tuple[float, float]) -> None:
        rk = self.ranks[r]
        step, data = p
        ch = rk.chunk
        assert ch is not None
        ch[2] += 1
        ch[4] += step
        ch[5] += data
        rk.steps_since_avg += 1
        rk.batches += 1
        rk.busy_ms += step + data
        lr = self.lrf(rk.global_step + rk.steps_in_flight + rk.steps_since_avg)
        self.q.after(self.lat, COORD_MSG, r, Batch(ms=step, data_ms=data, chunk=ch[0].chunk, loss=None, lr=lr))
        self._ack_landed(rk)
        if rk.synced < rk.lockstep_until:  # nccl_sync's license: a reduce right after the step, no sync_now
            self._enter_collective(rk, rk.synced)
            return
        rk.state = IDLE
        self._advance(rk)

    def _end_chunk(self, rk: SimRank) -> None:
        plan, nb, done, t0, comp, data = rk.chunk  # type: ignore[misc]
        rk.chunk = None
        m = ChunkMetrics(epoch=plan.epoch, chunk=plan.chunk, avg_loss=0.0, batches=done, samples=done * self.bs,
                         epoch_ms=(self.clock.t - t0) * 1e3, share_complete_ms=comp + data, compute_only_ms=comp,
                         data_starve_ms=data, ranges=[[plan.offset, done * self.bs]] if done else [], loss_batches=0)
        self.q.after(self.lat, COORD_MSG, rk.r, m)

    def _enter_collective(self, rk: SimRank, version: int, *, overlapped: bool = False) -> None:
        """The rank waits in reduce ``version``'s collective, which completes once every live rank is in it
        (``overlapped``: it trains on meanwhile, rank/control.py's ``mode.overlap``)."""
        coll = self._colls.setdefault(version, {})
        if not overlapped:
            rk.state = COLLECTIVE
        coll[rk.r] = (self.clock.t, rk.steps_since_avg)
        if len(coll) == len(self.alive):
            t_done = max(t for t, _ in coll.values()) + self.costs.allreduce_s(len(coll))
            for r in coll:
                self.q.at(t_done, COLL_DONE, r, version)
            del self._colls[version]
            self._coll_n[version] = {r: n for r, (_, n) in coll.items()}

    def _coll_done(self, r: int, version: int) -> None:
        rk = self.ranks[r]
        ns = self._coll_n[version]
        n = ns.pop(r)
        if not ns:
            del self._coll_n[version]
        if rk.sent:  # overlapped: landed between batches (the one running ends first), the steps since kept
            rk.landed = (version, n)
            if rk.state != BUSY:
                self._ack_landed(rk)
            return
        self._ack(rk, version, n)
        rk.steps_since_avg = 0
        rk.state = IDLE
        self._advance(rk)

    def _end_idle(self, rk: SimRank) -> None:
        if rk.idle_since is not None:
            rk.held_ms += (self.clock.t - rk.idle_since) * 1e3
            rk.idle_since = None

    def _take_held(self, rk: SimRank) -> float:
        """What averaging held the rank since its last answer (its ``held_ms``): the simulation models no launch or
        landing time for an overlapped reduce (its all-reduce or the coordinator's averaging runs beside the
        training), only the rank's idle while its answer was unresolved, as a real rank reports it."""
        self._end_idle(rk)
        held, rk.held_ms = rk.held_ms, 0.0
        return held

    def _ack(self, rk: SimRank, version: int, n: int, held_ms: Optional[float] = None) -> None:
        """``held_ms``: an overlapped reduce's (:meth:`_take_held`), so ElChe sizes the windows as the run's does."""
        left = rk.chunk[1] - rk.chunk[2] if rk.chunk is not None else 0
        self.q.after(self.lat, COORD_MSG, rk.r, SyncAck(n=n, d=self._drift(n), version=version, left=left,
                                                        held_ms=held_ms))
        rk.synced = version + 1

    def _ack_landed(self, rk: SimRank) -> None:
        """An overlapped all-reduce landed: its ack goes (before any next batch, as rank/control.py does)."""
        if rk.landed is not None:
            version, n = rk.landed
            held = self._take_held(rk)
            rk.landed, rk.sent = None, False
            self._ack(rk, version, n, held_ms=held)

    def _send_snapshot(self, rk: SimRank, held_ms: Optional[float] = None) -> None:
        start = max(self.clock.t + self.lat, self._nic_free)
        self._nic_free = start + self.costs.nic_s()
        import torch  # the cpu backend's snapshots only: an nccl mode's simulation (the coordinator's prediction) needs none

        snap = Snapshot(n=rk.steps_since_avg, tensors={"p0": torch.tensor([1.0, 0.0])}, held_ms=held_ms)
        self.q.at(self._nic_free, COORD_MSG, rk.r, snap)

    def _drift(self, n: int) -> float:
        d = self.cfg.divergence
        lr = self.lrf(self.view.global_step)
        return max(0.0, d.per_step * n * lr * (1.0 + d.noise * self.rng.gauss(0.0, 1.0)))

    # -- the coordinator side: the core's inputs -----------------------------------------
    def _coord_msg(self, r: int, p: Payload) -> None:
        red = self.view.reduce_in_flight()
        if (isinstance(p, Snapshot) and red is not None
                and set(red.snapshot_steps) | {r} >= {q for q in red.members if self.view.alive(q)}):
            # the last snapshot of a cpu reduce: the coordinator averages and scatters (modelled time) first
            movers = sum(1 for n in [*red.snapshot_steps.values(), p.n] if n > 0)
            self.q.after(self.costs.average_s(movers) + self.costs.scatter_s(len(red.members)) + self.costs.fixed_s(),
                         COORD_FINISH, r, p)
            return
        self._coord_finish(r, p)

    def _coord_finish(self, r: int, p: Payload) -> None:
        self.handle(RankMessage(r, p, self.clock.t))
        self.handle(Tick(self.clock.t))


class _ModelledDrift:
    """The cpu backend's real average, over snapshots set so that it reads the modelled drift (the algebra in the
    module docstring): while the engine runs its simulated ranks, the lightest mover's ``x`` is chosen so that its
    relative delta, the largest, is the drift D of the rig's divergence model."""

    def __init__(self, inner: TorchAverager, engine: Engine) -> None:
        self._inner = inner
        self._engine = engine

    def average(self, snapshots: Sequence[Snapshot], *, gamma: float, idle_mean: bool,
                partials: Sequence[NodePartial] = ()) -> Consensus:
        """The simulator's ranks answer directly (it models no node groups): ``partials`` is always empty."""
        from flodl_exp.averaging import mass

        eng = self._engine
        if eng._model_drift:
            masses = [mass(s.n, gamma) for s in snapshots]
            total = sum(masses)
            drift = max((eng._drift(s.n) for s in snapshots), default=0.0)
            movers = [i for i, m in enumerate(masses) if m > 0]
            if len(movers) >= 2 and total > 0 and drift > 0:
                k = min(movers, key=lambda i: masses[i])
                wk = masses[k] / total
                den = (1 - wk) ** 2 - (drift * wk) ** 2
                a = drift / math.sqrt(den) if den > 0 else drift / max(1 - wk, 1e-6)
                snapshots[k].tensors["p0"][1] = a  # the engine's own snapshot, made in _send_snapshot
        return self._inner.average(snapshots, gamma=gamma, idle_mean=idle_mean)

    def outer_state(self) -> dict[str, Any]:
        return self._inner.outer_state()

    def restore_outer(self, state: dict[str, Any]) -> float:
        return self._inner.restore_outer(state)


def simulate(cfg: SimulateConfig, mode: str, run: Optional[Config] = None) -> RunStats:
    """One mode on the declared rig (``run``: its run config, when built beforehand: see :class:`Engine`)."""
    return Engine(cfg, mode, run=run).run()
