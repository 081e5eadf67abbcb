"""Outer optimizers (algorithms.md 11.1): a step applied to the consensus between the reduce and the
broadcast, over parameters only (buffers pass through). Pure tensor code, no I/O.

* ``avg`` (default): identity, ``new = consensus``; no state, nothing in the bundle.
* ``slowmo`` (SlowMo, heavy ball): ``v = mu*v + g``; ``new = prev - lr*v``.
* ``diloco`` (DiLoCo, Nesterov): ``v = mu*v + g``; ``new = prev - lr*(mu*v + g)``; the inner
  optimizer's state is reset after each adoption (:attr:`OuterSpec.resets_inner`).

``g = prev - consensus`` is the outer gradient: how far the window's averaged training moved the
global model, with ``prev`` the global adopted at the end of the previous window. The first window
has no ``prev``: the step is a no-op that seeds the momentum at zero. A change in the parameter
count or shapes restarts the momentum the same way.

The same class runs once at the coordinator (cpu backend, on each window's parameter frame) or
replicated on every rank after the all-reduce (nccl backend): identical inputs give identical
results, so no extra collective is needed. Arithmetic is float32 whatever the parameters' dtype.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .config import OUTER_DEFAULTS as DEFAULTS  # noqa: F401  (the spec lives with the config: the launcher needs no torch)
from .config import OUTERS as OUTER_KINDS  # noqa: F401
from .config import OuterSpec

SIDECAR_FORMAT = 1


@dataclass(frozen=True)
class OuterStep:
    """What one outer step did, for the metrics."""

    step_norm: float
    """||prev - new||: the change the window made to the global model (0 on a seeding window)."""
    momentum_norm: float
    """||v|| after the step."""
    seeded: bool
    """The first window (or a parameter-count change): a no-op that seeded the momentum at zero."""


def _norm(ts: Sequence[torch.Tensor]) -> float:
    """The L2 norm over several tensors, read back once (one device sync, not one per tensor)."""
    return _sum_norm([t.float().pow(2).sum() for t in ts])


def _sum_norm(squares: Sequence[torch.Tensor]) -> float:
    if not squares:
        return 0.0
    return math.sqrt(float(torch.stack([s.to(squares[0].device) for s in squares]).sum()))


class OuterOptimizer:
    """The outer optimizer's state (``prev`` and the momentum ``v``, float32, one tensor per parameter)."""

    def __init__(self, spec: OuterSpec) -> None:
        self.spec = spec
        self.prev: Optional[list[torch.Tensor]] = None
        self.momentum: Optional[list[torch.Tensor]] = None

    def _matches(self, params: Sequence[torch.Tensor]) -> bool:
        prev = self.prev
        return prev is not None and len(prev) == len(params) and all(
            tuple(a.shape) == tuple(b.shape) for a, b in zip(prev, params))

    @torch.no_grad()
    def step(self, consensus: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[OuterStep]]:
        """The global to adopt for this window's ``consensus`` (parameters, in model order), in the
        consensus's dtypes and devices. ``avg`` returns the consensus itself and no step record."""
        if not self.spec.stateful:
            return list(consensus), None
        cons = [t.detach().float() for t in consensus]
        if not self._matches(cons):  # first window, or the model changed: seed at zero, adopt the consensus
            self.prev = [t.clone() for t in cons]
            self.momentum = [torch.zeros_like(t) for t in cons]
            return list(consensus), OuterStep(0.0, 0.0, seeded=True)
        assert self.prev is not None and self.momentum is not None
        lr, mu = self.spec.lr, self.spec.mu
        new: list[torch.Tensor] = []
        moved_sq: list[torch.Tensor] = []
        for i, c in enumerate(cons):
            prev, v = self.prev[i].to(c.device), self.momentum[i].to(c.device)
            g = prev - c
            v.mul_(mu).add_(g)
            direction = v if self.spec.kind == "slowmo" else g.add_(v, alpha=mu)  # g is not needed after this
            moved_sq.append(direction.float().pow(2).sum() * (lr * lr))  # ||new - prev|| = lr ||direction||
            new.append(prev.sub(direction, alpha=lr))
            self.momentum[i] = v
        # The returned tensors become the next ``prev`` as they are: callers must not modify them in place.
        self.prev = new
        out = [n.to(dtype=c.dtype) for n, c in zip(new, consensus)]
        return out, OuterStep(_sum_norm(moved_sq), self.momentum_norm(), seeded=False)

    def momentum_norm(self) -> float:
        return _norm(self.momentum or [])

    # -- the bundle sidecar ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sidecar's content: ``momentum`` and ``prev``, one CPU tensor per parameter, positional."""
        return {
            "format": SIDECAR_FORMAT,
            "kind": self.spec.kind,
            "lr": self.spec.lr,
            "mu": self.spec.mu,
            "momentum": [t.detach().to("cpu") for t in self.momentum or []],
            "prev": [t.detach().to("cpu") for t in self.prev or []],
        }

    def load_state_dict(self, state: dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore a sidecar (the knobs may differ from the saved ones: the run's config wins)."""
        mom = [t.float().to(device) if device is not None else t.float() for t in state.get("momentum") or []]
        prev = [t.float().to(device) if device is not None else t.float() for t in state.get("prev") or []]
        if len(mom) != len(prev):
            raise ValueError(f"outer sidecar: {len(mom)} momentum tensors but {len(prev)} prev tensors")
        self.momentum, self.prev = (mom, prev) if mom else (None, None)
