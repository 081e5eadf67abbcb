"""Per-rank timelines, coordinator side (issue 17, item 4). Pure: no I/O, no torch.

The coordinator owns one :class:`TimelineRecorder` and feeds it from the handlers it already has;
no rank or wire change is needed. What it records, on the coordinator's clock:

* **compute / data**: a ``Batch`` handled at ``t`` with ``ms`` and ``data_ms`` is the span
  ``[t - ms - data_ms, t - ms]`` of data wait then ``[t - ms, t]`` of compute. The rank's clock is
  not the coordinator's, so the time the coordinator handles the report stands in for the batch's end:
  every span is shifted later by the report's transit and queueing (reports the event loop takes in a
  burst, after an averaging or an eval result, arrive together). A span that would start before the
  rank's previous one ended is packed right after it (its duration kept, ``late_s`` counts the push), so
  the lane's busy time is exactly what the ranks reported; the push is taken back by the next gap.
* **sync**: a reduce from its trigger (``Reduce.started``) to its finish, on each member's lane; on
  the cpu backend split in ``sync`` (trigger -> the last snapshot) and ``cpu_avg`` (the coordinator's
  averaging, the last snapshot -> the finish, measured around ``try_finish``). nccl members' spans end
  at their own ack (they train on after it).
* **eval**: ``ExecuteEval`` sent -> ``EvalResult`` received, on the evaluating rank's lane.
* **epochs**: each aggregated epoch's window ``[aggregated - epoch_time_s, aggregated]`` (the same wall
  its ``idle_frac`` uses) and the per-rank ``idle_frac`` logged for it.
* **idle**: what is neither compute nor data wait (so sync and eval time is idle, as in ``idle_frac``).

Epoch id = the chunk's epoch; window id = the cycle's ``version`` (finished reduces) when the batch
arrived or the reduce fired.

**Bounded.** (1) Coalescing: a rank's consecutive batches of one chunk and window extend one compute
span while the gap before each (data wait included) stays under ``merge_gap_s``; the merged data wait is
kept as the span's ``data_ms`` and only waits of ``merge_gap_s`` or more get a data span of their own.
(2) A hard cap: when a rank holds ``max_spans`` spans, the oldest half of its most numerous kind is
merged pairwise (older history gets coarser, like a log scale). (3) The events that explain gaps live
in a ring of ``EVENT_RING`` entries. Totals never come from the stored spans: busy and idle time are
summed per batch as they arrive, so merging changes the picture, never the numbers. O(1) per batch
(amortised: a compaction costs O(max_spans) once per ``max_spans / 20`` spans).

**Idle analysis.** Every idle gap is classified when it closes (the first batch after it arrives; the gap after
a rank's last batch when the analysis is taken) against the events known then: reduces (``sync``, ``cpu_avg``),
evals (any rank's: a peer's eval holds the cohort), and epoch boundaries. A gap of ``min_gap_s`` (0.5 s) or more is
weighed against every event in the ring and gets an idle span of its own; a shorter one (an nccl_sync rank's
per-step wait) against the :data:`RECENT_EVENTS` newest and the ones in flight, and is only summed. An event ``[a, b]`` counts when it lies within ``near_s`` of the gap;
its weight is its overlap with the gap, and an epoch aggregation at ``t`` inside the gap weighs
``t - gap start`` (the rank waited for the epoch to close). The kind with the largest weight is the
cause; with no overlap, the nearest event (ties: epoch boundary, eval, cpu averaging, sync); none within
``near_s``: ``unexplained``. Each lane also counts its sync spans (``sync_spans``) and their seconds
(``sync_span_s``, ``cpu_avg`` included): the time a rank spent inside reduces, idle or not.

**Against idle_frac.** The run logs ``rank<r>/idle_frac = 1 - share_e / wall_e`` per epoch (share: the
rank's compute + data wait in epoch e's chunks; wall: the epoch's accumulator, opened -> aggregated); its
wall-weighted mean over the run is ``1 - share / sum(wall_e)``. The timeline has the same numerator (its
busy time, per epoch id) and, for the comparison, the same wall: ``idle_frac_epochs = 1 - busy_in_epochs /
epoch_walls_s``. Its idle analysis is over the real training wall (training starts -> the last aggregation,
or the last batch when later: a run that failed mid-epoch), and the two differ by one term::

    epoch_walls_s - busy = idle_s + epoch_overlap_s     (epoch_overlap_s = epoch_walls_s - wall_s)

the epochs' walls overlap where a rank streams into the next epoch before the last one aggregates
(async), and each epoch then counts the rank's work on the other as idle (a bundle between epochs, in
no epoch's wall, makes the term negative). Residuals against the logged ``idle_frac``: a Batch's
``data_ms`` includes the control work handled while waiting (the chunk's ``data_starve_ms`` does not),
an epoch whose ``idle_frac`` was clipped at 0, and a dead rank's batches taken back off an epoch's books.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

KINDS = ("compute", "data", "sync", "cpu_avg", "eval", "idle")
CAUSES = ("epoch_boundary", "sync", "cpu_avg", "eval", "unexplained")
"""Idle causes: the four events, and no event near the gap. Every gap gets one, whatever its length."""
RECENT_EVENTS = 4
"""A gap under ``min_gap_s`` is classified against the newest events only (and the ones in flight): what holds a
rank for a few ms happened just before or during it, and a batch's cost stays O(1) however long the ring."""
_TIE_ORDER = {"epoch_boundary": 0, "eval": 1, "cpu_avg": 2, "sync": 3}
EVENT_RING = 4096
"""Recent events kept to classify gaps (a gap is classified as soon as it closes)."""


