"""Coordinator load test (issue 19, part 3): a real coordinator process and N simulated ranks on loopback.

``python experiments/bench_coordinator.py [--quick] [--sizes 8,64,256,1024] [--reps 3]``
``python experiments/bench_coordinator.py --pace 20 --seconds 60 --sizes 1024`` (paced load, issue 52)

The coordinator is started as the job's task 0 starts it (``flodl_exp.coordinator.main`` on a job folder with a
``spec.json``: ``mode=cpu_cadence``, one epoch, an MLflow run in a scratch sqlite store), inside a thin wrapper
(``--coordinator``) that only times it: the main loop's turns, the timing messages (``batch``) it absorbs,
and each reduce trigger. The ranks are simulated: ``k`` processes (``--procs``, default 4), each driving
N/k authenticated connections from one selector loop with the real ``wire`` / ``protocol`` code (handshake,
a heartbeat and a telemetry report per rank on the real ranks' clocks (rank/cadence.py: each second up to
256 ranks), a ``batch`` per trained batch, chunk ``metrics``,
``snapshot`` answers of a small model through the cpu backend, eval and save answers, ``exiting``).
No torch training: a simulated rank reports a batch as soon as it may (``--rate`` per rank and second, 0 =
as fast as the loop goes) on a chunk the coordinator handed it, like the managed loop would.

Measured per run, then the median over ``--reps`` runs:

* ``batch/s``: timing messages the coordinator handled / the time from its first to its last one;
* ``turn p50/p99``: the busy time of one turn of the coordinator's loop (events handled + ``tick()``);
* ``trig p50/p99``: for each reduce, the coordinator's trigger time minus the send time of the last
  batch (or chunk metrics) any rank sent before it (the last rank reaching its count); one clock
  (CLOCK_MONOTONIC) across processes;
* ``queue p99``: how long rank messages waited between the read thread's hand-off and the main thread's
  handling (``trig_queue_ms`` in the per-run line: that wait for the last message handled before each trigger,
  the part of a late trigger that is the coordinator's backlog);
* ``cpu%`` (of one core) and peak ``rss``: from ``/proc/<pid>/stat`` and ``/statm`` of the coordinator
  over its busy span; ``cpu us/batch``: the coordinator's CPU time over that span per timing message
  (everything it did: reduces, plans, beacons included), a figure that holds on a shared machine where
  ``batch/s`` is bound by who else runs (1e6 / it = the batches one core could absorb);
* a reduce's phases (medians over the run's reduces, :func:`_reduce_phases`): ``reduce ms`` (the trigger to the
  averaging's end), ``to sent ms`` (to the last update sent: what a rank waits), ``asked``, the first and the
  other snapshots, ``average``, ``flush`` and the main thread's ``finish cpu``.

Loopback only. ``RLIMIT_NOFILE`` is raised to its hard limit (each rank is one descriptor on each side).
Every process started here is ended by its pid; every loop is bounded in time.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import resource
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
STATS_ENV = "FLODL_BENCH_STATS"
TURN_SAMPLES = 400_000
DEFAULT_TIMEOUT_S = 240.0
"""A run's bound (the simulated ranks' deadline) when it is not paced."""
PACED_SECONDS = 60.0
"""``--pace`` without ``--seconds``: the issue's 60 s."""


def _time_reduce_phases(st: dict[str, Any]) -> Any:
    """Timers on a reduce's phases (see :func:`_reduce_phases`): the first and last snapshot handled, the updates
    sent and the main thread's CPU for the finish. ``$BENCH_FINISH_PROFILE=<file>``: cProfile the finishes
    (a developer's look at the main thread's share; returns the profiler, dumped at the end)."""
    from flodl_exp.core.cycle import AveragingCycle
    from flodl_exp.core.reduces import Reduces

    mono = time.monotonic
    on_snapshot, finish_one = AveragingCycle.on_snapshot, Reduces._finish_one
    finish_prof = None
    if os.environ.get("BENCH_FINISH_PROFILE"):
        import cProfile

        finish_prof = cProfile.Profile()

    def timed_snapshot(self: AveragingCycle, r: int, snap: Any) -> bool:
        took = on_snapshot(self, r, snap)
        t = mono()
        snaps = st.setdefault("snaps", {}).setdefault(str(self.version), [t, t])
        snaps[1] = t
        return took

    def timed_finish_one(self: Reduces) -> bool:
        c0 = time.thread_time()
        if finish_prof is not None:
            finish_prof.enable()
        done = finish_one(self)
        if finish_prof is not None:
            finish_prof.disable()
        if done:
            st.setdefault("flushed", []).append(mono())  # the folded updates are sent as the block closes
            st.setdefault("finish_cpu", []).append(time.thread_time() - c0)  # the main thread's own CPU
        return done

    on_partial, average_cpu = AveragingCycle.on_partial, AveragingCycle._average_cpu

    def timed_partial(self: AveragingCycle, leader: int, part: Any) -> list[int]:
        took = on_partial(self, leader, part)
        t = mono()
        snaps = st.setdefault("snaps", {}).setdefault(str(self.version), [t, t])
        snaps[1] = t
        return took

    def timed_average(self: AveragingCycle, red: Any, live: list[int], alive: Any) -> None:
        average_cpu(self, red, live, alive)
        if red.partials:  # node_reduce: the consensus left for the leaders here (the finish waits for their drift)
            st.setdefault("sent", {})[str(self.version)] = mono()

    AveragingCycle.on_snapshot = timed_snapshot  # type: ignore[method-assign]
    AveragingCycle.on_partial = timed_partial  # type: ignore[method-assign,assignment]
    AveragingCycle._average_cpu = timed_average  # type: ignore[method-assign]
    Reduces._finish_one = timed_finish_one  # type: ignore[method-assign]
    return finish_prof


# ------------------------------------------------------------------ the coordinator, timed
def _time_gc(st: dict[str, Any]) -> None:
    """Record each collection of generation 1 or 2 (``st["gc"]``: [generation, ms, monotonic end]): a pause every
    thread of the coordinator takes together."""
    import gc

    t0: list[float] = [0.0]
    st["gc"] = []

    def gc_timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        elif info.get("generation", 0) >= 1:
            st["gc"].append([info["generation"], (time.perf_counter() - t0[0]) * 1e3, time.monotonic()])

    gc.callbacks.append(gc_timer)


