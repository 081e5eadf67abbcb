"""The rank's control handlers, without a coordinator: what adopting an update does to the window."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from flodl_exp.protocol import Update
from flodl_exp.rank.backends import CoordinatorBackend
from flodl_exp.rank.worker import RankWorker


def _worker(steps_since_avg: int) -> RankWorker:
    w = RankWorker.__new__(RankWorker)  # the handlers only, no connection or data plane
    w.trainer = SimpleNamespace(steps_since_avg=steps_since_avg, model=torch.nn.Linear(2, 1))  # type: ignore[assignment]
    w.cpu = CoordinatorBackend()
    w.awaiting_update = True
    w.throttled = True
    return w


def test_adopting_an_update_resets_the_window():
    """Batches trained after the snapshot (13 - 10 here) are overwritten by the update: none carries over."""
    w = _worker(13)
    w._on_update(Update(n=10, skip=True))
    assert w.trainer.steps_since_avg == 0 and not w.awaiting_update and not w.throttled


def test_a_blended_update_moves_the_replica_halfway():
    w = _worker(4)
    model = w.trainer.model
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    w._on_update(Update(n=4, alpha=0.5, tensors={"p0": torch.full((1, 2), 3.0), "p1": torch.full((1,), 3.0)}))
    assert torch.allclose(model.weight, torch.full((1, 2), 2.0)) and w.trainer.steps_since_avg == 0
