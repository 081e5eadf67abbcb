"""Averaging math shared by both backends (algorithms.md 3.8, 3.9, 6.1). Pure tensor code.

* Parameters are averaged with work weights ``mass(n_r, gamma)``: idle ranks
  never vote, ``gamma=1`` is plain work weighting, ``gamma=0`` the mean of movers.
* Float buffers (BatchNorm running stats) are averaged with equal weight among
  movers; integer buffers keep the local value.
* The divergence triple ``(||pre - post|| / ||post||, ||post||, ||pre||)`` feeds
  the convergence guards.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn


def mass(n: int, gamma: float) -> float:
    if n <= 0:
        return 0.0
    if gamma == 1.0:
        return float(n)
    return float(n) ** float(gamma)


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def consensus_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model``'s state dict with parameters (``p<i>``) and float buffers (``b<j>``) taken from a
    cpu-backend consensus frame, in the same order the snapshot and the update use."""
    state = dict(model.state_dict())
    for i, (name, p) in enumerate(model.named_parameters()):
        if f"p{i}" in tensors:
            state[name] = tensors[f"p{i}"].to(p.dtype)
    float_names = [name for name, b in model.named_buffers() if b.is_floating_point()]
    for j, name in enumerate(float_names):
        if f"b{j}" in tensors:
            state[name] = tensors[f"b{j}"].to(state[name].dtype)
    return state


def pack_into(ts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``ts`` one after the other into the flat ``out`` (cast to its dtype): no allocation. The sync's
    all-reduce buffer (rank/backends.py) and the outer optimizer's flat state (outer.py) are filled this way."""
    off = 0
    for t in ts:
        k = t.numel()
        out[off:off + k].view_as(t).copy_(t)
        off += k


def unpack_from(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """The inverse of :func:`pack_into`: each of ``ts`` takes its slice of ``flat``."""
    off = 0
    for t in ts:
        k = t.numel()
        t.copy_(flat[off:off + k].view_as(t))
        off += k


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one float32 vector (a copy)."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def divergence(pre: torch.Tensor, post: torch.Tensor) -> tuple[float, float, float]:
    """(||pre - post|| / ||post|| (0 when ||post|| <= 1e-10), ||post||, ||pre||) over flat vectors."""
    post_n = float(torch.linalg.vector_norm(post))
    pre_n = float(torch.linalg.vector_norm(pre))
    delta = float(torch.linalg.vector_norm(pre - post)) / post_n if post_n > 1e-10 else 0.0
    return delta, post_n, pre_n


def weighted_average(
    counts: Sequence[int],
    params: Sequence[Sequence[torch.Tensor]],
    buffers: Sequence[Sequence[torch.Tensor]],
    gamma: float = 1.0,
) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Consensus of several replicas (the cpu backend's reduce).

    ``params[r]`` / ``buffers[r]`` are rank r's tensors in model order. Returns
    None when no rank moved (total mass 0): every rank then keeps its state.
    Accumulates in float32 and divides once.
    """
    masses = [mass(n, gamma) for n in counts]
    total = sum(masses)
    if total <= 0 or not math.isfinite(total):
        return None
    avg_p = [torch.zeros_like(t, dtype=torch.float32) for t in params[0]]
    for m, ps in zip(masses, params):
        if m == 0:
            continue
        for acc, t in zip(avg_p, ps):
            acc.add_(t.float(), alpha=m)
    avg_p = [(acc / total).to(ref.dtype) for acc, ref in zip(avg_p, params[0])]
    movers = [r for r, n in enumerate(counts) if n > 0]
    avg_b: list[torch.Tensor] = []
    if buffers and buffers[0]:
        for j, ref in enumerate(buffers[0]):
            acc = torch.zeros_like(ref, dtype=torch.float32)
            for r in movers:
                acc.add_(buffers[r][j].float())
            avg_b.append((acc / len(movers)).to(ref.dtype))
    return avg_p, avg_b


@torch.no_grad()
def adopt(model: nn.Module, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], alpha: Optional[float]) -> None:
    """Load a consensus: full overwrite, or the EASGD blend ``W + a (avg - W)`` when alpha is set.

    Buffers are always overwritten.
    """
    for p, a in zip(model.parameters(), params):
        a = a.to(p.device, p.dtype)
        if alpha is None or alpha >= 1.0:
            p.copy_(a)
        else:
            p.add_(a - p, alpha=alpha)
    for b, a in zip(float_buffers(model), buffers):
        b.copy_(a.to(b.device, b.dtype))