def _schedstat() -> tuple[int, int]:
    """This thread's CPU time and time waiting on a run queue (ns, /proc/thread-self/schedstat; 0s where absent)."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            cpu, wait = fh.read().split()[:2]
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return 0, 0


def _time_reads(sel: Any, reads: list[Any]) -> None:
    """Each turn of the read thread (the timeline): [select's return, the time it blocked in select, sockets ready,
    the thread's CPU and run-queue wait since the previous return (ms)]."""
    select = sel.select
    last: list[float] = []  # set on the read thread's first turn (the schedstat is per thread)

    def timed_select(timeout: Optional[float] = None) -> Any:
        t0 = time.monotonic()
        ready = select(timeout)
        t1 = time.monotonic()
        cpu, wait = _schedstat()
        if last:
            reads.append([t1, t1 - t0, len(ready), (cpu - last[1]) / 1e6, (wait - last[2]) / 1e6, t0 - last[0]])
        last[:] = [t1, cpu, wait]
        return ready

    sel.select = timed_select


def _stamp_rank_messages(reads: Optional[list[Any]] = None) -> None:
    """The rank server's read thread stamps each rank message it queues (a 4th element, the monotonic time; the
    coordinator reads the first three): how long it waited for the main thread is then known."""
    from flodl_exp.coordinator.server import RankServer

    server_init = RankServer.__init__

    def stamping_init(self: RankServer, host: str, token: str, world_size: int, events: Any, *a: Any, **k: Any) -> None:
        put = events.put  # wrapped before the read thread starts (it binds events.put once)

        def stamped(item: Any, *pa: Any, **pk: Any) -> None:
            put((*item, time.monotonic()) if item and item[0] == "msg" else item, *pa, **pk)

        events.put = stamped
        server_init(self, host, token, world_size, events, *a, **k)
        if reads is not None:
            _time_reads(self._sel, reads)

    RankServer.__init__ = stamping_init  # type: ignore[method-assign]


def _time_timeline(st: dict[str, Any], busy: list[float]) -> dict[str, Any]:
    """``$BENCH_TIMELINE``: a per-reduce timeline in ``st["timeline"]`` (hooks under the timers of
    :func:`coordinator_entry`): ``done``, each report that completed a rank's count ([version, rank, its report index,
    handled at, handed off at]); ``turns``, the loop's long turns ([previous tick's end, tick start, end, events,
    their busy s]); ``paces``, each ReportPace round ([version, start, end]); ``reads``, the read thread's turns
    (:func:`_time_reads`). With the simulated ranks' own (their ``.tl.json``): where a late trigger's time went."""
    from flodl_exp.coordinator.coordinator import Coordinator
    from flodl_exp.core.control_core import ControlCore
    from flodl_exp.core.report_pace import ReportPacing

    mono = time.monotonic
    tl: dict[str, Any] = {"cur": None, "n": 0, "end": mono(), "turns": [], "done": [], "paces": [], "reads": []}
    st["timeline"] = tl
    pacing_tick, on_event, tick, on_batch = ReportPacing.tick, Coordinator.on_event, Coordinator.tick, ControlCore.on_batch

    def timed_pacing(self: ReportPacing, alive: Any) -> None:
        seen, t0 = self._seen, mono()
        pacing_tick(self, alive)
        if self._seen != seen:
            tl["paces"].append([self._seen[0], t0, mono()])

    def marked_event(self: Coordinator, ev: Any) -> None:
        tl["cur"] = ev[3] if len(ev) > 3 else None
        tl["n"] += 1
        on_event(self, ev)

    def marked_tick(self: Coordinator) -> None:
        m0 = mono()
        tick(self)
        m1 = mono()
        if m1 - tl["end"] > 0.01 or m1 - m0 > 0.005:
            tl["turns"].append([tl["end"], m0, m1, tl["n"], busy[0]])
        tl["end"], tl["n"] = m1, 0

    def marked_batch(self: ControlCore, r: int, b: Any) -> None:
        on_batch(self, r, b)
        cy = self.cycle
        if cy.steps(r) == cy.mode.window_target(cy.counts_view[r]):  # this report completed r's count
            tl["done"].append([cy.version, r, self.pacing.received[r], mono(), tl["cur"]])

    ReportPacing.tick = timed_pacing  # type: ignore[method-assign]
    Coordinator.on_event = marked_event  # type: ignore[method-assign]
    Coordinator.tick = marked_tick  # type: ignore[method-assign]
    ControlCore.on_batch = marked_batch  # type: ignore[method-assign]
    return tl


def coordinator_entry(argv: list[str]) -> None:
    """``--coordinator <spec.json> <host>``: flodl_exp.coordinator.main with timers on the loop (writes $FLODL_BENCH_STATS)."""
    import array

    from flodl_exp.coordinator import main as cmain
    from flodl_exp.coordinator.coordinator import Coordinator
    from flodl_exp.core.control_core import ControlCore
    from flodl_exp.core.cycle import AveragingCycle

    clock, mono = time.perf_counter, time.monotonic
    st: dict[str, Any] = {"batches": 0, "events": 0, "t_first": None, "t_last": None, "triggers": [], "finishes": []}
    turns = array.array("d")
    busy = [0.0]
    tl = _time_timeline(st, busy) if os.environ.get("BENCH_TIMELINE") else None
    on_event, tick, on_batch, trigger = Coordinator.on_event, Coordinator.tick, ControlCore.on_batch, AveragingCycle.trigger

    _stamp_rank_messages(None if tl is None else tl["reads"])
    qdelay = array.array("d")  # each rank message: read thread's put -> main thread's handling (s)
    qdelay_t = array.array("d")

    def timed_event(self: Coordinator, ev: Any) -> None:
        t0 = clock()
        if len(ev) > 3 and len(qdelay) < 4 * TURN_SAMPLES:
            now = mono()
            qdelay.append(now - ev[3])
            qdelay_t.append(now)
        on_event(self, ev)
        busy[0] += clock() - t0
        st["events"] += 1

    def timed_tick(self: Coordinator) -> None:
        t0 = clock()
        tick(self)
        if st["t_first"] is not None and len(turns) < TURN_SAMPLES:
            turns.append(busy[0] + clock() - t0)
        busy[0] = 0.0

    def counted_batch(self: ControlCore, r: int, b: Any) -> None:
        on_batch(self, r, b)
        now = mono()
        if st["t_first"] is None:
            st["t_first"] = now
        st["t_last"] = now
        st["batches"] += 1

    try_finish = AveragingCycle.try_finish

    def timed_finish(self: AveragingCycle, alive: Any) -> Any:
        out = try_finish(self, alive)
        if out is not None:
            st["finishes"].append([self.version - 1, mono()])
        return out

    def timed_trigger(self: AveragingCycle, members: list[int], *, final: bool = False) -> None:
        st["triggers"].append([self.version, mono(), final])
        trigger(self, members, final=final)

    Coordinator.on_event = timed_event  # type: ignore[method-assign]
    Coordinator.tick = timed_tick  # type: ignore[method-assign]
    ControlCore.on_batch = counted_batch  # type: ignore[method-assign]
    AveragingCycle.trigger = timed_trigger  # type: ignore[method-assign]
    AveragingCycle.try_finish = timed_finish  # type: ignore[method-assign]
    finish_prof = _time_reduce_phases(st)
    _time_gc(st)
    code = cmain.main(argv)
    if finish_prof is not None:
        finish_prof.dump_stats(os.environ["BENCH_FINISH_PROFILE"])
    st["turns"] = sorted(turns)
    # the queue delay of the last rank message handled before each trigger, and over the run
    import bisect

    st["trigger_qdelay_ms"] = [qdelay[i - 1] * 1e3 if (i := bisect.bisect_right(qdelay_t, t)) > 0 else None
                               for _, t, _ in st["triggers"]]
    st["qdelay_ms"] = sorted(x * 1e3 for x in qdelay)[:: max(1, len(qdelay) // 100_000)]
    with open(os.environ[STATS_ENV], "w") as fh:
        json.dump(st, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ simulated ranks
def _sender(conn: Any, encode: Callable[[Any], Any], log: Optional[list[Any]] = None,
            reports: Optional[Callable[[], int]] = None) -> Callable[[Any], None]:
    """One simulated rank's raw send (what its pacer sends through); ``log``: each write's [reports taken by
    then, monotonic time before the write, after it] (the timeline)."""
    if log is None or reports is None:
        return lambda payload: conn.send(encode(payload))

    def send(payload: Any) -> None:
        t0 = time.monotonic()
        conn.send(encode(payload))
        log.append((reports(), t0, time.monotonic()))

    return send


CATCH_UP_S = 1.0
"""How late a paced simulated rank may fall (its process descheduled) and still catch up on its schedule."""

class SimRank:
    """One simulated rank: the managed loop's messages without training."""

    def __init__(self, rank: int, conn: Any, ms: float, pacer: Any) -> None:
        self.rank, self.conn, self.ms = rank, conn, ms
        self.pacer = pacer
        """The rank worker's own BatchReportPacer (no timer thread: the loop flushes what is due)."""
        self.plans: deque[tuple[int, int, int, int]] = deque()
        self.chunk: Optional[list[int]] = None  # [epoch, offset, size, chunk, batches left, batches done]
        self.steps = 0  # since the last update
        self.total_steps = 0
        self.waiting = False  # barrier (snapshot sent, update awaited) or throttled
        self.done = False
        self.last_send: Optional[float] = None  # last batch / metrics sent this window
        self.completed_at: Optional[float] = None
        """When this window's count was completed: the report the coordinator's ReportPace named went (None: no
        pace this window, or not reached)."""
        self.next_t = 0.0
        self.scheduled: Optional[float] = None
        """When it is due in the process's step schedule (:attr:`SimProcess.due`; None: not in it, nothing to do until
        a plan, an update or the go arrives)."""
        self.gen = 0
        """Its entry in that schedule: an entry of an older generation was superseded by an earlier one."""
        self.flush_scheduled = False
        """In the process's flush schedule (:attr:`SimProcess.flushes`): its pacer holds reports."""


class SimProcess:
    def __init__(self, ranks: list[int], rdv: dict[str, Any], out: dict[str, Any], *, rate: float, deadline: float,
                 max_batches: Optional[int], coalesce_ms: float = 0.0, node_size: int = 0) -> None:
        import torch

        from flodl_exp.protocol import wire
        from flodl_exp.protocol.codec import encode
        from flodl_exp.protocol.hello import Hello
        from flodl_exp.rank.backends import CoordinatorBackend, snapshot_nbytes
        from flodl_exp.rank.cadence import rank_cadence
        from flodl_exp.rank.report_pacer import BatchReportPacer

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))
        self.backend = CoordinatorBackend()
        self.wire = wire
        self.rate, self.deadline, self.max_batches = rate, deadline, max_batches
        self.out = out
        self.sel = selectors.DefaultSelector()
        self.sims: list[SimRank] = []
        self.due: list[tuple[float, int, int, SimRank]] = []
        """The ranks that may report, by when (a heap): each pass touches only the ranks due, not all N/k of them
        (the scan over every rank, twice a pass, was a third of a simulating process's CPU, taken from the
        coordinator on the same cores; see :meth:`run`)."""
        self.flushes: list[tuple[float, int, SimRank]] = []
        """The ranks whose pacer holds reports, by when they must leave (a heap)."""
        self.started = False
        self.finished = 0
        """Ranks done (their connection closed)."""
        self.by_rank: dict[int, SimRank] = {}
        self.groups: dict[int, list[int]] = {}
        """node_size: leader -> its node's ranks (the coordinator's NodeGroup); this process plays every node's
        leader and its relay: the members' snapshots meet in memory, no socket (the coordinator's cost is measured)."""
        self.node_snaps: dict[int, dict[int, Any]] = {}
        """leader -> rank -> its snapshot for the reduce asked (the partial goes when the node's are all in)."""
        self.sent_snaps: dict[int, list[Any]] = {}
        self.tl: Optional[dict[str, Any]] = ({"writes": {}, "calls": {}, "paces": [], "gaps": []}
                                             if os.environ.get("BENCH_TIMELINE") else None)
        """The timeline: per rank its writes and the time each Batch report was taken; ReportPace arrivals; the
        loop's long passes."""
        model_bytes = snapshot_nbytes(self.model)
        bs = int(rdv["batch_size"])
        self.bs = bs
        self.cadence = rank_cadence(int(rdv["world_size"]), coalesce_ms, float(rdv["heartbeat_timeout_s"]))
        """The real ranks' clocks for this world (rank/cadence.py): report coalescing, heartbeat, telemetry."""
        self.next_heartbeat = self.next_telemetry = 0.0
        for i, r in enumerate(ranks):
            # node_size: this process's ranks, node_size at a time, each on a node of its own name
            host = f"{os.uname().nodename}-p{ranks[0]}-n{i // node_size}" if node_size > 1 else os.uname().nodename
            conn = wire.dial(HOST, int(rdv["port"]), timeout=30)
            hello = Hello(rank=r, host=host, pid=os.getpid(), device="cpu", model_bytes=model_bytes,
                          samples=int(rdv["samples"]))
            wire.client_handshake(conn, rdv["token"], hello.to_dict(), timeout=60)
            conn.max_frame_bytes = wire.frame_ceiling(model_bytes)
            writes: list[Any] = []
            pacer = BatchReportPacer(_sender(conn, encode, writes if self.tl is not None else None,
                                             self._reports_of(r)), self.cadence.report_coalesce_s)
            # Unpaced: a little heterogeneity for ElChe. Paced: every rank reports the time its pace gives it, so
            # ElChe's counts match what the ranks do (reporting 10 and 14 ms at one pace made a quarter of the
            # ranks finish each window early and wait: 78 s for a 60 s load at N=1,024).
            ms = 1e3 / rate if rate > 0 else (10.0 if r % 4 else 14.0)
            sim = SimRank(r, conn, ms=ms, pacer=pacer)
            if self.tl is not None:
                self.tl["writes"][r] = writes
                self.tl["calls"][r] = []
            self.sims.append(sim)
            self.by_rank[r] = sim
            self.sel.register(conn.sock, selectors.EVENT_READ, sim)
        out.update(handshaken=len(self.sims), batches=0, metrics=0, snapshots=0, updates=0, rp=[], windows=[], completions=[],
                   evals=0, saves=0, exited=0, frames=0)

    def send(self, sim: SimRank, payload: Any) -> None:
        sim.pacer.send(payload)

    def _reports_of(self, r: int) -> Callable[[], int]:
        """Rank ``r``'s reports taken so far (the timeline's writes)."""
        return lambda: self.by_rank[r].pacer.reports

    # -- coordinator -> rank ------------------------------------------------
    def on_message(self, sim: SimRank, msg: Any) -> None:
        from flodl_exp.protocol import codec

        for part in codec.unbundle(msg):  # a bundle frame holds several messages, in order
            self.on_payload(sim, codec.decode(part))

    def on_payload(self, sim: SimRank, m: Any) -> None:
        from flodl_exp.protocol import messages as p

        out = self.out
        if isinstance(m, (p.StartEpoch, p.ExtendPartition)):
            sim.plans.append((m.epoch, m.offset, m.size, m.chunk))
            self.wake(sim)
        elif isinstance(m, p.RequestParams):
            now = time.monotonic()
            out["rp"].append([m.version, now])
            out["windows"].append([m.version, sim.last_send])
            out["completions"].append([m.version, sim.completed_at])
            sim.completed_at = None
            snap = self.backend.snapshot(self.model, sim.steps)
            snap.version = m.version
            out["snapshots"] += 1
            sim.waiting = sim.waiting or m.barrier
            leader = next((q for q, ms in self.groups.items() if sim.rank in ms), None)
            if leader is None:
                self.send(sim, snap)
            else:
                self.to_leader(leader, sim.rank, snap)
        elif isinstance(m, p.Update):
            self.adopted(sim)
            if m.next_plan is not None:
                e, o, s, c = (int(x) for x in m.next_plan)
                sim.plans.append((e, o, s, c))
            self.wake(sim)
        elif isinstance(m, p.NodeGroup):
            self.groups[m.leader] = list(m.members)
        elif isinstance(m, p.NodeUpdate):
            from flodl_exp.node_average import node_drift

            for r in m.ranks:
                self.adopted(self.by_rank[r])
                self.wake(self.by_rank[r])
            snaps = self.sent_snaps.pop(sim.rank, [])
            self.send(sim, p.NodeDrift(version=m.version, ranks=list(m.ranks), drift=node_drift(snaps, m)))
        elif isinstance(m, p.Throttle):
            sim.waiting = True
        elif isinstance(m, p.ReportPace):
            if self.tl is not None:
                self.tl["paces"].append([sim.rank, time.monotonic(), m.flush_at, sim.pacer.reports])
            sim.pacer.pace(m.flush_at)
        elif isinstance(m, p.ExecuteEval):
            self.send(sim, p.EvalResult(epoch=m.epoch, metrics={"accuracy": 0.5}, final=m.final, elapsed_ms=1.0))
            out["evals"] += 1
        elif isinstance(m, p.Save):
            self.send(sim, p.SaveResult(stem=m.stem))
            out["saves"] += 1
        elif isinstance(m, p.Shutdown):
            self.send(sim, p.Exiting(rank=sim.rank, pid=os.getpid(), hash="sim", steps=sim.total_steps, global_step=0))
            out["exited"] += 1
            self.finish(sim)
        # heartbeats, global steps, epoch roles, advisories, epoch aggregates: nothing to do

    def adopted(self, sim: SimRank) -> None:
        self.out["updates"] += 1
        sim.steps, sim.waiting, sim.last_send = 0, False, None
        sim.next_t = 0.0  # resume at the pace from now

    def wake(self, sim: SimRank) -> None:
        """Put ``sim`` in the step schedule at its next pace (once, or earlier when an update reset its pace; a rank
        that cannot report is dropped when due)."""
        if self.started and not sim.done and (sim.scheduled is None or sim.next_t < sim.scheduled):
            sim.scheduled, sim.gen = sim.next_t, sim.gen + 1
            heapq.heappush(self.due, (sim.next_t, sim.rank, sim.gen, sim))

    def schedule_flush(self, sim: SimRank) -> None:
        """Put ``sim`` in the flush schedule when its pacer holds reports."""
        if not sim.flush_scheduled and (at := sim.pacer.due()) is not None:
            sim.flush_scheduled = True
            heapq.heappush(self.flushes, (at, sim.rank, sim))

    def to_leader(self, leader: int, r: int, snap: Any) -> None:
        """A member's snapshot handed to its node's leader (in memory); the last one in sends the node's partial."""
        from flodl_exp.node_average import node_partial

        got = self.node_snaps.setdefault(leader, {})
        got[r] = snap
        if len(got) < len(self.groups[leader]):
            return
        ranks = sorted(got)
        snaps = [got[q] for q in ranks]
        self.node_snaps[leader] = {}
        self.sent_snaps[leader] = snaps
        self.send(self.by_rank[leader], node_partial(int(snap.version), ranks, snaps, 1.0))

    def finish(self, sim: SimRank) -> None:
        if not sim.done:
            sim.done = True
            self.finished += 1
            self.sel.unregister(sim.conn.sock)
            sim.conn.close()

    def read(self, sim: SimRank) -> None:
        for _ in range(256):  # bounded: the other ranks get their turn
            if sim.done:
                return
            try:
                msg = sim.conn.recv(timeout=0)
            except TimeoutError:
                return
            except self.wire.WireError:
                self.finish(sim)
                return
            self.on_message(sim, msg)

    # -- rank -> coordinator ---------------------------------------------------
    def step(self, sim: SimRank, now: float) -> bool:
        """Report one batch (or a finished chunk) if this rank has work; True when it sent something."""
        from flodl_exp.protocol.messages import Batch, ChunkMetrics

        if sim.done or sim.waiting or now < sim.next_t:
            return False
        if sim.chunk is None:
            if not sim.plans:
                return False
            e, o, s, c = sim.plans.popleft()
            sim.chunk = [e, o, s, c, s // self.bs, 0]
        e, o, s, c, left, done = sim.chunk
        if left > 0 and (self.max_batches is None or self.out["batches"] < self.max_batches):
            if self.tl is not None:
                self.tl["calls"][sim.rank].append(time.monotonic())
            self.send(sim, Batch(ms=sim.ms, data_ms=0.05, chunk=c, loss=1.0, lr=0.1))
            if sim.pacer.flush_at and sim.pacer.reports == sim.pacer.flush_at:
                sim.completed_at = time.monotonic()  # the report that completes the count: it went at once
            sim.chunk[4], sim.chunk[5] = left - 1, done + 1
            sim.steps += 1
            sim.total_steps += 1
            self.out["batches"] += 1
            if self.rate > 0:
                # A fixed schedule: a simulating process that lost the CPU a while catches up (up to CATCH_UP_S
                # late), so the offered load is the paced rate, not the rate less every pass's delay (69 % of
                # it at N=1,024 before). A rank that waited for its update resumes at its pace, no burst
                # (Update resets the schedule), as a real one loses the batches it did not train meanwhile.
                period = 1.0 / self.rate
                sim.next_t = sim.next_t + period if now - sim.next_t < CATCH_UP_S else now + period
        else:
            self.send(sim, ChunkMetrics(epoch=e, chunk=c, avg_loss=1.0, batches=done, samples=done * self.bs,
                                        epoch_ms=done * sim.ms, share_complete_ms=done * sim.ms,
                                        compute_only_ms=done * sim.ms, data_starve_ms=0.0,
                                        ranges=[[o, done * self.bs]] if done else []))
            self.out["metrics"] += 1
            sim.chunk = None
        sim.last_send = time.monotonic()
        return True

    def beat(self, now: float) -> None:
        """Each rank's heartbeat and telemetry report when their clocks (:attr:`cadence`) are due."""
        from flodl_exp.protocol.messages import Heartbeat, Telemetry

        heartbeat, telemetry = now >= self.next_heartbeat, now >= self.next_telemetry
        if heartbeat:
            self.next_heartbeat = now + self.cadence.heartbeat_s
        if telemetry:
            self.next_telemetry = now + self.cadence.telemetry_s
        if not (heartbeat or telemetry):
            return
        for sim in self.sims:
            if not sim.done:
                try:
                    if heartbeat:
                        self.send(sim, Heartbeat(steps=sim.total_steps, state="wait" if sim.waiting else "train"))
                    if telemetry:
                        self.send(sim, Telemetry(cpu_pct=50.0, rss_gb=0.1))
                except self.wire.WireError:
                    self.finish(sim)

    def run(self, go: Optional[str] = None) -> None:
        self.next_heartbeat = time.monotonic() + self.cadence.heartbeat_s
        self.next_telemetry = time.monotonic() + self.cadence.telemetry_s
        while go is not None and not os.path.exists(go) and time.monotonic() < self.deadline:
            for key, _ in self.sel.select(timeout=0.05):  # plans arrive and queue; no batch yet
                self.read(key.data)
            self.beat(time.monotonic())
        self.out["t_go"] = time.monotonic()
        self.started = True
        for sim in self.sims:
            self.wake(sim)
        cpu0 = time.process_time()
        prev = time.monotonic()
        while time.monotonic() < self.deadline and self.finished < len(self.sims):
            now = time.monotonic()
            if self.tl is not None and now - prev > 0.02:
                self.tl["gaps"].append([prev, now])
            prev = now
            ready = []
            while self.due and self.due[0][0] <= now:
                _, _, gen, sim = heapq.heappop(self.due)
                if gen == sim.gen and sim.scheduled is not None:  # not superseded
                    sim.scheduled = None
                    ready.append(sim)
            for sim in ready:  # popped first: an unpaced rank (due at once again) steps once a pass
                try:
                    if self.step(sim, now) or (not sim.waiting and now < sim.next_t):
                        self.wake(sim)
                        self.schedule_flush(sim)
                except self.wire.WireError:
                    self.finish(sim)
            while self.flushes and self.flushes[0][0] <= now:
                sim = heapq.heappop(self.flushes)[2]
                sim.flush_scheduled = False
                try:
                    sim.pacer.flush_if_due(now)
                    self.schedule_flush(sim)
                except self.wire.WireError:
                    self.finish(sim)
            nxt = min([h[0][0] for h in (self.due, self.flushes) if h] + [now + 0.01])
            for key, _ in self.sel.select(timeout=max(0.0, nxt - time.monotonic())):
                self.read(key.data)
            self.beat(now)
        self.out["cpu_s"] = time.process_time() - cpu0
        self.out["frames"] = sum(s.pacer.frames for s in self.sims)
        self.out["t_end"] = time.monotonic()
        for sim in self.sims:
            self.finish(sim)


def sim_entry(args: argparse.Namespace) -> None:
    """``--sim``: one process of simulated ranks (its share of the world), results to ``--out``."""
    rdv = json.loads(Path(args.rdv).read_text())
    ranks = [int(r) for r in args.ranks.split(",")]
    if os.environ.get("BENCH_SIM_NICE"):  # a diagnostic: the simulated ranks yield the CPU to the coordinator
        os.nice(int(os.environ["BENCH_SIM_NICE"]))
    out: dict[str, Any] = {"ranks": len(ranks), "handshaken": 0}
    try:
        proc = SimProcess(ranks, rdv, out, rate=args.rate, deadline=time.monotonic() + args.seconds,
                          max_batches=args.max_batches, coalesce_ms=args.coalesce_ms, node_size=args.node_size)
        proc.run(args.go)
        if proc.tl is not None:
            Path(args.out + ".tl.json").write_text(json.dumps(proc.tl))
    except Exception as e:  # reported to the parent, which fails the run
        out["error"] = f"{type(e).__name__}: {e}"
    Path(args.out).write_text(json.dumps(out))
    os._exit(0)


# ------------------------------------------------------------------ one run
def raise_nofile(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = hard if hard != resource.RLIM_INFINITY else max(need, soft)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        raise SystemExit(f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors this size needs")
    return soft


def compose_config(n: int, batch_size: int, uri: str, coalesce_ms: float = 50.0, node_reduce: bool = False) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flodl_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "mode=cpu_cadence", "experiment=digits_logistic", "experiment.epochs=1",
            f"experiment.batch_size={batch_size}", f"cluster.ranks_per_node={n}", "cluster.device=cpu",
            "eval.every=0", "cluster.heartbeat_timeout_s=60", f"tracking.uri={uri}",
            f"cluster.report_coalesce_ms={coalesce_ms}", f"cluster.node_reduce={str(node_reduce).lower()}",
            # no launcher here to deliver the records: the job's sink process does; no prediction at the run's end
            # (its simulated control core would count in the coordinator's own timers)
            "tracking.relay=false", "tracking.predict=false"])
    return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def _proc_sample(pid: int) -> Optional[tuple[float, float, int]]:
    """(monotonic now, cpu seconds, rss bytes) of ``pid`` from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), cpu, rss_pages * os.sysconf("SC_PAGE_SIZE")


def _threads_sample(pid: int) -> dict[int, tuple[float, float, int, int]]:
    """Each thread of ``pid``: (cpu ms, ms waiting on a run queue, voluntary and involuntary context switches)."""
    out: dict[int, tuple[float, float, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            cpu, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            cs = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches" in line)
            out[int(tid)] = (int(cpu) / 1e6, int(wait) / 1e6, int(cs["voluntary_ctxt_switches"]),
                             int(cs["nonvoluntary_ctxt_switches"]))
        except (OSError, ValueError, KeyError):
            continue
    return out


def _thread_shares(pid: int, tsamples: list[tuple[float, dict[int, Any]]], t0: Optional[float],
                   t1: Optional[float]) -> dict[str, float]:
    """Over the busy span: the main thread's and the read thread's (the other thread with the most CPU) CPU and
    run-queue wait (% of the span) and context switches per second."""
    busy = [x for x in tsamples if t0 is not None and t1 is not None and t0 <= x[0] <= t1]
    if len(busy) < 2:
        return {}
    (ta, a), (tb, b) = busy[0], busy[-1]
    span = tb - ta
    d = {tid: [y - x for x, y in zip(a[tid], b[tid])] for tid in b if tid in a}
    other = max((tid for tid in d if tid != pid), key=lambda tid: d[tid][0], default=None)
    out: dict[str, float] = {}
    for name, tid in (("main", pid), ("read", other)):
        if tid in d:
            cpu, wait, vcs, ncs = d[tid]
            out.update({f"{name}_cpu_pct": cpu / span / 10, f"{name}_runq_pct": wait / span / 10,
                        f"{name}_cs_per_s": (vcs + ncs) / span})
    return out


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_once(n: int, *, batches: int, procs: int, rate: float = 0.0, timeout_s: float = DEFAULT_TIMEOUT_S,
             batch_size: int = 8, workdir: Optional[str] = None, profile: Optional[str] = None,
             keep: bool = False, coalesce_ms: float = 50.0, profile_s: float = 8.0, node_size: int = 0) -> dict[str, Any]:
    """One coordinator and ``n`` simulated ranks until the run ends (or ``timeout_s``); the measurements."""
    raise_nofile(n + 256)
    from flodl_exp import tracking
    from flodl_exp.job_spec import JobSpec

    tmp = Path(workdir or tempfile.mkdtemp(prefix="bench-coord-"))
    tmp.mkdir(parents=True, exist_ok=True)
    job = tmp / f"job-{n}-{time.time_ns()}"
    job.mkdir(mode=0o700)
    uri = f"sqlite:///{tmp}/mlflow.db"
    cfg = compose_config(n, batch_size, uri, coalesce_ms, node_reduce=node_size > 1)
    run_id = tracking.create_run(uri, "bench_coordinator", str(tmp / "mlartifacts"), f"bench-{n}", {"world_size": n},
                                 {"bench": "coordinator"})
    per_rank = max(1, batches // n)
    spec = JobSpec(config=cfg, run_id=run_id, tracking_uri=uri, job_dir=str(job),
                   checkpoint_stem=str(job / "checkpoints" / "final"), shuffle_seed=42, import_paths=(str(ROOT),))
    (job / "spec.json").write_text(json.dumps(spec.to_dict()))
    stats_path = job / "coordinator_stats.json"
    env = dict(os.environ, **{STATS_ENV: str(stats_path), "PYTHONPATH": str(ROOT)})
    log_fh = open(job / "coordinator.log", "ab")
    started: list[subprocess.Popen] = []
    samples: list[tuple[float, float, int]] = []
    tsamples: list[tuple[float, dict[int, Any]]] = []
    try:
        coord = subprocess.Popen([sys.executable, __file__, "--coordinator", str(job / "spec.json"), HOST], cwd=ROOT,
                                 env=env, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(coord)
        rdv_path = job / "rendezvous.json"
        deadline = time.monotonic() + 60
        while not rdv_path.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: see {job / 'coordinator.log'}")
            time.sleep(0.05)
        rdv = json.loads(rdv_path.read_text())
        rdv.update(batch_size=batch_size, samples=per_rank * n * batch_size, world_size=n,
                   heartbeat_timeout_s=cfg["cluster"]["heartbeat_timeout_s"])
        sim_rdv = job / "rendezvous_sim.json"
        sim_rdv.write_text(json.dumps(rdv))
        os.chmod(sim_rdv, 0o600)
        k = max(1, min(procs, n))
        outs = [job / f"sim{i}.json" for i in range(k)]
        go = job / "go"
        t_start = time.monotonic()
        for i in range(k):
            ranks = ",".join(str(r) for r in range(i, n, k))
            started.append(subprocess.Popen(
                [sys.executable, __file__, "--sim", "--rdv", str(sim_rdv), "--ranks", ranks, "--out", str(outs[i]),
                 "--rate", str(rate), "--seconds", str(timeout_s), "--go", str(go), "--coalesce-ms", str(coalesce_ms),
                 "--node-size", str(node_size)],
                cwd=ROOT, env=env,
                stdin=subprocess.DEVNULL))
        wait_quiet(job, coord, started, deadline=time.monotonic() + 120)
        go.touch()
        prof = None
        hard_deadline = time.monotonic() + timeout_s + 30
        while coord.poll() is None and time.monotonic() < hard_deadline:
            s = _proc_sample(coord.pid)
            if s:
                samples.append(s)
                tsamples.append((s[0], _threads_sample(coord.pid)))
            if profile and prof is None and samples and len(samples) > 4 and _first_batch_seen(job):
                prof = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-o", profile,
                                         "--pid", str(coord.pid), "-d", str(int(max(1, profile_s))), "-r", "50", "--nonblocking", "--threads",
                                         *(["--format", "raw"] if profile.endswith(".txt") else [])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                started.append(prof)
            time.sleep(0.1)
        wall = time.monotonic() - t_start
        for p in started[1:]:
            try:
                p.wait(timeout=max(1.0, hard_deadline - time.monotonic() + 10))
            except subprocess.TimeoutExpired:
                _kill(p)
        if coord.poll() is None:
            _kill(coord)
            raise RuntimeError(f"the coordinator did not end within {timeout_s:.0f}s (log {job / 'coordinator.log'})")
        sims = [json.loads(o.read_text()) if o.exists() else {"error": "no output"} for o in outs]
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        result = json.loads((job / "result.json").read_text()) if (job / "result.json").exists() else {}
    finally:
        for p in started:
            _kill(p)
        log_fh.close()
        if not keep and workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {**summarise(n, stats, sims, samples, result, wall),
            **_thread_shares(coord.pid, tsamples, stats.get("t_first"), stats.get("t_last"))}


def wait_quiet(job: Path, coord: subprocess.Popen, procs: list[subprocess.Popen], deadline: float) -> None:
    """Every rank joined and the coordinator is idle (its MLflow sink has opened the store: seconds of imports
    that would otherwise compete with the first measured batches), bounded by ``deadline``."""
    while not _event_seen(job, "started"):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not all join: see {job / 'coordinator.log'}")
        time.sleep(0.1)
    prev = _proc_sample(coord.pid)
    while prev is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        cur = _proc_sample(coord.pid)
        if cur is None or (cur[1] - prev[1]) / (cur[0] - prev[0]) < 0.15:
            return
        prev = cur


def _event_seen(job: Path, event: str) -> bool:
    try:
        return f'"event": "{event}"' in (job / "events.jsonl").read_text()
    except OSError:
        return False


def _first_batch_seen(job: Path) -> bool:
    try:
        return '"first_batch"' in (job / "events.jsonl").read_text()
    except OSError:
        return False


def summarise(n: int, stats: dict[str, Any], sims: list[dict[str, Any]], samples: list[tuple[float, float, int]],
              result: dict[str, Any], wall: float) -> dict[str, Any]:
    errors = [s["error"] for s in sims if s.get("error")]
    t0, t1 = stats.get("t_first"), stats.get("t_last")
    span = (t1 - t0) if t0 is not None and t1 is not None and t1 > t0 else float("nan")
    turns = stats.get("turns", [])
    # the last count of each window: the latest batch/metrics any rank sent before that reduce's trigger
    last: dict[int, list[float]] = {}
    for s in sims:
        for v, t in s.get("windows", []):
            if t is not None:
                last.setdefault(int(v), []).append(float(t))
    trig_ms = []
    for v, t, _final in stats.get("triggers", []):
        before = [x for x in last.get(int(v), []) if x <= t]
        if before:
            trig_ms.append((t - max(before)) * 1e3)
    trig_each = [round(x, 1) for x in trig_ms]  # in reduce order: the p99 of a run's few reduces is its worst one
    # the same from the count-completing reports (ReportPace's flush_at) alone: a rank that trains on past its count
    # until the request comes makes "the last send before the trigger" some other rank's older one
    done: dict[int, list[float]] = {}
    for s in sims:
        for v, t in s.get("completions", []):
            if t is not None:
                done.setdefault(int(v), []).append(float(t))
    count_ms = [round((t - max(x for x in done[int(v)] if x <= t)) * 1e3, 1) for v, t, _f in stats.get("triggers", [])
                if any(x <= t for x in done.get(int(v), []))]
    trig_ms.sort()
    busy = [x for x in samples if t0 is not None and t1 is not None and t0 <= x[0] <= t1]
    cpu = (100.0 * (busy[-1][1] - busy[0][1]) / (busy[-1][0] - busy[0][0])
           if len(busy) >= 2 and busy[-1][0] > busy[0][0] else float("nan"))
    return {
        "n": n,
        "status": result.get("status"),
        "errors": errors,
        "handshaken": sum(s.get("handshaken", 0) for s in sims),
        "sent": sum(s.get("batches", 0) for s in sims),
        "frames": sum(s.get("frames", 0) for s in sims),

        "absorbed": stats.get("batches", 0),
        "snapshots": sum(s.get("snapshots", 0) for s in sims),
        "updates": sum(s.get("updates", 0) for s in sims),
        "exited": sum(s.get("exited", 0) for s in sims),
        "reduces": len(stats.get("triggers", [])),
        "batch_per_s": stats.get("batches", 0) / span if span == span and span > 0 else float("nan"),
        "turn_p50_ms": _pct(turns, 0.50) * 1e3,
        "turn_p99_ms": _pct(turns, 0.99) * 1e3,
        "trig_p50_ms": _pct(trig_ms, 0.50),
        "trig_p99_ms": _pct(trig_ms, 0.99),
        "trig_each_ms": trig_each,
        "trig_count_ms": count_ms,
        "trig_queue_ms": [None if x is None else round(x, 1) for x in stats.get("trigger_qdelay_ms", [])],
        "queue_p50_ms": _pct(stats.get("qdelay_ms", []), 0.50),
        "queue_p99_ms": _pct(stats.get("qdelay_ms", []), 0.99),
        "cpu_pct": cpu,
        "rss_mb": max((x[2] for x in samples), default=0) / 2**20,
        "cpu_us_per_batch": (cpu / 100 * span * 1e6 / stats["batches"]) if stats.get("batches") else float("nan"),
        "sim_cpu_pct": (100.0 * sum(s.get("cpu_s", 0.0) for s in sims)
                        / max(1e-9, max((s.get("t_end", 0.0) for s in sims), default=0.0)
                              - min((s.get("t_go", 0.0) for s in sims), default=0.0))),
        "reduce_ms": statistics.median([(f - t) * 1e3 for (_, t, _), (_, f) in zip(stats.get("triggers", []),
                                                                              stats.get("finishes", []))] or [float("nan")]),
        **_reduce_phases(stats),
        "asked_ms": _asked_ms(stats, sims),
        "span_s": span,
        "wall_s": wall,
    }


def _asked_ms(stats: dict[str, Any], sims: list[dict[str, Any]]) -> float:
    """Median over the reduces of the trigger to the last rank receiving its snapshot request (ms)."""
    asked: dict[int, float] = {}
    for s in sims:
        for v, t in s.get("rp", []):
            asked[int(v)] = max(asked.get(int(v), 0.0), float(t))
    return _median_or_nan([(asked[int(v)] - t) * 1e3 for v, t, _ in stats.get("triggers", []) if int(v) in asked])


def _median_or_nan(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _reduce_phases(stats: dict[str, Any]) -> dict[str, float]:
    """Medians over the run's reduces of where a reduce's time goes (ms): ``to sent``, the trigger to the last
    update sent (``reduce ms`` stops at the averaging's end); ``asked`` (:func:`_asked_ms`), the trigger to the
    last rank holding its snapshot request; the trigger to the first snapshot
    handled (the requests out and the first answer back), the first to the last snapshot (the answers arriving
    through the reader thread), the last snapshot to the averaging's end (``average``), and from there to the
    updates sent (``flush``: the next chunks planned, the folded updates encoded and written); ``finish cpu``: the
    main thread's own CPU time from the last snapshot to the updates sent (the wall time less what the reader
    thread and the other processes took from it: the figure a change of the coordinator's own work moves on a
    busy machine)."""
    snaps = stats.get("snaps", {})
    sent = stats.get("sent", {})
    first, rest, avg, flush, whole, drift = [], [], [], [], [], []
    for (v, t, _), (_, f), fl in zip(stats.get("triggers", []), stats.get("finishes", []), stats.get("flushed", [])):
        to_leaders = sent.get(str(v))
        whole.append(((to_leaders if to_leaders is not None else fl) - t) * 1e3)
        if to_leaders is not None:
            drift.append((fl - to_leaders) * 1e3)
        s = snaps.get(str(v))
        if s is None:
            continue
        first.append((s[0] - t) * 1e3)
        rest.append((s[1] - s[0]) * 1e3)
        avg.append(((to_leaders if to_leaders is not None else f) - s[1]) * 1e3)
        flush.append((fl - f) * 1e3)
    med = _median_or_nan
    return {"reduce_sent_ms": med(whole), "first_snap_ms": med(first), "snaps_ms": med(rest), "average_ms": med(avg), "flush_ms": med(flush),
            "drift_ms": med(drift), "finish_cpu_ms": med([c * 1e3 for c in stats.get("finish_cpu", [])])}


COLUMNS = [("n", "N", "{:d}"), ("batch_per_s", "batch/s", "{:,.0f}"), ("turn_p50_ms", "turn p50 ms", "{:.2f}"),
           ("turn_p99_ms", "turn p99 ms", "{:.2f}"), ("trig_p50_ms", "trig p50 ms", "{:.1f}"),
           ("trig_p99_ms", "trig p99 ms", "{:.1f}"), ("queue_p99_ms", "queue p99 ms", "{:.1f}"), ("cpu_pct", "cpu %", "{:.0f}"),
           ("cpu_us_per_batch", "cpu us/batch", "{:.0f}"), ("rss_mb", "rss MB", "{:.0f}"),
           ("reduces", "reduces", "{:d}"), ("reduce_ms", "reduce ms", "{:.0f}"), ("reduce_sent_ms", "to sent ms", "{:.0f}"),
           ("asked_ms", "asked ms", "{:.0f}"),
           ("first_snap_ms", "1st snap ms", "{:.0f}"), ("snaps_ms", "snaps ms", "{:.0f}"),
           ("average_ms", "average ms", "{:.0f}"), ("flush_ms", "flush ms", "{:.0f}"), ("drift_ms", "drift ms", "{:.0f}"),
           ("finish_cpu_ms", "finish cpu ms", "{:.0f}"), ("absorbed", "batches", "{:d}")]


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, _, fmt in COLUMNS:
        vals = [r[key] for r in runs if r[key] == r[key]]
        if not vals:
            row[key] = float("nan")
        elif fmt == "{:d}":
            row[key] = int(statistics.median_low(vals))
        else:
            row[key] = statistics.median(vals)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for row in rows:
        cells = [("nan" if row[k] != row[k] else fmt.format(row[k])) for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class LoadPlan:
    """How hard and how long each run drives the coordinator: as fast as it goes for a number of batches, or paced
    (every rank at ``rate`` batches/s for ``seconds``). Pure: unit-tested."""

    rate: float
    seconds: Optional[float]
    min_batches: int

    def batches(self, n: int) -> int:
        """Timing messages of a run of ``n`` ranks (paced: n x rate x seconds; at least 20 per rank either way)."""
        if self.seconds is not None:
            return max(20 * n, int(round(n * self.rate * self.seconds)))
        return max(self.min_batches, 20 * n)

    @property
    def timeout_s(self) -> float:
        """The run's bound: paced, twice its length plus start-up and the run's end (it stops by itself before)."""
        return DEFAULT_TIMEOUT_S if self.seconds is None else max(DEFAULT_TIMEOUT_S, 2 * self.seconds + 60)


def load_plan(pace: Optional[float], seconds: Optional[float], rate: float, batches: int) -> LoadPlan:
    """The command line's load: ``--pace R [--seconds S]`` or ``--rate``/``--batches``."""
    if pace is None:
        if seconds is not None:
            raise SystemExit("--seconds needs --pace (a paced run's length)")
        return LoadPlan(rate=rate, seconds=None, min_batches=batches)
    if pace <= 0:
        raise SystemExit(f"--pace {pace}: batches per rank and second, > 0")
    s = PACED_SECONDS if seconds is None else seconds
    if s <= 0:
        raise SystemExit(f"--seconds {s}: > 0")
    return LoadPlan(rate=pace, seconds=s, min_batches=batches)


def paced_line(row: dict[str, Any]) -> str:
    """The issue's summary of one size (medians over the runs): the trigger's p99, the coordinator's CPU (% of one
    core), a reduce from its trigger to the last update sent, and the coordinator's peak RSS."""
    def f(key: str, fmt: str) -> str:
        v = row.get(key, float("nan"))
        return "nan" if v != v else fmt.format(v)

    return (f"paced N={row['n']}: trigger p99 {f('trig_p99_ms', '{:.1f}')} ms, coordinator cpu {f('cpu_pct', '{:.0f}')} %, "
            f"reduce {f('reduce_sent_ms', '{:.0f}')} ms, rss {f('rss_mb', '{:.0f}')} MB")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rdv", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=None,
                    help="with --pace: how long each run trains, s (default 60); the run stops by itself then")
    ap.add_argument("--max-batches", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="N = 8 and 64 only")
    ap.add_argument("--sizes", default="8,64,256,1024", help="comma-separated world sizes")
    ap.add_argument("--reps", type=int, default=3, help="runs per size (the table shows medians)")
    ap.add_argument("--batches", type=int, default=60_000, help="timing messages per run (at least 20 per rank)")
    ap.add_argument("--procs", type=int, default=4, help="processes driving the simulated ranks")
    ap.add_argument("--rate", type=float, default=0.0, help="batches per rank and second (0 = as fast as possible)")
    ap.add_argument("--pace", type=float, default=None,
                    help="paced load (issue 52): every rank at this many batches/s for --seconds; each run has "
                         "N x pace x seconds batches, and the output ends with one 'paced N=...' line per size")
    ap.add_argument("--coalesce-ms", type=float, default=50.0,
                    help="cluster.report_coalesce_ms of the run and its simulated ranks (0 = a frame per batch)")
    ap.add_argument("--node-size", type=int, default=0,
                    help="hierarchical averaging (cluster.node_reduce, issue 52): each simulating process's ranks "
                         "form nodes of this many, a leader answering each reduce with the node's partial "
                         "(0 = flat: every rank answers the coordinator)")
    ap.add_argument("--profile", default=None, help="py-spy flame graph of the coordinator (first run of the largest size)")
    ap.add_argument("--keep", default=None, help="keep the job folders under this directory")
    ap.add_argument("--json", default=None, help="also write every run's measurements here")
    args, rest = ap.parse_known_args(argv)
    if args.coordinator:
        coordinator_entry([sys.argv[0], *rest])
        return 0
    if args.sim:
        if args.seconds is None:
            args.seconds = DEFAULT_TIMEOUT_S
        sim_entry(args)
        return 0
    sizes = [8, 64] if args.quick else [int(s) for s in args.sizes.split(",")]
    plan = load_plan(args.pace, args.seconds, args.rate, args.batches)
    rows, every = [], []
    for n in sizes:
        runs = []
        for i in range(args.reps):
            prof = args.profile if (args.profile and n == max(sizes) and i == 0) else None
            r = run_once(n, batches=plan.batches(n), procs=args.procs, rate=plan.rate, profile=prof,
                         workdir=args.keep, coalesce_ms=args.coalesce_ms, timeout_s=plan.timeout_s,
                         profile_s=plan.seconds or 8.0, node_size=args.node_size)
            print(f"N={n} run {i + 1}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                      for k, v in r.items()), flush=True)
            if r["errors"] or r["status"] != "FINISHED" or r["absorbed"] != r["sent"]:
                print(f"  warning: status {r['status']}, errors {r['errors']}, absorbed {r['absorbed']} of {r['sent']}")
            runs.append(r)
        every.extend(runs)
        rows.append(median_row(runs))
    print()
    print(table(rows))
    if args.pace is not None:
        print()
        for row in rows:
            print(paced_line(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": every, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
