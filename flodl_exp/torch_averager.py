"""The shell's :class:`~.averager.Averager`: the cpu backend's consensus computed with torch, and the outer
optimizer stepped on it, for the coordinator and the simulator.

Torch is imported on first use: building one costs nothing, and the nccl backend's coordinator builds none.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from flodl_exp.config import OuterSpec
from flodl_exp.core.averager import Consensus
from flodl_exp.outer_step import OuterStep
from flodl_exp.protocol.messages import NodePartial, Snapshot

if TYPE_CHECKING:
    from flodl_exp.outer import OuterOptimizer


class TorchAverager:
    def __init__(self, outer: Optional[OuterSpec] = None) -> None:
        self.outer_spec = outer or OuterSpec()
        self._outer: Optional[OuterOptimizer] = None

    @property
    def outer(self) -> OuterOptimizer:
        """The outer optimizer, run here once per window (nccl: replicated on the ranks). Made on first use: it
        holds torch tensors."""
        if self._outer is None:
            from flodl_exp.outer import make_outer

            self._outer = make_outer(self.outer_spec)
        return self._outer

    def average(self, snapshots: Sequence[Snapshot], *, gamma: float, idle_mean: bool,
                partials: Sequence[NodePartial] = ()) -> Consensus:
        import torch

        from flodl_exp.averaging import MassSums, divergence, divide_sums, mass_sums
        from flodl_exp.node_average import leader_tensors, partial_sums

        first = snapshots[0].tensors if snapshots else partials[0].tensors
        n_p = sum(1 for k in first if k.startswith("p"))
        n_b = sum(1 for k in first if k.startswith("b"))
        params = [[s.tensors[f"p{i}"].float() for i in range(n_p)] for s in snapshots]
        bufs = [[s.tensors[f"b{j}"] for j in range(n_b)] for s in snapshots]
        parts: list[MassSums] = [mass_sums([s.n for s in snapshots], params, bufs, gamma)] if snapshots else []
        parts += [partial_sums(p) for p in partials]
        moved = any(s.weighted for s in parts)
        res = divide_sums(parts, gamma, idle_mean=idle_mean)
        if res is None:
            return Consensus(tensors=None)
        avg_p, avg_b = res
        flat_avg = torch.cat([t.reshape(-1).float() for t in avg_p])
        divs = [divergence(torch.cat([t.reshape(-1) for t in ps]), flat_avg) for ps in params]
        # The outer step comes after the divergence read-out, on the parameter frame only; a round with
        # zero mass (the EASGD final mean of idle replicas) passes through unstepped.
        outer: Optional[OuterStep] = None
        before = avg_p
        if moved:
            avg_p, outer = self.outer.step(avg_p)
        tensors = {f"p{i}": t for i, t in enumerate(avg_p)}
        tensors.update({f"b{j}": t for j, t in enumerate(avg_b)})
        post = float(torch.linalg.vector_norm(flat_avg))
        lead = leader_tensors(tensors, before if outer is not None else None) if partials else None
        return Consensus(tensors=tensors, drift=[(d, pre) for d, _, pre in divs], post=post, outer=outer,
                         leader_tensors=lead)

    def outer_state(self) -> dict[str, Any]:
        return self.outer.state_dict()

    def restore_outer(self, state: dict[str, Any]) -> float:
        self.outer.load_state_dict(state)
        return self.outer.momentum_norm()
