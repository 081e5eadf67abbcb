"""The suite's report (algorithms.md 12.2's sections, adapted to this runner): markdown + PNGs.

Pure from :class:`BenchRow` (one row per child run) to text (the PNGs are ``plots.py``'s): every function here is a
function of plain data, so the math (best-mode rule, ratios, percentiles, overlap) is unit-tested on
synthetic rows; ``collect.py`` builds the rows from MLflow and the runs' files.

Sections: per model ``Mode | Loss | Eval | Total s | Syncs | Avg sync ms | Util | Idle s`` and the per-epoch
loss trajectory; then across models: best mode (best eval; fastest within 2 % of solo_fast's eval), eval vs
solo_fast, final-loss ratio vs solo_fast, speedup vs solo_fast, ElChe calibration (anchor changes, throttles,
syncs, sync interval p50/p95, CPU averages), streaming epoch overlap, and the idle analysis (by cause from
the run's timeline when it has one, else ``idle_frac x epoch_time_s``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from flodl_exp.bench.suite import REFERENCE_RUN
from flodl_exp.reporting import EVAL_TOLERANCE, MISSING, best_and_fastest, fmt, fmt_delta, fmt_eval, sampled, secs, table

HIGHER_BETTER = {"eval/accuracy": True, "eval/mse": False, "eval/loss": False}
EVAL_KEYS = tuple(HIGHER_BETTER)
"""Preference order of the eval metric a model is judged by."""
CAUSES = ("epoch_boundary", "sync", "cpu_avg", "eval", "unexplained")
OVERLAP_EPS_S = 0.002
"""Overlap below this is timestamp rounding (events carry ms), reported as none."""
PLOTS = ("loss_vs_time.png", "speedup.png", "idle.png")
"""What ``plots.write_plots`` draws, in the report's Plots section."""
SECTIONS = ("Best mode per model", "Eval vs solo_fast", "Final-loss ratio vs solo_fast", "Speedup vs solo_fast",
            "ElChe calibration", "Streaming epoch overlap", "Idle analysis")
"""The cross-model sections, in order (each model's own section comes first)."""


