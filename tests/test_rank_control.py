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
    w.last_consensus = {}
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


def test_a_consensus_save_writes_the_consensus_not_the_blended_replica(tmp_path):
    from flodl_exp.checkpoint import load_model_state
    from flodl_exp.protocol import Save

    w = _worker(0)
    w.rank = 0
    w.trainer.optimizer = torch.optim.SGD(w.trainer.model.parameters(), lr=0.1)  # type: ignore[attr-defined]
    sent: list = []
    w.conn = SimpleNamespace(send=sent.append)  # type: ignore[assignment]
    with torch.no_grad():
        w.trainer.model.weight.fill_(1.0)
    consensus = {"p0": torch.full((1, 2), 3.0), "p1": torch.full((1,), 3.0)}
    w._on_update(Update(n=1, alpha=0.5, tensors=consensus))  # the replica is now halfway: 2.0
    stem = str(tmp_path / "b")
    w._save(Save(stem=stem, primary=True, model=True, consensus=True))
    state = load_model_state(stem, map_location="cpu")
    assert torch.equal(state["weight"], consensus["p0"]) and torch.equal(state["bias"], consensus["p1"])
    assert torch.allclose(w.trainer.model.weight, torch.full((1, 2), 2.0)), "the replica itself is untouched"
    w._save(Save(stem=stem, primary=True, model=True, consensus=False))
    assert torch.allclose(load_model_state(stem, map_location="cpu")["weight"], torch.full((1, 2), 2.0))