@dataclass(slots=True)
class Span:
    kind: str
    rank: int
    t0: float
    t1: float
    epoch: Optional[int] = None
    window: Optional[int] = None
    n: int = 1
    """Batches in a compute/data span; merged spans otherwise."""
    busy_ms: float = 0.0
    """compute: compute ms (data wait merged in: ``data_ms``); data: data wait ms; others 0."""
    data_ms: float = 0.0
    note: str = ""
    """idle: the cause; eval/sync: ``final`` for the run's final ones."""

    @property
    def duration(self) -> float:
        return self.t1 - self.t0


@dataclass(slots=True)
class _Event:
    kind: str
    t0: float
    t1: float


@dataclass
class EpochWindow:
    epoch: int
    start: float
    end: float
    idle_frac: dict[int, float] = field(default_factory=dict)


@dataclass
class _Lane:
    spans: dict[str, list[Span]] = field(default_factory=lambda: {k: [] for k in KINDS})
    count: int = 0
    last_end: Optional[float] = None
    open_key: Optional[tuple[int, int]] = None
    """(chunk, window) of the compute span still being extended."""
    compute_s: float = 0.0
    data_s: float = 0.0
    late_s: float = 0.0
    """How far spans were packed past their report's arrival, summed (see the module docstring)."""
    busy_by_epoch: dict[int, float] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    gaps: int = 0
    """Gaps of min_gap_s or more (each an idle span)."""
    sync_spans: int = 0
    """Reduces this rank took part in (its sync spans, however the stored ones were merged)."""
    sync_span_s: float = 0.0
    """Seconds inside those reduces (sync and cpu_avg spans)."""
    compactions: int = 0


