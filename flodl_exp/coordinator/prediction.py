"""The simulator's prediction for a finished run, made by its coordinator (``tracking.predict``).

The launcher used to make it: it read the run back from MLflow and imported the simulator (torch, 2-3 s of CPU)
while the job trained, and a short run's end waited for that import (1.5 s of a 1-epoch run's 9 s). The coordinator
has torch imported already and saw every record it logged, so the prediction costs it one simulation (~0.1 s on
small rigs): :class:`RecordTap` keeps the metric points and tags a replay reads, exactly as the sink stamped them, and
:func:`predict_finished_run` feeds them to :func:`~flodl_exp.simulate.from_run.prediction_metrics` with the params
the launcher logged (the flattened config), so ``--from-run`` replays the same numbers from the store.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import defaultdict
from typing import Any, Mapping, Optional

log = logging.getLogger("flodl_exp.coordinator")

PREDICT_WAIT_S = 20.0
"""How long the run's end gives the prediction (then it goes without one, and says so)."""

THREAD = "flodl-predict"

_KEPT = re.compile(r"^(samples|epoch_time_s|syncs|sync_ms_avg|rank\d+/(batches|compute_only_ms|data_starve_ms))$")
"""The metric keys a replay reads (simulate/from_run.py RUN_KEYS and RANK_KEYS): the tap keeps only these."""


class RecordTap:
    """A sink that keeps what the prediction reads (metric points, tags) and passes everything to ``sink``.

    It stamps each metric point itself (strictly increasing ms, as the sinks do) and hands the stamp down, so the
    points it keeps are the ones the store gets. Any other attribute is the wrapped sink's."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.history: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
        self.tags: dict[str, str] = {}
        self._last_ts = 0

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: Optional[int] = None) -> None:
        ts = max(int(time.time() * 1000), self._last_ts + 1) if timestamp_ms is None else int(timestamp_ms)
        self._last_ts = max(self._last_ts, ts)
        for k, v in metrics.items():
            if v is not None and _KEPT.match(k):
                self.history[k].append((int(step), float(v), ts))
        self.sink.log_metrics(metrics, step, timestamp_ms=ts)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tags.update({k: str(v) for k, v in tags.items()})
        self.sink.set_tags(tags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)


def predict_finished_run(config: Mapping[str, Any], tap: RecordTap, result: Mapping[str, Any],
                         wait_s: float = PREDICT_WAIT_S) -> tuple[Optional[dict[str, float]], Optional[str]]:
    """``(prediction, None)``: ``predicted/*`` for the run's own mode on its measured rig plus
    ``measured/samples_per_s`` and ``measured/wall_s`` (the training wall it is over); ``(None, why)`` when it failed or took longer than ``wait_s`` (a daemon thread:
    the process's exit ends it)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = _predict(config, tap, result)
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"

    # the simulated control core logs as the coordinator does ("anchor 10 -> 20"): those lines are held back, by
    # thread, so the coordinator's own lines (and a late prediction's) still reach its log
    quiet = _NotThread(THREAD)
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(quiet)
    th = threading.Thread(target=work, name=THREAD, daemon=True)
    th.start()
    th.join(wait_s)
    if not th.is_alive():
        for h in handlers:
            h.removeFilter(quiet)
    if th.is_alive():
        return None, f"not done within {wait_s:.0f} s"
    if "error" in box:
        return None, str(box["error"])
    return box["out"], None


class _NotThread(logging.Filter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.thread = name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != self.thread


def _predict(config: Mapping[str, Any], tap: RecordTap, result: Mapping[str, Any]) -> dict[str, float]:
    from flodl_exp.simulate.from_run import adopt_auto_choice, base_config, measured, prediction_metrics
    from flodl_exp.tracking import flatten

    params = flatten(config)
    adopt_auto_choice(params, tap.tags.get("auto.choice"))  # mode=auto: the run trained in the mode it chose
    stem = result.get("stem")
    model_mb = os.path.getsize(f"{stem}.pt") / 1e6 if isinstance(stem, str) and os.path.isfile(f"{stem}.pt") else None
    history = dict(tap.history)
    out = prediction_metrics(params, history, result, base=base_config(), model_mb=model_mb)
    seen = measured(history)  # the basis of predicted/error_pct: samples over the first epoch's start to the last's end
    return {**out, "measured/samples_per_s": seen["samples_per_s"], "measured/wall_s": seen["wall_s"]}
