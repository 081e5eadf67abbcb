"""Hierarchical cpu averaging's arithmetic (``cluster.node_reduce``): a node's share of a reduce, and what its
leader does with the consensus. Pure tensor code, no I/O: the rank-side relay (rank/node_relay.py) and the
coordinator's averager (torch_averager.py) call it.

A node leader sums its ranks' snapshots into one :class:`~.protocol.messages.NodePartial` (float64 sums,
:func:`~.averaging.mass_sums`); the coordinator adds the nodes' partials and divides once
(:func:`~.averaging.divide_sums`), so the consensus is the flat reduce's to float32's rounding, with the same
ElChe masses, EASGD alpha and outer step. The guard's per-replica drift needs the consensus, which only the
coordinator has, and each replica, which only the leader has: the leader measures it after the update came
(:func:`node_drift`) and answers :class:`~.protocol.messages.NodeDrift`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from flodl_exp.averaging import MassSums, divergence, mass_sums
from flodl_exp.protocol.messages import NodePartial, NodeUpdate, Snapshot, Update


def _split(tensors: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    while f"{prefix}{len(out)}" in tensors:
        out.append(tensors[f"{prefix}{len(out)}"])
    return out


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in ts]) if ts else torch.zeros(0)


def node_partial(version: int, ranks: Sequence[int], snapshots: Sequence[Snapshot], gamma: float) -> NodePartial:
    """A node's answer to ``RequestParams`` ``version``: ``snapshots[i]`` is rank ``ranks[i]``'s (ascending)."""
    if not snapshots or len(ranks) != len(snapshots):
        raise ValueError("a node partial needs one snapshot per rank, at least one")
    params = [_split(s.tensors, "p") for s in snapshots]
    bufs = [_split(s.tensors, "b") for s in snapshots]
    sums = mass_sums([s.n for s in snapshots], params, bufs, gamma)
    pre = [float(torch.linalg.vector_norm(_flat(ps))) for ps in params]
    tensors = {f"p{i}": t for i, t in enumerate(sums.p)}
    tensors.update({f"b{j}": t for j, t in enumerate(sums.b)})
    held = [s.held_ms for s in snapshots if s.held_ms is not None]
    return NodePartial(version=version, ranks=list(ranks), ns=[int(s.n) for s in snapshots], pre=pre,
                       weighted=sums.weighted, tensors=tensors, held_ms=max(held) if held else None)


def partial_sums(p: NodePartial) -> MassSums:
    """The coordinator's view of a partial (what :func:`~.averaging.divide_sums` adds up)."""
    return MassSums(counts=list(p.ns), p=[t.double() for t in _split(p.tensors, "p")],
                    b=[t.double() for t in _split(p.tensors, "b")], weighted=p.weighted)


def leader_tensors(consensus: dict[str, torch.Tensor],
                   before_outer: Sequence[torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """A NodeUpdate's tensors: the update's, plus the average's parameters before the outer step as ``c<i>`` when
    one stepped (the leaders measure drift against them)."""
    if before_outer is None:
        return consensus
    return {**consensus, **{f"c{i}": t for i, t in enumerate(before_outer)}}


def member_update(m: NodeUpdate, rank: int) -> Update:
    """The ``Update`` the leader hands member ``rank`` (its own steps, the shared tensors without ``c<i>``)."""
    i = list(m.ranks).index(rank)
    if m.skip:
        return Update(n=m.ns[i], skip=True)
    return Update(n=m.ns[i], alpha=m.alpha, tensors={k: t for k, t in m.tensors.items() if not k.startswith("c")})


def node_drift(snapshots: Sequence[Snapshot], m: NodeUpdate) -> list[float]:
    """Each snapshot's drift ``||W - avg|| / ||avg||`` from the average before the outer step, as the flat reduce
    measures it (0.0 each when nobody moved)."""
    if m.skip:
        return [0.0] * len(snapshots)
    ref = _split(m.tensors, "c") or _split(m.tensors, "p")
    avg = _flat(ref)
    return [divergence(_flat(_split(s.tensors, "p")), avg)[0] for s in snapshots]
