"""A rank's control (rank/control.py) without a socket or a thread: what it sends is collected in a list,
what the coordinator says comes from a plain queue. The rank's tests build it here, with the real
RankTrainer or a small fake of the part of it the handlers touch."""
from __future__ import annotations

import queue
from typing import Any, Optional

import torch

from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.messages import Payload
from flodl_exp.protocol.wire import Message
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.inbox import ControlInbox


class Sent(list):
    """The payloads a rank sent, each through the wire's encoding and back (so each one is sendable)."""

    def send(self, payload: Payload) -> None:
        self.append(decode(encode(payload)))

    def of(self, kind: type) -> list[Any]:
        return [m for m in self if isinstance(m, kind)]


def rank_control(trainer: Any, *, messages: tuple[Payload, ...] | list[Payload] = (), rank: int = 0, world_size: int = 2,
                 frames: Optional[queue.Queue[Message | BaseException]] = None, **kw: Any) -> tuple[RankControl, Sent]:
    """A RankControl over ``trainer`` with ``messages`` already queued from the coordinator (``frames``: the
    queue to read them from, for a test that scripts what a read finds); ``kw``: RankControl's own options."""
    sent = Sent()
    inbox = ControlInbox(coord_timeout=30.0, rank=rank, frames=frames)
    for m in messages:
        inbox.put(encode(m))
    ctl = RankControl(sent.send, inbox, trainer, rank=rank, world_size=world_size, device=torch.device("cpu"), **kw)
    return ctl, sent


DIGITS_MLP = {
    "name": "t", "model": {"_target_": "flodl_exp.zoo.digits.MLP", "hidden": 16},
    "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    "scheduler": None, "train_data": {"_target_": "flodl_exp.zoo.digits.DigitsDataset", "split": "train"},
    "eval_data": None, "train_step": "flodl_exp.zoo.digits.train_step", "eval_fn": None,
    "batch_size": 32, "epochs": 1,
}
"""A small experiment node (digits, a 16-unit MLP, SGD) for build_experiment in the rank's tests, CPU and GPU."""


def spy_clip_norms(monkeypatch: Any) -> list[float]:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` so each call records the gradients' total norm it was handed (the
    AMP tests check that clipping sees unscaled gradients); returns the list it appends to."""
    seen: list[float] = []
    real = torch.nn.utils.clip_grad_norm_

    def clip(params: Any, max_norm: float, *a: Any, **kw: Any) -> Any:
        ps = list(params)
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))))
        return real(ps, max_norm, *a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    return seen
