"""An example outer optimizer of your own (``outer._target_``): flodl_exp.outer.UserOuterProtocol.

    python -m flodl_exp mode=cpu_cadence outer._target_=flodl_exp.zoo.outers.HeavyBall +outer.args.mu=0.5

Copy it into your project and change the rule; only ``step`` is required.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch


class HeavyBall:
    """SlowMo's heavy-ball step written as a user class: ``g = prev - consensus``, ``v = mu v + g``,
    ``new = prev - lr v``; the first window seeds ``prev`` and adopts the consensus."""

    resets_inner = False

    def __init__(self, lr: float = 1.0, mu: float = 0.5) -> None:
        self.lr, self.mu = float(lr), float(mu)
        self.prev: Optional[list[torch.Tensor]] = None
        self.v: Optional[list[torch.Tensor]] = None

    def step(self, consensus: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.prev is None or [p.shape for p in self.prev] != [c.shape for c in consensus]:
            self.prev = [c.clone() for c in consensus]
            self.v = [torch.zeros_like(c) for c in consensus]
            return [c.clone() for c in consensus]
        assert self.v is not None
        for p, v, c in zip(self.prev, self.v, consensus):
            v.mul_(self.mu).add_(p - c)
            p.sub_(v, alpha=self.lr)
        return [p.clone() for p in self.prev]

    def momentum_norm(self) -> float:
        return math.sqrt(sum(float(torch.sum(v * v)) for v in self.v or []))

    def reset(self) -> None:
        self.prev = self.v = None

    def state_dict(self) -> dict[str, Any]:
        return {"prev": [p.clone() for p in self.prev or []], "v": [v.clone() for v in self.v or []]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        prev, v = list(state.get("prev") or []), list(state.get("v") or [])
        self.prev, self.v = (prev, v) if prev else (None, None)
