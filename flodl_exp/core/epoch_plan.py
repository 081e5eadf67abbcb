"""The run's epoch count, held in one place.

The dispatcher (when the run runs out of picks), callback slack (which epoch closes with an eval), checkpoints
(which boundary takes a periodic bundle), the bundle writer (the meta's ``epoch``) and the run's end (the final
eval's epoch) all ask how many epochs the run trains. A cooperative loop's ``w.request_stop()`` lowers that count
mid-run; with one shared :class:`EpochPlan` it is lowered once and every component sees it at its next read,
instead of each keeping a copy that the stop had to update one by one.
"""
from __future__ import annotations

from typing import Union


class EpochPlan:
    """How many epochs the run trains: the config's, or fewer once a loop asked to stop."""

    __slots__ = ("_epochs",)

    def __init__(self, epochs: int) -> None:
        if int(epochs) < 1:
            raise ValueError(f"a run trains at least one epoch (got {epochs})")
        self._epochs = int(epochs)

    @property
    def epochs(self) -> int:
        return self._epochs

    def end_after(self, last_epoch: int) -> None:
        """``last_epoch`` becomes the run's last (only ever lowered: a later, larger stop asks for nothing)."""
        self._epochs = min(self._epochs, int(last_epoch) + 1)

    @staticmethod
    def of(epochs: Union[int, EpochPlan]) -> EpochPlan:
        """The shared plan as given, or a plan of its own for a component built alone (tests)."""
        return epochs if isinstance(epochs, EpochPlan) else EpochPlan(epochs)

    def __repr__(self) -> str:
        return f"EpochPlan(epochs={self._epochs})"