class TimelineRecorder:
    def __init__(self, world_size: int, clock: Callable[[], float], *, max_spans: int = 20_000,
                 merge_gap_s: float = 0.1, min_gap_s: float = 0.5, near_s: float = 0.5) -> None:
        if max_spans < 64:
            raise ValueError(f"timeline max_spans must be >= 64, got {max_spans}")
        self.world_size = world_size
        self._clock = clock
        self.max_spans = int(max_spans)
        self.merge_gap_s = float(merge_gap_s)
        self.min_gap_s = float(min_gap_s)
        self.near_s = float(near_s)
        self.t0: Optional[float] = None
        """Training starts (the first epoch's plans go out): time 0 of the timeline."""
        self._lanes = [_Lane() for _ in range(world_size)]
        self._events: deque[_Event] = deque(maxlen=EVENT_RING)
        self._answers: dict[int, float] = {}
        self._reduce_started: Optional[float] = None
        self._evals: dict[int, tuple[float, int, bool]] = {}
        self.epochs: list[EpochWindow] = []
        self.last_t = -math.inf

    # -- feeds ----------------------------------------------------------------
    def on_start(self) -> None:
        self.t0 = self._now()
        for lane in self._lanes:
            lane.last_end = self.t0 if lane.last_end is None else lane.last_end

    def on_batch(self, r: int, ms: float, data_ms: float, *, chunk: int, epoch: Optional[int], window: int,
                 age_ms: float = 0.0) -> None:
        """One trained batch, ended ``age_ms`` before now (a report that waited on its rank to travel with others:
        rank/report_pacer.py); an age outside [0, 10 s] is read as 0 (a peer's clock is not trusted further)."""
        t = self._now()
        if 0.0 < age_ms <= 10_000.0:
            t -= age_ms / 1e3
        lane = self._lanes[r]
        prev = lane.last_end if lane.last_end is not None else (self.t0 if self.t0 is not None else t)
        ms, data_ms = max(0.0, ms), max(0.0, data_ms)
        d0 = t - (ms + data_ms) / 1e3
        if d0 < prev:  # reports taken in a burst: pack it right after the previous span, duration kept
            lane.late_s += prev - d0
            d0 = prev
        c0 = d0 + data_ms / 1e3
        t = c0 + ms / 1e3
        gap = d0 - prev
        if gap >= self.min_gap_s:
            self._idle_gap(r, prev, d0)
        elif gap > 0:
            lane.idle[self._short_cause(prev, d0)] += gap
        lane.compute_s += t - c0
        lane.data_s += c0 - d0
        if epoch is not None:
            lane.busy_by_epoch[epoch] = lane.busy_by_epoch.get(epoch, 0.0) + (t - d0)
        lane.last_end = t
        key = (chunk, window)
        last = lane.spans["compute"][-1] if lane.spans["compute"] else None
        if last is not None and lane.open_key == key and c0 - last.t1 < self.merge_gap_s:
            last.t1, last.n = t, last.n + 1
            last.busy_ms += (t - c0) * 1e3
            last.data_ms += (c0 - d0) * 1e3
            return
        if c0 - d0 >= self.merge_gap_s:
            self._add(r, Span("data", r, d0, c0, epoch, window, busy_ms=(c0 - d0) * 1e3))
            start, merged_data = c0, 0.0
        else:
            start, merged_data = d0, (c0 - d0) * 1e3
        self._add(r, Span("compute", r, start, t, epoch, window, busy_ms=(t - c0) * 1e3, data_ms=merged_data))
        lane.open_key = key

    def on_answer(self, r: int, reduce_started: float) -> None:
        """Rank r's ack (nccl) or snapshot (cpu) to the reduce that fired at ``reduce_started``."""
        self._reduce_started = reduce_started
        self._answers[r] = self._now()

    def on_reduce_finished(self, *, started: float, members: Iterable[int], backend: str, window: int,
                           final: bool = False, averaging_from: Optional[float] = None) -> None:
        """A reduce finished now. ``averaging_from``: cpu backend, when the coordinator began averaging."""
        now = self._now()
        members = sorted(members)
        note = "final" if final else ""
        cpu = backend == "cpu"
        gathered = averaging_from if (cpu and averaging_from is not None) else now
        for r in members:
            end = max(started, gathered if cpu else self._answers.get(r, now))
            self._add(r, Span("sync", r, started, end, window=window, note=note))
            lane = self._lanes[r]
            lane.sync_spans += 1
            lane.sync_span_s += end - started
            if cpu and now > gathered:
                self._add(r, Span("cpu_avg", r, gathered, now, window=window, note=note))
                lane.sync_span_s += now - gathered
        self._events.append(_Event("sync", started, gathered))
        if cpu and now > gathered:
            self._events.append(_Event("cpu_avg", gathered, now))
        self._answers.clear()
        self._reduce_started = None

    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None:
        self._evals[r] = (self._now(), epoch, final)

    def on_eval_result(self, r: int, epoch: int, final: bool = False) -> None:
        now = self._now()
        sent = self._evals.pop(r, None)
        if sent is None:
            return
        t0, e, fin = sent
        self._add(r, Span("eval", r, t0, now, epoch=e, note="final" if (fin or final) else ""))
        self._events.append(_Event("eval", t0, now))

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        now = self._now()
        wall = float(metrics.get("epoch_time_s", 0.0) or 0.0)
        fracs = {r: float(v) for r in range(self.world_size)
                 for v in [metrics.get(f"rank{r}/idle_frac")] if v is not None and math.isfinite(v)}
        self.epochs.append(EpochWindow(e, now - wall, now, fracs))
        self._events.append(_Event("epoch_boundary", now, now))

    # -- internals --------------------------------------------------------------
    def _now(self) -> float:
        t = self._clock()
        self.last_t = max(self.last_t, t)
        return t

    def _add(self, r: int, span: Span) -> None:
        lane = self._lanes[r]
        lane.spans[span.kind].append(span)
        lane.count += 1
        if span.kind not in ("compute", "data"):
            lane.open_key = None  # a reduce, an eval or an idle gap ends the compute span being extended
        if lane.count >= self.max_spans:
            self._compact(lane)

    def _compact(self, lane: _Lane) -> None:
        """Merge the oldest half of the lane's most numerous kind pairwise (the cap; totals are unaffected)."""
        kind = max(lane.spans, key=lambda k: len(lane.spans[k]))
        spans = lane.spans[kind]
        half = len(spans) // 2
        merged = [_merge(spans[i], spans[i + 1]) for i in range(0, half - 1, 2)]
        if half % 2:
            merged.append(spans[half - 1])
        lane.count -= len(spans) - (len(merged) + len(spans) - half)
        spans[:half] = merged
        lane.open_key = None
        lane.compactions += 1

    def _idle_gap(self, r: int, g0: float, g1: float, extra: Iterable[_Event] = ()) -> None:
        cause = self.classify(g0, g1, extra)
        lane = self._lanes[r]
        lane.idle[cause] += g1 - g0
        lane.gaps += 1
        self._add(r, Span("idle", r, g0, g1, note=cause))

    def _candidates(self, recent_only: bool = False, since: float = -math.inf) -> list[_Event]:
        now = self.last_t
        if recent_only:  # newest first, up to RECENT_EVENTS, stopping at the first that ended before ``since`` (the
            # ring is in finishing order, so the older ones ended earlier still): a batch's gap costs O(1)
            out = []
            for ev in itertools.islice(reversed(self._events), RECENT_EVENTS):
                if ev.t1 < since:
                    break
                out.append(ev)
        else:
            out = list(self._events)
        out += [_Event("eval", t0, now) for t0, _, _ in self._evals.values()]
        if self._reduce_started is not None:
            out.append(_Event("sync", self._reduce_started, now))
        return out

    def _short_cause(self, g0: float, g1: float) -> str:
        """:meth:`classify`'s rule for a gap under ``min_gap_s``, on every batch: the newest RECENT_EVENTS events
        (stopping at one that ended more than ``near_s`` before the gap) and the ones in flight, with no
        allocation when nothing is in flight (the common case: the reduce that held the rank has just finished)."""
        if self._reduce_started is None and not self._evals:
            near, since = self.near_s, g0 - self.near_s
            best, best_w, nearest = "", 0.0, (math.inf, 9, "unexplained")
            for ev in itertools.islice(reversed(self._events), RECENT_EVENTS):
                if ev.t1 < since:
                    break
                dist = max(0.0, ev.t0 - g1, g0 - ev.t1)
                if dist > near:
                    continue
                if ev.kind == "epoch_boundary":
                    w = ev.t0 - g0 if g0 <= ev.t0 <= g1 else 0.0
                else:
                    w = min(ev.t1, g1) - max(ev.t0, g0)
                if w > best_w:  # one event of a kind per gap, almost always: its overlap is the kind's weight
                    best, best_w = ev.kind, w
                cand = (dist, _TIE_ORDER.get(ev.kind, 9), ev.kind)
                if cand < nearest:
                    nearest = cand
            return best if best_w > 0 else nearest[2]
        return self.classify(g0, g1, recent_only=True)

    def classify(self, g0: float, g1: float, extra: Iterable[_Event] = (), *, recent_only: bool = False) -> str:
        """The cause of the idle gap [g0, g1] (the rule is in the module docstring); ``recent_only``: weighed against
        the newest events only (a short gap, classified on every batch)."""
        weight: dict[str, float] = {}
        nearest: Optional[tuple[float, int, str]] = None
        for ev in [*self._candidates(recent_only, g0 - self.near_s), *extra]:
            dist = max(0.0, ev.t0 - g1, g0 - ev.t1)
            if dist > self.near_s:
                continue
            if ev.kind == "epoch_boundary":  # the rank waited for the epoch to close
                w = ev.t0 - g0 if g0 <= ev.t0 <= g1 else 0.0
            else:
                w = max(0.0, min(ev.t1, g1) - max(ev.t0, g0))
            if w > 0:
                weight[ev.kind] = weight.get(ev.kind, 0.0) + w
            cand = (dist, _TIE_ORDER.get(ev.kind, 9), ev.kind)
            if nearest is None or cand < nearest:
                nearest = cand
        if weight:
            return max(weight.items(), key=lambda kv: (kv[1], -_TIE_ORDER.get(kv[0], 9)))[0]
        return nearest[2] if nearest is not None else "unexplained"

    # -- read-out -----------------------------------------------------------------
    def training_wall(self) -> tuple[float, float]:
        """(start, end): training's start (``on_start``: the first epoch's plans go out) -> the last aggregation
        (or the last batch, if later)."""
        if self.t0 is not None:
            start = self.t0
        else:
            start = min((w.start for w in self.epochs), default=self.last_t if math.isfinite(self.last_t) else 0.0)
        ends = [w.end for w in self.epochs] + [ln.last_end for ln in self._lanes if ln.last_end is not None]
        return start, max(ends + [start])

    def spans(self) -> list[Span]:
        """Every stored span (idle ones: the classified gaps), by rank then start."""
        out = [s for lane in self._lanes for k in KINDS for s in lane.spans[k]]
        out.sort(key=lambda s: (s.rank, s.t0, KINDS.index(s.kind)))
        return out

    def idle_analysis(self) -> dict[str, Any]:
        """Per rank: compute, data wait and idle over the training wall, idle by cause, and the run's
        wall-weighted ``idle_frac`` to compare with (see the module docstring)."""
        start, end = self.training_wall()
        wall = max(end - start, 0.0)
        ewall = sum(max(w.end - w.start, 0.0) for w in self.epochs)
        aggregated = {w.epoch for w in self.epochs}
        ranks: dict[str, Any] = {}
        for r, lane in enumerate(self._lanes):
            idle = dict(lane.idle)
            # the gap after the rank's last batch (before its first one was counted as it arrived): classified
            # now, with every event known; a lane that never trained is idle from start to end
            tail = lane.last_end if lane.last_end is not None else start
            if end > tail:
                g = end - max(tail, start)
                idle[self.classify(max(tail, start), end)] += g
            busy = lane.compute_s + lane.data_s
            idle_s = sum(idle.values())
            epoch_busy = sum(v for e, v in lane.busy_by_epoch.items() if e in aggregated)
            frac_epochs = 1.0 - epoch_busy / ewall if ewall > 0 else None
            run = self._run_idle_frac(r)
            ranks[str(r)] = {
                "compute_s": lane.compute_s, "data_s": lane.data_s, "busy_s": busy, "idle_s": idle_s,
                "idle_by_cause_s": idle, "gaps_classified": lane.gaps, "late_s": lane.late_s,
                "idle_frac": idle_s / wall if wall > 0 else 0.0, "epoch_busy_s": epoch_busy,
                "idle_frac_epochs": frac_epochs, "run_idle_frac": run,
                "diff": None if run is None or frac_epochs is None else frac_epochs - run,
                "spans_stored": lane.count, "compactions": lane.compactions,
                "sync_spans": lane.sync_spans, "sync_span_s": lane.sync_span_s,
            }
        return {"wall_s": wall, "epoch_walls_s": ewall, "epoch_overlap_s": ewall - wall if self.epochs else 0.0,
                "start": start, "end": end, "min_gap_s": self.min_gap_s, "near_s": self.near_s, "ranks": ranks}

    def _run_idle_frac(self, r: int) -> Optional[float]:
        pts = [(w.idle_frac[r], w.end - w.start) for w in self.epochs if r in w.idle_frac and w.end > w.start]
        den = sum(wl for _, wl in pts)
        return sum(f * wl for f, wl in pts) / den if den > 0 else None


def _merge(a: Span, b: Span) -> Span:
    note = a.note if a.kind != "idle" or a.duration >= b.duration else b.note
    return Span(a.kind, a.rank, min(a.t0, b.t0), max(a.t1, b.t1), a.epoch, a.window, a.n + b.n,
                a.busy_ms + b.busy_ms, a.data_ms + b.data_ms, note)
