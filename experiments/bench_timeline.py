"""Where a paced reduce trigger's time went (issue 52): reads a job folder kept by a timeline run of the coordinator bench.

``BENCH_TIMELINE=1 python experiments/bench_coordinator.py --pace 20 --seconds 60 --sizes 1024 --reps 1 --node-size 16
--keep DIR`` then ``python experiments/bench_timeline.py DIR/job-1024-*``.

For each reduce, the report that completed the last rank's count (the coordinator's ledger: ``done``) is followed
from the simulated rank's call (``calls``) through its socket write (``writes``), the coordinator's read-thread
hand-off (the stamp of the event that carried it), its handling, to the trigger: ``call->write`` (the rank's
BatchReportPacer holding it), ``write->handoff`` (in the coordinator's socket until the read thread took it),
``queue`` (read thread to main thread) and ``handled->trig`` (the gate). Also: whether each ReportPace named
the report that completed the count, and the read thread's turns (CPU, run-queue wait, sockets ready).
"""
from __future__ import annotations

import glob
import json
import sys
from collections import Counter
from typing import Any, Optional


def _ms(x: float) -> float:
    return round(x * 1e3, 1)


def _load(job: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    st = json.load(open(f"{job}/coordinator_stats.json"))
    sims = [json.load(open(f)) for f in sorted(glob.glob(f"{job}/sim?.json"))]
    tls = [json.load(open(f)) for f in sorted(glob.glob(f"{job}/sim?.json.tl.json"))]
    return st, sims, tls


def _reads_summary(rs: list[list[float]]) -> dict[str, float]:
    """Read-thread turns: wall (blocked in select + processing), CPU and run-queue wait (ms), sockets ready."""
    return {"turns": len(rs), "wall_ms": round(sum(r[5] + r[1] for r in rs) * 1e3),
            "select_ms": round(sum(r[1] for r in rs) * 1e3), "cpu_ms": round(sum(r[3] for r in rs)),
            "runq_ms": round(sum(r[4] for r in rs)), "ready_mean": round(sum(r[2] for r in rs) / max(1, len(rs)))}


def analyse(job: str) -> list[str]:
    st, sims, tls = _load(job)
    tl = st["timeline"]
    writes: dict[int, list[list[float]]] = {}
    calls: dict[int, list[float]] = {}
    paces: dict[int, list[tuple[float, int, int]]] = {}
    for t in tls:
        writes.update({int(k): v for k, v in t["writes"].items()})
        calls.update({int(k): v for k, v in t["calls"].items()})
        for r, at, flush_at, reports in t["paces"]:
            paces.setdefault(int(r), []).append((at, flush_at, reports))
    done = sorted(tl["done"], key=lambda x: x[3])
    lines: list[str] = []
    shares = [0.0, 0.0, 0.0, 0.0]
    pace_off: Counter[int] = Counter()
    prev = 0.0
    for v, t, _final in st["triggers"]:
        win = [d for d in done if prev < d[3] <= t]
        prev = t
        if not win:
            lines.append(f"v={v}: no count completed in its window")
            continue
        _, r, idx, handled, handoff = win[-1]
        call = calls[r][idx - 1] if idx - 1 < len(calls[r]) else None
        write: Optional[list[float]] = next((w for w in writes[r] if w[0] >= idx), None)
        if call is None or write is None or handoff is None:
            lines.append(f"v={v}: rank {r} report {idx}: not traced")
            continue
        parts = [write[2] - call, handoff - write[2], handled - handoff, t - handled]
        shares = [a + b for a, b in zip(shares, parts)]
        reads = [x for x in tl.get("reads", []) if write[2] <= x[0] <= handoff]
        lines.append(f"v={v}: rank {r} report {idx}: call->trig {_ms(t - call)} ms = call->write {_ms(parts[0])}"
                     f" + write->handoff {_ms(parts[1])} + queue {_ms(parts[2])} + handled->trig {_ms(parts[3])};"
                     f" read turns meanwhile {_reads_summary(reads)}")
    for _, r, idx, _, _ in done:
        if idx - 1 < len(calls.get(r, [])):
            before = [p for p in paces.get(r, []) if p[0] <= calls[r][idx - 1]]
            if before:
                pace_off[before[-1][1] - idx] += 1
    total = sum(shares) or 1.0
    lines.append("shares of the last completing reports' time: " + ", ".join(
        f"{name} {100 * s / total:.1f} %" for name, s in zip(("call->write", "write->handoff", "queue", "handled->trig"), shares)))
    lines.append(f"ReportPace's flush_at minus the report that completed the count: {dict(pace_off)}")
    reads = tl.get("reads", [])
    if reads:
        lines.append(f"read turns: all {_reads_summary(reads)}; processing > 20 ms {_reads_summary([x for x in reads if x[5] > 0.02])}")
    return lines


def main(argv: list[str]) -> int:
    for job in argv:
        print("\n".join(analyse(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
