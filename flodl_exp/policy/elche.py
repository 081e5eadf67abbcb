"""ElChe, the cadence balancer: how many batches each rank runs per reduce window.

On a mixed rig an equal split makes the fast rank idle at every reduce. ElChe
owns the per-rank schedule ``batch_counts``: the slow ("anchor") rank runs
``anchor`` batches and every faster rank proportionally more, so all ranks reach
the reduce at about the same wall time. It also *proposes* growing ``anchor`` to
amortise per-window fixed costs (reduce + first-batch fill); the convergence
guard's verdict decides whether a proposal lands (``apply_verdict``).

Pure state machine: no I/O, no clocks, no torch. The coordinator feeds one
``WindowReport`` per reduce and reads the schedule back. Port of the 0.7.0-era
reference balancer (algorithms.md section 2); Rust integer/rounding semantics
are reproduced where they change results (round half away from zero,
truncation, "last maximal" tie-breaks).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Sequence

from flodl_exp.policy.actions import ConvergenceAction

TRUST_WINDOW_CAP = 5          # readings averaged per rank; also the dead-rank reset threshold
COHORT_BAND = 0.15            # anchor-eligible iff smoothed >= (1 - band) * slowest
DOMINANCE_MARGIN = 0.10       # a challenger must be this much slower to unseat the anchor
MAX_SPEED_RATIO = 64.0        # cap on slow_ms / ms: a degenerate tiny sample must not explode counts
BATCH_COUNTS_WINDOW_CAP = 10  # schedule snapshots kept for recent_batch_share
GROWTH_REARM_STABLE = 5       # consecutive Stable verdicts that re-arm growth
GROWTH_STEP_CAP = 2.0         # at most x2 anchor growth per proposal
WARMUP_GROWTH_MARGIN = 2.0    # in Warmup only an unambiguous signal (> 2x target) may propose
DEAD_ZONE = 0.05              # a count moves only if the change exceeds 5% of it
STABLE_AT, MATURE_AT = 5, 20  # calibration counts for Warmup->Stable and Stable->Mature


class Phase(Enum):
    """Balancer lifecycle; monotonic. Gates election (Stable+) and the growth bar."""

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    @property
    def at_least_stable(self) -> bool:
        return self in (Phase.STABLE, Phase.MATURE)


def _round(x: float) -> int:
    """Rust ``f64::round`` for x >= 0 (half away from zero; Python rounds half to even)."""
    whole = math.floor(x)
    return int(whole) + (1 if x - whole >= 0.5 else 0)


def _nonneg(x: float) -> float:
    """Rust ``x.max(0.0)``: NaN and negatives become 0."""
    return float(x) if x > 0 else 0.0


@dataclass
class WindowReport:
    """One reduce window as seen by the coordinator's ledger (section 3.2).

    Carries both timing scales so the scale choice lives next to the relative
    allocation it protects: ``(wall_ms, steps)`` is compute-only and always
    comparable across ranks; ``(delivered_ms, delivered_batches)`` is marginal
    delivered cost (compute + data wait), present only for ranks with >= 2
    batches. ``delivered_coherent`` is the caller's attestation that every alive
    mover has a delivered sample and the mode rides the delivered feed.
    """

    wall_ms: list[float]
    steps: list[int]
    delivered_ms: list[float]
    delivered_batches: list[int]
    fill_ms: list[float]
    sync_ms: float
    delivered_coherent: bool

    def select_feed(self) -> tuple[list[float], list[int]]:
        """The ``(ms, batches)`` pair to schedule on. Allocation is relative, so
        scales are never mixed: an incoherent window feeds compute for *every*
        rank; a coherent one feeds delivered where a rank has a sample (a rank
        without one is a non-mover and contributes its empty compute pair)."""
        if not self.delivered_coherent:
            return list(self.wall_ms), list(self.steps)
        has = [b > 0 and m > 0 for m, b in zip(self.delivered_ms, self.delivered_batches)]
        ms = [d if h else w for d, w, h in zip(self.delivered_ms, self.wall_ms, has)]
        batches = [d if h else s for d, s, h in zip(self.delivered_batches, self.steps, has)]
        return ms, batches


class ElChe:
    """Per-rank cadence schedule with trust-window smoothing, sticky anchor
    election and guard-gated window growth. See the module docstring."""

    def __init__(self, world_size: int, anchor: int = 10, *, overhead_target: float = 0.05,
                 max_anchor: int = 1000, min_anchor: Optional[int] = None,
                 max_batch_diff: Optional[int] = None,
                 window_growth_applicable: bool = True) -> None:
        if world_size < 2:
            raise ValueError(f"ElChe needs world_size >= 2 (got {world_size}): nothing to balance")
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1 (got {anchor})")
        self._w = int(world_size)
        self._anchor = int(anchor)
        self._counts = [self._anchor] * self._w
        self._ms_window: list[deque[float]] = [deque(maxlen=TRUST_WINDOW_CAP) for _ in range(self._w)]
        self._zero_reports = [0] * self._w
        self._counts_history: deque[list[int]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self._calibrated = False
        self._overhead_target = 0.05
        self._min_anchor = self._anchor  # growth floor defaults to the start value
        self._max_anchor = 1000
        self._max_total: Optional[int] = None
        self._window_cap_binding = False
        self._max_batch_diff: Optional[int] = None
        self._phase = Phase.PROBE
        self._anchor_rank: Optional[int] = None
        self._calibration_count = 0
        self._pending_slack = [0.0] * self._w
        self._proposed: Optional[int] = None  # staged Grow(n); grow-only by design
        self._pending_fill = [0.0] * self._w
        self._growth_enabled = True
        self._consecutive_stable = 0
        self._window_growth_applicable = bool(window_growth_applicable)
        self.with_overhead_target(overhead_target).with_max_anchor(max_anchor)
        if min_anchor is not None:
            self.with_min_anchor(min_anchor)
        if max_batch_diff is not None:
            self.with_max_batch_diff(max_batch_diff)

    # ---------------------------------------------------------------- knobs
    def with_overhead_target(self, target: float) -> ElChe:
        """Per-window fixed-overhead fraction the anchor grows to stay under."""
        if not math.isfinite(target):
            raise ValueError(f"overhead_target must be finite (got {target})")
        self._overhead_target = min(max(float(target), 0.01), 0.50)
        return self

    def with_max_anchor(self, m: int) -> ElChe:
        """Staleness ceiling. Lowers ``min_anchor`` (and the anchor) if they exceed it."""
        self._max_anchor = max(int(m), 1)
        if self._min_anchor > self._max_anchor:
            self._min_anchor = self._max_anchor
            self._anchor = min(max(self._anchor, self._min_anchor), self._max_anchor)
            self._resync_cold_counts()
        return self

    def with_min_anchor(self, m: int) -> ElChe:
        """Growth floor (capped at ``max_anchor``); lifts the anchor to it. ``NudgeDown``
        bypasses it, so a hard pin also needs the guard disabled."""
        self._min_anchor = min(max(int(m), 1), self._max_anchor)
        if self._anchor < self._min_anchor:
            self._anchor = self._min_anchor
            self._resync_cold_counts()
        return self

    def with_max_batch_diff(self, d: Optional[int]) -> ElChe:
        """Per-update change cap on each count (also the coordinator's throttle
        threshold); 0 = lockstep, None = unbounded."""
        if d is not None and d < 0:
            raise ValueError(f"max_batch_diff must be >= 0 (got {d})")
        self._max_batch_diff = None if d is None else int(d)
        return self

    def with_speed_ratio(self, slow_rank: int, ratio: float) -> ElChe:
        """Cold-start guess: ``slow_rank`` runs ``anchor``, the others ``anchor*ratio``.
        Pins the anchor rank; the first measurements correct a wrong guess."""
        self._check_rank(slow_rank)
        if math.isnan(ratio) or math.isinf(ratio):
            raise ValueError(f"speed ratio must be finite (got {ratio})")
        ratio = max(float(ratio), 1.0)
        for r in range(self._w):
            self._counts[r] = self._anchor if r == slow_rank else max(_round(self._anchor * ratio), 1)
        self._anchor_rank = slow_rank
        return self

    def with_initial_anchor(self, rank: int) -> ElChe:
        """Pin the cold-start anchor rank without touching counts (held until Stable)."""
        self._check_rank(rank)
        self._anchor_rank = rank
        return self

    def seed_from_probe(self, ms_per_batch: Sequence[float]) -> bool:
        """Cold start: size the first window from each rank's first timed steps, before any reduce.

        Without this the first window runs on ``[anchor] * W`` and the fast ranks idle for most of it
        (on a 3:1 rig, two thirds of the window). The probe only sets the counts, exactly as a first
        calibration would (``anchor`` on the slowest rank, proportionally more on the others, the
        window<=epoch cap); trust windows, phase, calibration count and the anchor rank are left
        alone, so the first reduce's report calibrates by the reference's rules as before. Refused
        (False) once calibrated, under a speed hint (the user's prior stands), or without a positive
        finite reading for every rank.
        """
        if self._calibrated or self.has_speed_hint() or len(ms_per_batch) != self._w:
            return False
        ms = [float(m) for m in ms_per_batch]
        if not all(math.isfinite(m) and m > 0 for m in ms):
            return False
        slow = max(ms)
        self._counts = [max(_round(self._anchor * min(slow / m, MAX_SPEED_RATIO)), 1) for m in ms]
        self._cap_to_max_total()
        return True

    def set_max_total_batches(self, n: Optional[int]) -> None:
        """Cap ``sum(batch_counts)`` (the epoch's batch count) so a window never spans
        more than one epoch; 0/None removes the cap."""
        self._max_total = int(n) if n else None

    def stage_callback_slack(self, rank: int, ms: float) -> None:
        """Stage ``ms`` of callback time for ``rank``: the next recompute lowers its count
        by ``ceil(ms / smoothed)`` (floor 1, bypassing the dead zone), once."""
        self._check_rank(rank)
        self._pending_slack[rank] = float(ms) if math.isfinite(ms) and ms > 0 else 0.0

    def stage_fill(self, fill_ms: Sequence[float]) -> None:
        """Stage per-rank first-batch fill (ms) for the next growth proposal; consumed
        once. Ignored on a length mismatch (growth then uses the reduce term alone)."""
        if len(fill_ms) == self._w:
            self._pending_fill = [float(f) for f in fill_ms]

    # ---------------------------------------------------------------- feed
    def report_window(self, rep: WindowReport) -> None:
        """The coordinator's one timing entry point, once per reduce. A fully idle
        (all-zero) window reports nothing so no zero sample poisons the windows."""
        self.stage_fill(rep.fill_ms)
        ms, batches = rep.select_feed()
        if any(m > 0 for m in ms):
            self.report_timing(ms, batches, rep.sync_ms)

    def report_timing(self, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float) -> None:
        """Ingest one window: per-rank ``wall_ms[r]`` over ``batches[r]`` steps, and the
        reduce's ``sync_ms``. Updates smoothing, maybe the anchor rank, stages a growth
        proposal (never applied here) and recomputes the schedule."""
        if len(wall_ms) != self._w or len(batches) != self._w:
            raise ValueError(f"wall_ms and batches must have length world_size={self._w}")
        for r in range(self._w):
            wall, n = float(wall_ms[r]), int(batches[r])
            if n > 0 and wall > 0 and math.isfinite(wall):
                self._ms_window[r].append(wall / n)
                self._zero_reports[r] = 0
            else:
                self._zero_reports[r] += 1
                if self._zero_reports[r] >= TRUST_WINDOW_CAP:
                    self._ms_window[r].clear()  # dead/absent rank: react fast on recovery
        # Probe/Warmup hold the pin so cold-start noise cannot flip the anchor.
        if self._anchor_rank is None or self._phase.at_least_stable:
            elected = self._elect_anchor()
            if elected is not None:
                self._anchor_rank = elected
        if self._anchor_rank is None:
            return
        slow = self.smoothed_ms(self._anchor_rank)
        if slow <= 0:
            # A pinned anchor that never reports would freeze the balancer before
            # calibration (election needs Stable); after a full trust window of
            # misses, elect from the ranks that do have data.
            elected = self._elect_anchor()
            if self._zero_reports[self._anchor_rank] >= TRUST_WINDOW_CAP and elected is not None:
                self._anchor_rank = elected
                slow = self.smoothed_ms(elected)
            if slow <= 0:
                return
        self._proposed = None
        # The first report never proposes: its sync may carry cohort-formation cost.
        if self._phase.at_least_stable or (
                self._phase is Phase.WARMUP and self._calibration_count >= 1):
            self._proposed = self._propose_anchor(sync_ms)
        self._pending_fill = [0.0] * self._w
        self._recompute(slow)  # from the CURRENT anchor; a commit recomputes again
        self._counts_history.append(list(self._counts))
        self._calibrated = True
        self._calibration_count += 1
        self._advance_phase()

    # ---------------------------------------------------------------- verdict seam
    def apply_verdict(self, action: ConvergenceAction, relax_up: bool = False) -> None:
        """The one seam for guard / meta verdicts. NudgeDown discards the staged grow
        *before* nudging: a later Stable commit would otherwise overwrite the nudge."""
        if action.kind == "stable":
            self.commit_proposed_anchor()
            if relax_up:
                self.relax_anchor_up()
        elif action.kind == "suppress_growth":
            self.veto_proposed_growth()
        elif action.kind == "nudge_down":
            self.discard_proposed_anchor()
            self.nudge_anchor_down(action.factor)
        else:
            raise ValueError(f"unknown convergence action {action.kind!r}")

    def commit_proposed_anchor(self) -> None:
        """Stable verdict: count toward re-arming growth, apply any staged grow."""
        self._consecutive_stable += 1
        if self._consecutive_stable >= GROWTH_REARM_STABLE:
            self._growth_enabled = True
        if self._proposed is not None:
            self._anchor, self._proposed = self._proposed, None
            self._recompute_if_measured()

    def veto_proposed_growth(self) -> None:
        """SuppressGrowth: drop the proposal and latch growth off until a clean streak,
        so the controller settles below the convergence cliff instead of probing it."""
        self._proposed = None
        self._consecutive_stable = 0
        self._growth_enabled = False

    discard_proposed_anchor = veto_proposed_growth  # NudgeDown (guard or meta): same latch

    def nudge_anchor_down(self, factor: float) -> None:
        """Shrink the anchor by ``factor`` (clamped to [0.1, 1]); floor 1, ignoring
        ``min_anchor`` because divergence outranks the overhead floor. NaN is ignored."""
        if not math.isfinite(factor):
            return
        f = min(max(float(factor), 0.1), 1.0)
        self._anchor = min(max(math.ceil(self._anchor * f), 1), self._anchor)
        self._recompute_if_measured()

    def relax_anchor_up(self) -> None:
        """+1 drift toward ``max_anchor`` (Async opt-in), refused when the projected
        fastest-vs-slowest spread would exceed ``max_batch_diff``."""
        if self._anchor >= self._max_anchor:
            return
        if self._max_batch_diff is not None:
            positive = [m for m in self.smoothed_ms_all() if m > 0]
            if positive:
                nxt = self._anchor + 1
                proj_fast = max(_round(nxt * max(positive) / min(positive)), 1)
                if max(proj_fast - nxt, 0) > self._max_batch_diff:
                    return
        self._anchor += 1
        self._recompute_if_measured()

    # ---------------------------------------------------------------- read-outs
    @property
    def world_size(self) -> int:
        return self._w

    @property
    def batch_counts(self) -> list[int]:
        return list(self._counts)

    @property
    def counts_view(self) -> Sequence[int]:
        """The schedule itself, not a copy (read it, never keep or change it): for the dispatcher's per-chunk
        reads, where a copy each time is O(W) per chunk handed out."""
        return self._counts

    @property
    def anchor(self) -> int:
        return self._anchor

    @property
    def anchor_rank(self) -> Optional[int]:
        return self._anchor_rank

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def is_calibrated(self) -> bool:
        return self._calibrated

    @property
    def calibration_count(self) -> int:
        return self._calibration_count

    @property
    def growth_enabled(self) -> bool:
        return self._growth_enabled

    @property
    def proposed_anchor(self) -> Optional[int]:
        """Staged grow target awaiting a verdict (None when nothing is staged)."""
        return self._proposed

    @property
    def window_cap_binding(self) -> bool:
        """The last recompute had to shrink to the window<=epoch cap (growth is off)."""
        return self._window_cap_binding

    def knobs(self) -> dict[str, Any]:
        """User knobs in force (not part of ``state_dict``: a resume may change them)."""
        return {"overhead_target": self._overhead_target, "min_anchor": self._min_anchor,
                "max_anchor": self._max_anchor, "max_batch_diff": self._max_batch_diff,
                "max_total_batches": self._max_total,
                "window_growth_applicable": self._window_growth_applicable}

    def staged(self) -> dict[str, list[float]]:
        """One-shot inputs awaiting the next report: callback slack and window fill (ms)."""
        return {"callback_slack_ms": list(self._pending_slack), "fill_ms": list(self._pending_fill)}

    def has_speed_hint(self) -> bool:
        """Counts are not all equal (a hint or a calibration made them uneven)."""
        return len(set(self._counts)) > 1

    def smoothed_ms(self, r: int) -> float:
        """Mean of rank ``r``'s trust window; 0.0 means "no data"."""
        win = self._ms_window[r]
        return sum(win) / len(win) if win else 0.0

    def smoothed_ms_all(self) -> list[float]:
        return [self.smoothed_ms(r) for r in range(self._w)]

    def smoothed_ms_per_batch(self, r: int) -> Optional[float]:
        """Like ``smoothed_ms`` but None when uncalibrated (picks the Fastest callback rank)."""
        return self.smoothed_ms(r) if self._ms_window[r] else None

    def recent_batch_share(self) -> list[float]:
        """Per-rank share of the last <=10 schedules (the epoch ``batch_share`` metric)."""
        snaps = list(self._counts_history) or [self._counts]
        sums = [float(sum(s[r] for s in snaps)) for r in range(self._w)]
        total = sum(sums)
        if total <= 0:
            return [1.0 / self._w] * self._w
        return [s / total for s in sums]

    def anchor_wall_ms(self) -> float:
        """Intended wall time of one window: ``anchor * smoothed(anchor_rank)``."""
        if not self._calibrated or self._anchor_rank is None:
            return 0.0
        return self._anchor * self.smoothed_ms(self._anchor_rank)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Trajectory state for checkpoint meta ``elche_state`` (JSON-safe). User knobs
        are deliberately absent: a resume may change them."""
        return {"anchor": self._anchor, "anchor_rank": self._anchor_rank,
                "smoothed_ms_per_batch": self.smoothed_ms_all(),
                "phase": self._phase.value, "calibration_count": self._calibration_count}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Inverse of ``state_dict``. Each trust window is seeded with one sample (the
        saved mean), so fresh readings dominate within five reports."""
        ms = [float(x) for x in d["smoothed_ms_per_batch"]]
        if len(ms) != self._w:
            raise ValueError(f"elche_state has world size {len(ms)}, this run has {self._w}; "
                             "resume must keep the world size")
        rank = d.get("anchor_rank")
        if rank is not None:
            self._check_rank(int(rank))
        self._anchor = max(int(d["anchor"]), 1)
        self._anchor_rank = None if rank is None else int(rank)
        self._phase = Phase(d["phase"])
        self._calibration_count = int(d["calibration_count"])
        for r, m in enumerate(ms):
            self._ms_window[r].clear()
            if m > 0:
                self._ms_window[r].append(m)
        self._zero_reports = [0] * self._w
        self._proposed = None
        self._counts_history.clear()
        # Rebuild the schedule like a first calibration (no dead zone / change cap), so
        # the first resumed window already runs the saved proportions.
        self._calibrated = False
        self._counts = [self._anchor] * self._w
        self._recompute_if_measured()
        self._calibrated = any(m > 0 for m in ms)

    # ---------------------------------------------------------------- internals
    def _check_rank(self, r: int) -> None:
        if not 0 <= r < self._w:
            raise ValueError(f"rank {r} out of range for world_size {self._w}")

    def _resync_cold_counts(self) -> None:
        # Before any measurement and without a hint, counts are [anchor]*W by definition.
        if not self._calibrated and not self.has_speed_hint():
            self._counts = [self._anchor] * self._w

    def _slow_cohort(self) -> list[int]:
        ms = self.smoothed_ms_all()
        top = max(ms)
        if top <= 0:
            return []
        return [r for r in range(self._w) if ms[r] >= top * (1.0 - COHORT_BAND)]

    def _elect_anchor(self) -> Optional[int]:
        """Slow cohort, then sticky-with-margin within it; lowest index otherwise."""
        cohort = self._slow_cohort()
        if not cohort:
            return None
        if len(cohort) == 1:
            return cohort[0]
        cur = self._anchor_rank
        if cur is not None and cur in cohort:
            best, best_ms = None, -math.inf
            for r in cohort:  # Rust max_by: the LAST maximal challenger wins ties
                if r != cur and self.smoothed_ms(r) >= best_ms:
                    best, best_ms = r, self.smoothed_ms(r)
            if best is not None and best_ms > self.smoothed_ms(cur) * (1.0 + DOMINANCE_MARGIN):
                return best
            return cur
        return cohort[0]

    def _propose_anchor(self, sync_ms: float) -> Optional[int]:
        """Grow-only window-pressure proposal from the anchor rank's fixed overhead
        ``(reduce + fill) / (anchor*marginal + reduce + fill)``; it falls as the window
        grows, so it settles at the amortisation knee."""
        if not (self._window_growth_applicable and self._growth_enabled) or self._window_cap_binding:
            return None
        b = self._anchor_rank
        if b is None:
            return None
        marginal = self.smoothed_ms(b)
        if marginal <= 0:
            return None
        fixed = _nonneg(sync_ms) + _nonneg(self._pending_fill[b])
        denom = self._anchor * marginal + fixed
        if denom <= 0 or fixed <= 0:
            return None
        overhead = fixed / denom if math.isfinite(fixed) else 1.0  # inf/inf: all overhead
        stable = self._phase.at_least_stable
        fire_at = self._overhead_target * (1.0 if stable else WARMUP_GROWTH_MARGIN)
        if overhead <= fire_at:
            return None
        scale = min(overhead / self._overhead_target, GROWTH_STEP_CAP)
        new = min(max(math.ceil(self._anchor * scale), self._min_anchor), self._max_anchor)
        return new if new > self._anchor else None

    def _recompute_if_measured(self) -> None:
        slow = self.smoothed_ms(self._anchor_rank) if self._anchor_rank is not None else 0.0
        if slow > 0:
            self._recompute(slow)

    def _recompute(self, slow_ms: float) -> None:
        """Counts proportional to speed relative to the anchor rank, with dead zone,
        per-update change cap, callback slack and the window<=epoch cap."""
        for r in range(self._w):
            ms = self.smoothed_ms(r)
            if ms <= 0 or abs(ms - slow_ms) < 1e-6:
                t0 = self._anchor
            else:
                t0 = max(_round(self._anchor * min(slow_ms / ms, MAX_SPEED_RATIO)), 1)
            slack_ms = self._pending_slack[r]
            slack = math.ceil(slack_ms / ms) if slack_ms > 0 and ms > 0 else 0
            target = max(t0 - slack, 1)
            cur = self._counts[r]
            if abs(target - cur) > DEAD_ZONE * cur or not self._calibrated or slack > 0:
                d = self._max_batch_diff
                if d is not None and self._calibrated:
                    new = min(cur + d, target) if target > cur else max(cur - d, target, 1)
                else:
                    new = target
                self._counts[r] = new
        self._cap_to_max_total()
        self._pending_slack = [0.0] * self._w  # consumed exactly once

    def _cap_to_max_total(self) -> None:
        self._window_cap_binding = False
        m = self._max_total
        total = sum(self._counts)
        if m is not None and m > 0 and total > m:
            # The per-rank floor of 1 wins over the cap when W > m (the dispatcher
            # then hands out the real remainder; some ranks get 0).
            self._window_cap_binding = True
            f = m / total
            self._counts = [max(math.floor(c * f), 1) for c in self._counts]
            rem = m - sum(self._counts)
            # The flooring leaves rem < W. The reference gives all of it to the fastest rank (Rust max_by_key:
            # the LAST maximal); one each to the rem fastest (ties: the highest rank first) is the same for
            # rem = 1, and at 1,024 ranks it does not make one rank run 500 batches more than its peers
            # while every other waits for it at each reduce (found by the simulator).
            order = sorted(range(self._w), key=lambda r: (self._counts[r], r), reverse=True)
            for r in order[:max(rem, 0)]:
                self._counts[r] += 1

    def _advance_phase(self) -> None:
        if self._phase is Phase.PROBE:
            self._phase = Phase.WARMUP
        elif self._phase is Phase.WARMUP and self._calibration_count >= STABLE_AT:
            self._phase = Phase.STABLE
        elif self._phase is Phase.STABLE and self._calibration_count >= MATURE_AT:
            self._phase = Phase.MATURE
