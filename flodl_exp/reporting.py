"""What the two markdown reports share: the best-mode rule, the table, the number formats.

``flodl_exp.report`` (a report over an MLflow experiment's runs) and ``flodl_exp.bench.report`` (the
benchmark suite's) judge modes by one rule, so they cannot disagree on which mode is best or fast
enough: :func:`best_and_fastest`. Pure functions of plain values; no MLflow, no plotting.

The rule (reference 12.2): the best row is the one with the best eval; the fastest good-enough row is
the quickest whose eval is within :data:`EVAL_TOLERANCE` of a bar (the best eval, or a reference run's).
"Within" is measured on the bar's magnitude, ``bar - tol * |bar|`` for a metric where higher is better
and ``bar + tol * |bar|`` where lower is, so it stays right for negative metrics (a log-likelihood, a
negative loss), where ``bar * (1 - tol)`` would put the bound on the wrong side of the bar.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

EVAL_TOLERANCE = 0.02
"""Good enough: an eval within 2 % (of the bar's magnitude) of the bar."""
MAX_TRAJECTORY_ROWS = 20
"""At most this many epochs in a per-epoch loss table (first and last always among them)."""
MISSING = "—"
"""The cell of a value that is absent or not finite."""

Row = TypeVar("Row")


# -- the best-mode rule ----------------------------------------------------------
def good_enough(value: float, bar: float, higher_better: bool, tol: float = EVAL_TOLERANCE) -> bool:
    """``value`` is within ``tol`` of ``bar`` (or better), the tolerance taken on ``|bar|``."""
    if higher_better:
        return value >= bar - tol * abs(bar)
    return value <= bar + tol * abs(bar)


def best_and_fastest(rows: Sequence[Row], score: Callable[[Row], Optional[float]], seconds: Callable[[Row], float],
                     higher_better: bool, bar: Optional[float] = None,
                     tol: float = EVAL_TOLERANCE) -> Optional[tuple[Row, Optional[Row]]]:
    """(the row with the best score, the fastest row whose score is :func:`good_enough` against ``bar``), or None
    when no row has a finite score.

    ``bar`` None: the best score (the best row then always qualifies, so the fastest is never None); a
    reference's score otherwise (then no row may reach it: None in second place). Rows whose ``score`` is
    None or not finite take no part; ties on the score or the time go to the earlier row."""
    scored = [(r, v) for r in rows if (v := score(r)) is not None and math.isfinite(v)]
    if not scored:
        return None
    best, best_v = scored[0]
    for r, v in scored[1:]:
        if (v > best_v) if higher_better else (v < best_v):
            best, best_v = r, v
    target = best_v if bar is None else bar
    near = [r for r, v in scored if good_enough(v, target, higher_better, tol)]
    return best, (min(near, key=seconds) if near else None)


# -- markdown ---------------------------------------------------------------------
def fmt(v: Optional[float], spec: str = "{:.4f}") -> str:
    """``v`` formatted by ``spec``; :data:`MISSING` when it is None, NaN or infinite."""
    return MISSING if v is None or not math.isfinite(v) else spec.format(v)


def secs(v: Optional[float]) -> str:
    """Seconds: two decimals under 10, one above."""
    return fmt(v, "{:.2f}" if v is not None and abs(v) < 10 else "{:.1f}")


def fmt_eval(v: Optional[float], accuracy: bool) -> str:
    """An eval value: a percentage for accuracy, four decimals for a loss or an error."""
    return fmt(v, "{:.2%}") if accuracy else fmt(v)


def fmt_delta(d: Optional[float], accuracy: bool) -> str:
    """An eval difference: percentage points for accuracy, signed four decimals otherwise."""
    if d is None or not math.isfinite(d):
        return MISSING
    return f"{d * 100:+.2f} pp" if accuracy else f"{d:+.4f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines (``|`` in a cell escaped); no blank line after it."""
    def esc(c: object) -> str:
        return str(c).replace("|", "\\|")

    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(map(esc, r)) + " |" for r in rows]]


def sampled(n: int, max_rows: int = MAX_TRAJECTORY_ROWS) -> list[int]:
    """At most ``max_rows`` of the indices ``0..n-1``, evenly spread, the first and the last included."""
    if n <= max_rows:
        return list(range(n))
    step = (n - 1) / (max_rows - 1)
    return sorted({round(i * step) for i in range(max_rows)})
