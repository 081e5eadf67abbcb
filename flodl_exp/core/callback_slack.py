"""Callback slack (algorithms.md 3.15): an eval runs on one rank while its peers train on, so the window in
which it runs would end with every peer waiting for that rank. Before that window the coordinator stages
the eval's expected time (an EWMA of its recent elapsed times on that rank) as ElChe slack: the rank's count
for the window drops by ``ceil(slack / its ms per batch)``, and it runs the eval in its own slack. Pure.
"""
from __future__ import annotations

import math
from typing import Optional, Union

from flodl_exp.core.epoch_plan import EpochPlan

EWMA_ALPHA = 0.5
"""Weight of the newest eval time (the reference leaves the coefficient unspecified): evals of one model on one
data split take near-constant time, so a short memory follows a change (a resized eval set) within two evals."""


class CallbackSlack:
    def __init__(self, *, enabled: bool, eval_every: int, epochs: Union[int, EpochPlan], epoch_fn: bool = False) -> None:
        self.enabled = enabled
        self.eval_every = int(eval_every)
        self._plan = EpochPlan.of(epochs)
        self.epoch_fn = epoch_fn
        """``experiment.epoch_fn`` is set: it runs on the callback rank before every epoch (slack covers the ones
        after the first, which start while the cohort is training)."""
        self.ewma: dict[tuple[int, str], float] = {}
        """(rank, callback: eval | epoch_fn) -> smoothed elapsed time (ms) measured on that rank."""
        self._staged: set[int] = set()

    @property
    def epochs(self) -> int:
        """The run's epoch count (the shared :class:`EpochPlan`: lowered once by a stop)."""
        return self._plan.epochs

    @property
    def ewma_ms(self) -> dict[int, float]:
        """rank -> smoothed eval time (ms)."""
        return {r: ms for (r, kind), ms in self.ewma.items() if kind == "eval"}

    def on_elapsed(self, rank: int, ms: Optional[float], kind: str = "eval") -> None:
        """A callback's elapsed time on ``rank`` (the final eval runs after training: not counted)."""
        if ms is None or not math.isfinite(ms) or ms < 0:
            return
        prev = self.ewma.get((rank, kind))
        self.ewma[(rank, kind)] = ms if prev is None else EWMA_ALPHA * ms + (1 - EWMA_ALPHA) * prev

    def eval_follows(self, epoch: int) -> bool:
        """A periodic eval fires once ``epoch`` is aggregated (the last epoch has the final eval instead)."""
        return self.eval_every > 0 and epoch != self.epochs - 1 and (epoch + 1) % self.eval_every == 0

    def due(self, closing_epoch: Optional[int], callback_rank: int) -> dict[int, float]:
        """The slack to stage at this reduce: ``{callback_rank: ms}`` once per epoch, at the first reduce whose
        next window holds the epoch's end (``closing_epoch``, Dispatcher.closing_epoch), summing the known times of the callbacks that
        run on the callback rank around that boundary (the eval after it, the epoch hook before the next);
        else nothing."""
        if not self.enabled or closing_epoch is None or closing_epoch in self._staged:
            return {}
        ms = 0.0
        if self.eval_follows(closing_epoch):
            ms += self.ewma.get((callback_rank, "eval"), 0.0)
        if self.epoch_fn and closing_epoch + 1 < self.epochs:  # the hook runs before the next epoch
            ms += self.ewma.get((callback_rank, "epoch_fn"), 0.0)
        if ms <= 0:
            return {}
        self._staged.add(closing_epoch)
        return {callback_rank: ms}
