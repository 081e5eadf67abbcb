"""Who a run that cannot start is blamed on (pure; the control core's start-up decision).

Before training starts, three things can end the run: a joined rank's connection closes (its setup failed), a
rank that never joined is found lost (the shell reads its task's death record or process state from the job
folder and reports it), or the connect deadline passes. When a joined rank closes while another never
connected, the missing one's loss is the likelier first cause (its death ends the joined ranks' setup at once):
the close is blamed only after :data:`LOST_PEER_GRACE_S` without such a finding, or once every rank joined after
all. Each failure is one line naming the rank blamed first and the others after it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

log = logging.getLogger("flodl_exp.coordinator")

LOST_PEER_GRACE_S = 3.0
"""How long a close before training waits for a rank that never connected to be found lost (the likelier cause).
A task's death ends its joined peers' setup at once (collateral closes), often before its own process reads as
gone (a zombie until the task manager reaps it; 24 polls a second under submitit's local executor)."""


class StartupBlame:
    def __init__(self, grace_s: float = LOST_PEER_GRACE_S) -> None:
        self.grace_s = grace_s
        self._closes: list[tuple[int, str]] = []
        """Joined ranks whose connection closed before training started (rank, error), in arrival order."""
        self.blame_by: Optional[float] = None
        """When the first close is blamed if no rank that never connected was found lost by then."""
        self.deadline: Optional[float] = None
        self.timeout_s = 0.0
        self._failure: Optional[str] = None
        """The verdict that ended the run before training started (set by the core when it fails the run)."""

    @property
    def failure(self) -> Optional[str]:
        return self._failure

    def failed(self, failure: str) -> None:
        """The run could not start, for this reason (the core fails the run with it)."""
        self._failure = failure

    @property
    def closes(self) -> list[tuple[int, str]]:
        return self._closes

    def awaiting(self, timeout_s: float, now: float) -> None:
        """The shell started waiting for the ranks: every rank must have joined within ``timeout_s``."""
        self.timeout_s, self.deadline = timeout_s, now + timeout_s

    def _closed(self) -> set[int]:
        return {q for q, _ in self._closes}

    def on_close(self, r: int, error: str, missing: Sequence[int], now: float) -> Optional[str]:
        """A joined rank's connection closed: the failure at once when no other rank is missing, else None (the
        grace starts)."""
        self._closes.append((r, error))
        closed = self._closed()
        others = [q for q in missing if q not in closed]
        if not others:
            return self._close_failure(missing)
        if self.blame_by is None:
            self.blame_by = now + self.grace_s
            log.warning("rank %d failed before training started (%s); ranks %s never connected: waiting up to "
                        "%.0fs for one of them to be found lost (the likelier first cause)", r, error, others,
                        self.grace_s)
        return None

    def on_lost(self, r: int, cause: str, set_up_failed: bool) -> Optional[str]:
        """A rank that never joined was found lost (``set_up_failed``: its death record says why its setup
        failed): it leads the failure, the closes so far after it. None for a rank whose own close came first."""
        if r in self._closed():
            return None
        after = "".join(f"; after it, rank {q} failed: {err}" for q, err in self._closes)
        if set_up_failed:
            return f"rank {r} could not set up: {cause}{after}"
        return f"rank {r} was lost before training started: {cause}{after}"

    def check(self, missing: Sequence[int], now: float) -> Optional[str]:
        """The failure due by now, if any: a close past its grace (or with every rank joined), or the deadline
        with ranks still missing and nothing closed."""
        if self._closes:
            if not missing or (self.blame_by is not None and now >= self.blame_by):
                return self._close_failure(missing)
            return None
        if missing and self.deadline is not None and now > self.deadline:
            return f"ranks {list(missing)} did not connect within {self.timeout_s:.0f}s"
        return None

    def _close_failure(self, missing: Sequence[int]) -> str:
        """The first close before training started, blamed; any later ones after it."""
        (r, err), later = self._closes[0], self._closes[1:]
        closed = self._closed()
        still = [q for q in missing if q not in closed]
        cause = f" (ranks {still} never connected)" if still else ""
        after = "".join(f"; then rank {q} failed: {e}" for q, e in later)
        return f"rank {r} failed before training started{cause}: {err}{after}"
