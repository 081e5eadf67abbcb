"""From the store to :class:`~flodl_exp.bench.report.BenchRow`: the children of a bench parent run.

Metrics come from MLflow (per-epoch histories: loss, epoch_time_s, syncs, sync_ms_avg, anchor, eval/*,
rank<r>/idle_frac); the rest from each run's folder (tag ``job_dir``): ``events.jsonl`` (epoch windows),
``timeline/timeline.json`` (reduce starts, CPU averages, idle by cause; flodl_exp runs only) and
``coordinator.log`` (every anchor change: the per-epoch ``anchor`` metric only samples it). A folder that is
gone (another machine, cleaned up) falls back to the run's MLflow artifacts (``run/events.jsonl``,
``timeline/timeline.json``) and, for anchors, to the metric history.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any, Optional

from flodl_exp.bench.report import BenchRow
from flodl_exp.report import RANK_KEY

ANCHOR_LINE = re.compile(r"anchor (\d+) -> (\d+)")
KEYS = ("loss", "epoch_time_s", "syncs", "sync_ms_avg", "anchor")


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _artifact(client: Any, run_id: str, rel: str) -> Optional[str]:
    try:
        with tempfile.TemporaryDirectory() as d:
            return _read(client.download_artifacts(run_id, rel, d))
    except Exception:
        return None


def anchors_from_log(text: str, first: Optional[float]) -> list[float]:
    """Every anchor in order from ``coordinator.log``'s ``anchor a -> b`` lines (``first`` when none changed)."""
    pairs = [(float(a), float(b)) for a, b in ANCHOR_LINE.findall(text)]
    if not pairs:
        return [first] if first is not None else []
    return [pairs[0][0], *[b for _, b in pairs]]


def epoch_windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) per aggregated epoch from ``epoch`` events: end = the event's ``t``, start = end − epoch_time_s
    (both runners measure an epoch from its first work out to its aggregation)."""
    return [(float(e["t"]) - float(e["epoch_time_s"]), float(e["t"])) for e in events
            if e.get("event") == "epoch" and "t" in e and "epoch_time_s" in e]


def timeline_fields(tl: dict) -> dict[str, Any]:
    """Reduce starts, CPU averaging walls, epoch windows and idle by cause from a ``timeline.json``."""
    cols = tl.get("columns") or ["rank", "kind", "start_s", "end_s", "epoch", "window", "n"]
    ix = {c: i for i, c in enumerate(cols)}
    starts: dict[Any, float] = {}
    cpu: dict[Any, float] = {}
    for s in tl.get("spans", []):
        kind, t0, t1, win = s[ix["kind"]], float(s[ix["start_s"]]), float(s[ix["end_s"]]), s[ix["window"]]
        key = win if win is not None else round(t0, 4)
        if kind == "sync":
            starts[key] = min(starts.get(key, t0), t0)
        elif kind == "cpu_avg":
            cpu[key] = max(cpu.get(key, 0.0), (t1 - t0) * 1e3)
    ranks = (tl.get("idle_analysis") or {}).get("ranks") or {}
    idle = [dict(ranks[k].get("idle_by_cause_s") or {}) for k in sorted(ranks, key=int)] or None
    return {"sync_starts": sorted(starts.values()), "cpu_avg_ms": [cpu[k] for k in cpu],
            "epoch_windows": [(float(e["start_s"]), float(e["end_s"])) for e in tl.get("epochs", [])],
            "idle_by_cause": idle}


def make_row(tags: dict[str, str], status: str, history: dict[str, list[tuple[int, float]]], events: list[dict],
             timeline: Optional[dict], coordinator_log: Optional[str], params: Optional[dict[str, str]] = None) -> BenchRow:
    """One report row from a run's tags, metric histories and files (pure)."""
    from flodl_exp.report import RunData, summarize

    s = summarize(RunData(run_id="", tags=tags, status=status, history=history), None)
    kind = tags.get("bench.kind", "flodl")
    row = BenchRow(model=tags.get("bench.model", tags.get("experiment", "?")), run=tags.get("bench.run", tags.get("mode", "?")),
                   kind=kind, status=status, world_size=s.world_size, losses=list(history.get("loss", [])),
                   epoch_times=list(history.get("epoch_time_s", [])),
                   evals={k: v[-1][1] for k, v in history.items() if k.startswith("eval/") and v},
                   syncs=s.syncs, sync_ms_avg=s.sync_ms_avg, util=s.util, idle_s=s.idle_s, history=history,
                   epoch_windows=epoch_windows(events))
    elche = kind == "flodl" and s.world_size > 1 and bool(history.get("anchor"))
    if elche:
        first = history["anchor"][0][1]
        row.anchors = (anchors_from_log(coordinator_log, first) if coordinator_log is not None
                       else [v for _, v in history["anchor"]])
        p = params or {}
        # The coordinator throttles only on the cpu backend with mode.max_batch_diff set (core/cycle.py);
        # otherwise there are none by construction. With it set, the count is not recorded: unknown.
        row.throttles = 0 if p.get("mode.backend") != "cpu" or p.get("mode.max_batch_diff") in (None, "None") else None
    if timeline is not None:
        tf = timeline_fields(timeline)
        row.sync_starts, row.idle_by_cause = tf["sync_starts"], tf["idle_by_cause"]
        row.cpu_avg_ms = tf["cpu_avg_ms"] if tags.get("backend") == "cpu" else None
        if tf["epoch_windows"]:
            row.epoch_windows = tf["epoch_windows"]
    return row


def load_rows(client: Any, experiment_name: str, parent_run_id: str) -> list[BenchRow]:
    """Every child run of ``parent_run_id``, oldest first (the suite's order)."""
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        raise ValueError(f"unknown MLflow experiment {experiment_name!r}")
    found, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  max_results=1000, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            break
    found.sort(key=lambda r: r.info.start_time or 0)
    rows = []
    for r in found:
        rid, tags = r.info.run_id, dict(r.data.tags)
        keys = [k for k in r.data.metrics if k in KEYS or k.startswith("eval/") or RANK_KEY.match(k)]
        history = {k: _history(client, rid, k) for k in keys}
        job = tags.get("job_dir", "")
        ev_text = _read(os.path.join(job, "events.jsonl")) if job else None
        ev_text = ev_text if ev_text is not None else _artifact(client, rid, "run/events.jsonl")
        events = [json.loads(x) for x in (ev_text or "").splitlines() if x.strip()]
        timeline = None
        if tags.get("bench.kind", "flodl") == "flodl":
            tl_text = _read(os.path.join(job, "timeline", "timeline.json")) if job else None
            tl_text = tl_text if tl_text is not None else _artifact(client, rid, "timeline/timeline.json")
            timeline = json.loads(tl_text) if tl_text else None
        log_text = _read(os.path.join(job, "coordinator.log")) if job else None
        rows.append(make_row(tags, r.info.status, history, events, timeline, log_text, dict(r.data.params)))
    return rows
