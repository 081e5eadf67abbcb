"""The cooperative loops' intents (``w.request_eval()``, ``w.request_checkpoint()``): which boundary answers them.

Every rank of a loop usually asks, some before the epoch's boundary and some after it (under async the fast
ranks are epochs ahead), so an intent carries the epoch it was asked in and each kind keeps the latest
boundary that answered it: an intent for an epoch up to that boundary is a duplicate. Pure: the coordinator
asks, answers and acts.
"""
from __future__ import annotations

from typing import Optional

from flodl_exp.protocol.messages import INTENT_KINDS


class Intents:
    def __init__(self) -> None:
        self.pending: dict[str, int] = {}
        """kind -> the lowest epoch asked and not answered yet."""
        self.answered: dict[str, int] = {kind: -1 for kind in INTENT_KINDS}
        """kind -> the latest boundary (epoch) that answered it."""

    def ask(self, kind: str, epoch: int) -> bool:
        """Record an intent; False when a boundary at or after ``epoch`` already answered it."""
        epoch = max(0, epoch)
        if epoch <= self.answered[kind]:
            return False
        self.pending[kind] = min(self.pending.get(kind, epoch), epoch)
        return True

    def waiting(self, kind: str, boundary: int) -> bool:
        """:meth:`due`'s answer without taking the intent."""
        first: Optional[int] = self.pending.get(kind)
        return first is not None and first <= boundary

    def due(self, kind: str, boundary: int) -> bool:
        """Is an intent of ``kind`` asked up to epoch ``boundary`` waiting? (taken: the caller answers it)."""
        first: Optional[int] = self.pending.get(kind)
        if first is None or first > boundary:
            return False
        del self.pending[kind]
        return True

    def answer(self, kind: str, boundary: int) -> None:
        """``kind`` was done at ``boundary`` (asked or not): intents for epochs up to it are answered."""
        self.answered[kind] = max(self.answered[kind], boundary)
        if self.pending.get(kind, boundary + 1) <= boundary:
            del self.pending[kind]
