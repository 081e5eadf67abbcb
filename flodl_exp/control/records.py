"""The record stream: sub-epoch window reports and the on-disk record log (algorithms.md 9.5).

* :class:`WindowReporter` decides, at each reduce, whether the window closes
  one of the ``reports_per_epoch`` slices of the epoch's work; slices still
  owed when the epoch is aggregated are flushed then, so an epoch always
  yields exactly ``n`` window records.
* :class:`RingLog` is an append-only JSONL file that never exceeds
  ``max_bytes``: the oldest records are dropped first (a drop-oldest ring).
* :class:`RecordLog` keeps one ring per record node: ``root.log`` for the
  coordinator's stream and ``<host>/rank<r>.log`` per rank.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from typing import Any, Optional


class WindowReporter:
    def __init__(self, per_epoch: int, epoch_work: int) -> None:
        self.per_epoch = max(0, int(per_epoch))
        self.epoch_work = max(1, int(epoch_work))
        self.work: dict[int, int] = {}
        self.fired: dict[int, int] = {}

    def on_window(self, epoch: int, k_used: int) -> bool:
        """Add a window's batches to ``epoch``; True when it closes a new slice (at most one per window)."""
        if self.per_epoch == 0:
            return False
        self.work[epoch] = self.work.get(epoch, 0) + int(k_used)
        due = min(self.per_epoch, self.work[epoch] * self.per_epoch // self.epoch_work)
        if due > self.fired.get(epoch, 0):
            self.fired[epoch] = self.fired.get(epoch, 0) + 1
            return True
        return False

    def owed(self, epoch: int) -> int:
        """Reports still owed for ``epoch`` when it is aggregated (then counted as fired)."""
        if self.per_epoch == 0:
            return 0
        n = self.per_epoch - self.fired.get(epoch, 0)
        self.fired[epoch] = self.per_epoch
        return max(0, n)


class RingLog:
    """JSONL file bounded to ``max_bytes``; whole lines only, oldest dropped first."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = int(max_bytes)
        self.lines: deque[bytes] = deque()
        self.size = 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        if len(line) > self.max_bytes:
            return  # one record larger than the whole ring: dropped, never truncated mid-line
        self.lines.append(line)
        self.size += len(line)
        dropped = False
        while self.size > self.max_bytes:
            self.size -= len(self.lines.popleft())
            dropped = True
        if dropped:
            self._rewrite()
        else:
            with open(self.path, "ab") as fh:
                fh.write(line)

    def _rewrite(self) -> None:
        d = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".ring-", dir=d)
        with os.fdopen(fd, "wb") as fh:
            fh.writelines(self.lines)
        os.replace(tmp, self.path)


class RecordLog:
    def __init__(self, root_dir: Optional[str], max_bytes: int) -> None:
        self.dir = root_dir
        self.max_bytes = max_bytes
        self.rings: dict[str, RingLog] = {}
        self.hosts: dict[int, str] = {}

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _ring(self, rel: str) -> RingLog:
        if rel not in self.rings:
            self.rings[rel] = RingLog(os.path.join(self.dir, rel), self.max_bytes)  # type: ignore[arg-type]
        return self.rings[rel]

    def root(self, kind: str, fields: dict[str, Any]) -> None:
        if self.enabled:
            self._ring("root.log").append({"kind": kind, **fields})

    def rank(self, r: int, kind: str, fields: dict[str, Any]) -> None:
        if self.enabled:
            host = self.hosts.get(r, "unknown").replace("/", "_")
            self._ring(os.path.join(host, f"rank{r}.log")).append({"kind": kind, "rank": r, **fields})
