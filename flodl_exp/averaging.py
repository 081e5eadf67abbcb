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
from dataclasses import dataclass
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


@dataclass
class MassSums:
    """Some replicas' share of a consensus, before the one division: what a node leader sends for its ranks
    (hierarchical averaging, protocol NodePartial) and what the flat reduce computes over all ranks at once.

    ``weighted``: ``p`` = sum of ``mass(n_r, gamma) * W_r`` and ``b`` = sum of the float buffers of the ranks
    that moved; else (nobody here moved) the plain sums over every replica, read only by EASGD's final mean
    of idle replicas. Sums are float64, so the order they are taken in (node by node, or flat) changes the
    float32 consensus only where float64's own rounding lands on a float32 tie."""

    counts: list[int]
    p: list[torch.Tensor]
    b: list[torch.Tensor]
    weighted: bool

    def masses(self, gamma: float) -> list[float]:
        return [mass(n, gamma) for n in self.counts]

    @property
    def movers(self) -> int:
        return sum(1 for n in self.counts if n > 0) if self.weighted else len(self.counts)


def mass_sums(counts: Sequence[int], params: Sequence[Sequence[torch.Tensor]],
              buffers: Sequence[Sequence[torch.Tensor]], gamma: float = 1.0) -> MassSums:
    """The float64 sums of ``params[r]`` weighted by ``mass(counts[r], gamma)`` and of the movers' ``buffers[r]``
    (see :class:`MassSums`); ``params[r]`` / ``buffers[r]`` are replica r's tensors in model order."""
    masses = [mass(n, gamma) for n in counts]
    weighted = any(m > 0 for m in masses)
    sum_p = [torch.zeros(t.shape, dtype=torch.float64) for t in params[0]]
    sum_b = [torch.zeros(t.shape, dtype=torch.float64) for t in buffers[0]] if buffers and buffers[0] else []
    for r, ps in enumerate(params):
        m = masses[r] if weighted else 1.0
        if m == 0:
            continue
        for acc, t in zip(sum_p, ps):
            acc.add_(t, alpha=m)  # float32 (or bf16) into float64, in place: no copy
        if sum_b and (counts[r] > 0 or not weighted):
            for acc, t in zip(sum_b, buffers[r]):
                acc.add_(t)
    return MassSums(counts=[int(n) for n in counts], p=sum_p, b=sum_b, weighted=weighted)


def divide_sums(parts: Sequence[MassSums], gamma: float,
                idle_mean: bool = False) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The consensus of all replicas in ``parts`` (float32): the weighted parts' sums over their total mass
    (``math.fsum``: the same float whatever the grouping), buffers over the movers. None when nobody moved,
    unless ``idle_mean``: then the plain mean of every replica (EASGD's final round)."""
    live = [s for s in parts if s.weighted]
    if live:
        total = math.fsum(m for s in live for m in s.masses(gamma))
        if total <= 0 or not math.isfinite(total):
            return None
    elif idle_mean and parts:
        live = list(parts)
        total = float(sum(len(s.counts) for s in live))
    else:
        return None
    movers = sum(s.movers for s in live)
    out_p = _sum_over([s.p for s in live])
    out_b = _sum_over([s.b for s in live]) if live[0].b else []
    return ([(t / total).float() for t in out_p], [(t / movers).float() for t in out_b])


def _sum_over(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    acc = [t.clone() for t in groups[0]]
    for ts in groups[1:]:
        for a, t in zip(acc, ts):
            a.add_(t)
    return acc


def weighted_average(
    counts: Sequence[int],
    params: Sequence[Sequence[torch.Tensor]],
    buffers: Sequence[Sequence[torch.Tensor]],
    gamma: float = 1.0,
) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Consensus of several replicas (the cpu backend's flat reduce), float32.

    ``params[r]`` / ``buffers[r]`` are rank r's tensors in model order. Returns None when no rank moved (total
    mass 0): every rank then keeps its state. Accumulates in float64 and divides once (:func:`divide_sums`), so
    a hierarchical reduce (node partials, then their sum) gives the same float32 consensus.
    """
    return divide_sums([mass_sums(counts, params, buffers, gamma)], gamma)


@torch.no_grad()
def adopt_correction(model: nn.Module, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                     sent_params: Sequence[torch.Tensor], sent_buffers: Sequence[torch.Tensor],
                     alpha: Optional[float]) -> None:
    """Overlapped averaging (``mode.overlap``): ``W <- W + a (W_avg - W_sent)`` (``a`` = EASGD's alpha, 1 without
    it), parameters and float buffers alike: the consensus moves the replica by what it moved the state the rank
    sent, and what the rank trained since stays. With nothing trained since (``W == W_sent``) it is :func:`adopt`'s
    overwrite (or blend)."""
    a = 1.0 if alpha is None else min(float(alpha), 1.0)
    for t, g, s in [*zip(model.parameters(), params, sent_params), *zip(float_buffers(model), buffers, sent_buffers)]:
        delta = g.to(t.device, torch.float32) - s
        if t.dtype == torch.float32:
            t.add_(delta, alpha=a)
        else:
            t.copy_((t.float() + a * delta).to(t.dtype))


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