@dataclass
class BenchRow:
    """One child run, as the report needs it."""

    model: str
    run: str
    kind: str = "flodl"
    status: str = "FINISHED"
    world_size: int = 2
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(epoch, training loss)."""
    epoch_times: list[tuple[int, float]] = field(default_factory=list)
    """(epoch, epoch_time_s)."""
    evals: dict[str, float] = field(default_factory=dict)
    """Final ``eval/*`` values."""
    syncs: float = 0.0
    sync_ms_avg: float = 0.0
    util: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    """Per rank, Σ idle_frac · epoch_time_s."""
    anchors: Optional[list[float]] = None
    """Every anchor ElChe took, in order (the starting one first); None when the run has no ElChe."""
    throttles: Optional[int] = None
    sync_starts: Optional[list[float]] = None
    """Each reduce's start (s), from the timeline; None without one."""
    cpu_avg_ms: Optional[list[float]] = None
    """Each coordinator averaging's wall (ms), from the timeline (cpu backend)."""
    epoch_windows: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each epoch (its first chunk out -> its aggregation), seconds on one clock."""
    idle_by_cause: Optional[list[dict[str, float]]] = None
    """Per rank, idle seconds by cause (timeline.json's idle analysis); None without a timeline."""
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        """Training wall: the first epoch's start -> the last aggregation (Σ epoch_time_s less the time streamed
        epochs overlapped); Σ epoch_time_s when the epochs' windows are unknown."""
        ws = [(a, b) for a, b in self.epoch_windows if b >= a]
        if ws and len(ws) == len(self.epoch_times):
            return max(b for _, b in ws) - min(a for a, _ in ws)
        return sum(v for _, v in self.epoch_times)

    @property
    def epochs(self) -> int:
        return len(self.losses)

    @property
    def final_loss(self) -> float:
        return self.losses[-1][1] if self.losses else math.nan

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED" and bool(self.losses)


# -- pure math --------------------------------------------------------------------
def eval_key(rows: Sequence[BenchRow]) -> Optional[str]:
    """The model's eval metric: accuracy, else reconstruction MSE, else eval loss (the first any run has)."""
    for k in EVAL_KEYS:
        if any(k in r.evals for r in rows):
            return k
    return None


def eval_of(row: BenchRow, key: Optional[str]) -> Optional[float]:
    v = row.evals.get(key) if key else None
    return v if v is not None and math.isfinite(v) else None


def reference(rows: Sequence[BenchRow]) -> Optional[BenchRow]:
    return next((r for r in rows if r.run == REFERENCE_RUN and r.ok), None)


def best_mode(rows: Sequence[BenchRow], key: Optional[str]) -> Optional[tuple[BenchRow, Optional[BenchRow]]]:
    """(best eval row, fastest row whose eval is within 2 % of solo_fast's; None when none is), or None.

    Without a solo_fast eval the bar is the best eval (the rule still names a fastest good-enough mode)."""
    if key is None:
        return None
    ok = [r for r in rows if r.ok]
    ref = reference(rows)
    return best_and_fastest(ok, lambda r: eval_of(r, key), lambda r: r.total_s, HIGHER_BETTER[key],
                            bar=eval_of(ref, key) if ref is not None else None)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def intervals_ms(starts: Sequence[float]) -> list[float]:
    """Gaps between consecutive reduce starts, in ms."""
    xs = sorted(starts)
    return [(b - a) * 1e3 for a, b in zip(xs, xs[1:])]


def union_length(windows: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(windows):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def epoch_overlap(windows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(overlap s, training wall s): time epochs' windows run concurrently (Σ lengths - their union; a rank
    streaming into epoch e+1 before e is aggregated), and the span from the first start to the last end."""
    ws = [(a, b) for a, b in windows if b >= a]
    if not ws:
        return 0.0, 0.0
    overlap = sum(b - a for a, b in ws) - union_length(ws)
    return (overlap if overlap >= OVERLAP_EPS_S else 0.0), max(b for _, b in ws) - min(a for a, _ in ws)


def anchor_changes(anchors: Optional[Sequence[float]]) -> Optional[int]:
    if anchors is None:
        return None
    return sum(1 for a, b in zip(anchors, anchors[1:]) if a != b)


def speedup(row: BenchRow, ref: Optional[BenchRow]) -> Optional[float]:
    """solo_fast total / row total, only for equal epoch counts (else the ratio means nothing)."""
    if ref is None or not row.ok or row.epochs != ref.epochs or row.total_s <= 0:
        return None
    return ref.total_s / row.total_s


def loss_ratio(row: BenchRow, ref: Optional[BenchRow]) -> Optional[float]:
    if ref is None or not row.ok or not ref.final_loss or not math.isfinite(ref.final_loss):
        return None
    return row.final_loss / ref.final_loss


def eval_delta(row: BenchRow, ref: Optional[BenchRow], key: Optional[str]) -> Optional[float]:
    a, b = eval_of(row, key), eval_of(ref, key) if ref is not None else None
    return None if a is None or b is None or not row.ok else a - b


def idle_rows(row: BenchRow) -> list[tuple[int, float, dict[str, float], str]]:
    """(rank, idle s, idle s by cause, source) per rank: the timeline's analysis when present, else idle_frac."""
    if row.idle_by_cause is not None:
        return [(r, sum(c.values()), c, "timeline") for r, c in enumerate(row.idle_by_cause)]
    return [(r, v, {}, "idle_frac") for r, v in enumerate(row.idle_s)]


# -- markdown ---------------------------------------------------------------------
def _eval_fmt(v: Optional[float], key: Optional[str]) -> str:
    return fmt_eval(v, key == "eval/accuracy")


def _label(r: BenchRow) -> str:
    return r.run if r.status == "FINISHED" else f"{r.run} [{r.status}]"


def _per_rank(vals: Sequence[float], spec: str) -> str:
    return " / ".join(fmt(v, spec) for v in vals) if vals else MISSING


def model_section(model: str, rows: Sequence[BenchRow]) -> list[str]:
    key = eval_key(rows)
    name = key.split("/", 1)[1] if key else "eval"
    body = [[_label(r), fmt(r.final_loss), _eval_fmt(eval_of(r, key), key), secs(r.total_s), f"{r.syncs:.0f}",
             fmt(r.sync_ms_avg, "{:.1f}"), _per_rank(r.util, "{:.0%}"), _per_rank(r.idle_s, "{:.2f}")] for r in rows]
    lines = [f"## Model `{model}`", "",
             *table(["Mode", "Loss", f"Eval ({name})", "Total s", "Syncs", "Avg sync ms", "Util (r0 / r1 ...)",
                     "Idle s (r0 / r1 ...)"], body), ""]
    n = max((r.epochs for r in rows), default=0)
    traj = [[str(e + 1), *[fmt(dict(r.losses).get(e)) for r in rows]] for e in sampled(n)]  # epochs from 1 (step e)
    lines += [f"### `{model}`: per-epoch loss trajectory", "", *table(["Epoch", *[_label(r) for r in rows]], traj), ""]
    return lines


def _run_columns(by_model: dict[str, list[BenchRow]]) -> list[str]:
    return list(dict.fromkeys(r.run for rs in by_model.values() for r in rs if r.run != REFERENCE_RUN))


def _matrix(by_model: dict[str, list[BenchRow]], cell: Any) -> list[str]:
    cols = _run_columns(by_model)
    body = []
    for m, rs in by_model.items():
        by = {r.run: r for r in rs}
        body.append([m, *[cell(by[c], reference(rs), rs) if c in by else "" for c in cols]])
    return [*table(["Model", *cols], body), ""]


def cross_sections(by_model: dict[str, list[BenchRow]]) -> list[str]:
    lines: list[str] = []
    best = []
    for m, rs in by_model.items():
        key = eval_key(rs)
        bm = best_mode(rs, key)
        if bm is None:
            best.append([m, "—", "—", "—", "—"])
            continue
        b, fast = bm
        best.append([m, f"{_eval_fmt(eval_of(b, key), key)} ({key})", b.run,
                     "—" if fast is None else f"{secs(fast.total_s)} s ({_eval_fmt(eval_of(fast, key), key)})",
                     "—" if fast is None else fast.run])
    lines += ["## Best mode per model", "",
              "Best eval, and the fastest run (least total s) whose eval is within "
              f"{EVAL_TOLERANCE:.0%} of solo_fast's (higher accuracy, lower MSE or loss is better).", "",
              *table(["Model", "Best eval", "Mode", f"Fastest (within {EVAL_TOLERANCE:.0%} of solo_fast)", "Mode"], best), ""]

    def delta(r: BenchRow, ref: Optional[BenchRow], rs: list[BenchRow]) -> str:
        key = eval_key(rs)
        d = eval_delta(r, ref, key)
        return fmt_delta(d, key == "eval/accuracy")

    lines += ["## Eval vs solo_fast", "", "Run eval − solo_fast eval (accuracy in points; MSE / loss: lower is better).", "",
              *_matrix(by_model, delta)]
    lines += ["## Final-loss ratio vs solo_fast", "", "Final training loss / solo_fast's (convergence quality).", "",
              *_matrix(by_model, lambda r, ref, rs: fmt(loss_ratio(r, ref), "{:.2f}"))]
    lines += ["## Speedup vs solo_fast", "", "solo_fast total s / run total s (equal epoch counts only).", "",
              *_matrix(by_model, lambda r, ref, rs: fmt(speedup(r, ref), "{:.2f}×"))]
    calib = []
    for m, rs in by_model.items():
        for r in rs:
            if r.kind != "flodl" or r.world_size < 2:
                continue
            iv = intervals_ms(r.sync_starts or [])
            cpu = r.cpu_avg_ms
            calib.append([m, _label(r), fmt(anchor_changes(r.anchors), "{:d}") if r.anchors is not None else "—",
                          fmt(r.anchors[-1], "{:.0f}") if r.anchors else "—",
                          "—" if r.throttles is None else str(r.throttles), f"{r.syncs:.0f}", fmt(r.sync_ms_avg, "{:.1f}"),
                          fmt(percentile(iv, 50), "{:.1f}"), fmt(percentile(iv, 95), "{:.1f}"),
                          "—" if cpu is None else str(len(cpu)),
                          fmt(sum(cpu) / len(cpu), "{:.1f}") if cpu else "—"])
    lines += ["## ElChe calibration", "",
              "Anchor changes (ElChe recalibrations) and the final anchor, throttles (cpu backend, "
              "mode.max_batch_diff), syncs, sync interval p50/p95 (between reduce starts, from the run's timeline), "
              "and the coordinator's CPU averages (cpu backend).", "",
              *table(["Model", "Mode", "Anchor changes", "Final anchor", "Throttles", "Syncs", "Avg sync ms",
                      "Sync interval p50 ms", "p95 ms", "CPU avgs", "Avg CPU ms"], calib), ""]
    ov = []
    for m, rs in by_model.items():
        for r in rs:
            if r.world_size < 2 or not r.ok:
                continue
            o, wall = epoch_overlap(r.epoch_windows)
            ov.append([m, _label(r), str(r.epochs), secs(o), fmt(o / wall if wall > 0 else None, "{:.1%}"), secs(wall)])
    lines += ["## Streaming epoch overlap", "",
              "Seconds in which two epochs were in flight (a rank training epoch e+1 before epoch e aggregated: "
              "Σ epoch walls − their union) and their share of the training wall (first epoch start → last "
              "aggregation).", "", *table(["Model", "Mode", "Epochs", "Overlap s", "% of wall", "Training wall s"], ov), ""]
    idle = []
    for m, rs in by_model.items():
        for r in rs:
            for rank, tot, by_cause, src in idle_rows(r):
                idle.append([m, _label(r), str(rank), secs(tot),
                             *[secs(by_cause.get(c, 0.0)) if by_cause else "—" for c in CAUSES], src])
    lines += ["## Idle analysis", "",
              "Idle seconds per rank. With a timeline (flodl_exp runs), every gap is classified by the events around "
              "it (epoch boundary, sync, cpu averaging, eval; none near: unexplained); without one (DDP, torch "
              "solo), idle = Σ idle_frac · epoch_time_s.", "",
              *table(["Model", "Mode", "Rank", "Idle s", *CAUSES, "Source"], idle), ""]
    return lines


def group(rows: Sequence[BenchRow], models: Optional[Sequence[str]] = None) -> dict[str, list[BenchRow]]:
    out: dict[str, list[BenchRow]] = {m: [] for m in (models or [])}
    for r in rows:
        out.setdefault(r.model, []).append(r)
    return out


def build_markdown(rows: Sequence[BenchRow], *, title: str, header: Sequence[str] = (),
                   models: Optional[Sequence[str]] = None, plots: Sequence[str] = PLOTS) -> str:
    by_model = group(rows, models)
    ratios = []
    for m, rs in by_model.items():
        slow = next((r for r in rs if r.run == "solo_slow" and r.ok), None)
        ref = reference(rs)
        if slow and ref and ref.total_s > 0:
            ratios.append(f"{m} {slow.total_s / ref.total_s:.2f}")
    lines = [f"# flodl_exp benchmark suite: {title}", "", *[f"- {h}" for h in header],
             f"- Models: {len(by_model)}; runs: {len(rows)} ({sum(not r.ok for r in rows)} not finished)",
             f"- Speed ratio (solo_slow total / solo_fast total): {', '.join(ratios) or '—'}",
             "- Total s = training wall, the first epoch's start (its first work out) → the last epoch's aggregation "
             "(start-up, final eval and teardown excluded; streamed epochs' overlap counted once); "
             "Util = 1 − idle_frac (mean over epochs); Idle s = Σ idle_frac · epoch_time_s; Avg sync ms weighted by "
             "syncs per epoch.", ""]
    for m, rs in by_model.items():
        lines += model_section(m, rs)
    lines += cross_sections(by_model)
    lines += ["## Plots", "", *[f"![{p[:-4]}]({p})" for p in plots], ""]
    return "\n".join(lines)


def sections_of(md: str) -> dict[str, str]:
    """``## `` heading -> its body (for checks: the e2e test, a reader's tooling)."""
    out: dict[str, str] = {}
    cur = None
    for line in md.splitlines():
        if line.startswith("## "):
            cur = line[3:].strip()
            out[cur] = ""
        elif cur is not None:
            out[cur] += line + "\n"
    return out
