"""Averaging backends, rank side.

* :class:`CollectiveBackend` (``backend=nccl``): weighted in-place all_reduce
  over a torch.distributed process group formed through the coordinator's
  TCPStore; NCCL when the rank has a CUDA device, Gloo otherwise.
* :class:`CoordinatorBackend` (``backend=cpu``): the rank ships a snapshot to
  the coordinator and adopts the consensus it sends back (full overwrite, or
  the EASGD blend on cpu_async).
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from ..averaging import adopt, divergence, flat_params, float_buffers, mass
from ..protocol import Snapshot, Update

log = logging.getLogger(__name__)


class CollectiveBackend:
    """Weighted all_reduce: each rank scales by its own mass ``n^gamma``, sums, divides by the total.

    The scalar masses are all-reduced first; a zero total (whole cohort idle)
    skips the parameter all_reduce on every rank alike, so the skip is
    collective-consistent. Float buffers are averaged equally among movers.
    """

    def __init__(self, *, host: str, store_port: int, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, generation: int = 0) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store = store
        self.timeout = timedelta(seconds=timeout_s)
        self._init(generation, rank, world_size)
        if rank == 0:
            log.info("collective backend: %s (%s)", self.backend,
                     "every rank has a CUDA device" if self.backend == "nccl" else "no CUDA device: Gloo on CPU")

    def _init(self, generation: int, rank: int, world_size: int, session: str = "") -> None:
        pstore = self.dist.PrefixStore(f"gen{generation}-{session}" if session else f"gen{generation}", self.store)
        self.dist.init_process_group(self.backend, store=pstore, rank=rank, world_size=world_size, timeout=self.timeout)
        self.generation, self.rank, self.world_size = generation, rank, world_size

    def rebuild(self, generation: int, rank: int, world_size: int, session: str = "") -> None:
        """Elastic regroup: drop the old group, form a new one on a fresh prefix of the same store."""
        self.close()
        self._init(generation, rank, world_size, session)

    def sync(self, model: nn.Module, n: int, gamma: float, with_divergence: bool = True) -> tuple[Optional[float], Optional[float], Optional[float]]:
        dist = self.dist
        params = [p for p in model.parameters()]
        bufs = float_buffers(model)
        m = mass(n, gamma)
        # [mass, mover] in one small collective.
        head = torch.tensor([m, 1.0 if n > 0 else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(head)
        total, movers = float(head[0]), float(head[1])
        if total <= 0:
            return (0.0, None, None) if with_divergence else (None, None, None)
        with torch.no_grad():
            pre = flat_params(model) if with_divergence else None
            flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
            flat.mul_(m)
            if bufs:
                bflat = torch.cat([b.reshape(-1).to(torch.float32) for b in bufs]) * (1.0 if n > 0 else 0.0)
                flat = torch.cat([flat, bflat])
            dist.all_reduce(flat)
            n_params = sum(p.numel() for p in params)
            pflat = flat[:n_params] / total
            off = 0
            for p in params:
                k = p.numel()
                p.copy_(pflat[off:off + k].view_as(p).to(p.dtype))
                off += k
            if bufs and movers > 0:
                bflat = flat[n_params:] / movers
                off = 0
                for b in bufs:
                    k = b.numel()
                    b.copy_(bflat[off:off + k].view_as(b).to(b.dtype))
                    off += k
            if pre is not None:
                return divergence(pre, flat_params(model))
        return None, None, None

    def close(self) -> None:
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception as e:  # pragma: no cover - teardown best effort
            log.debug("destroy_process_group: %s", e)


class CoordinatorBackend:
    """Snapshots up, consensus down (the cpu backend)."""

    def __init__(self, bf16_wire: bool = False) -> None:
        self.bf16_wire = bf16_wire

    def snapshot(self, model: nn.Module, n: int) -> Snapshot:
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                t = p.detach().to("cpu")
                tensors[f"p{i}"] = t.to(torch.bfloat16) if self.bf16_wire else t.float()
            for j, b in enumerate(float_buffers(model)):
                tensors[f"b{j}"] = b.detach().to("cpu").float()
        return Snapshot(n=int(n), tensors=tensors)

    @staticmethod
    def adopt_update(model: nn.Module, msg: Update, alpha: Optional[float]) -> None:
        n_p = sum(1 for _ in model.parameters())
        n_b = len(float_buffers(model))
        params = [msg.tensors[f"p{i}"].float() for i in range(n_p)]
        bufs = [msg.tensors[f"b{j}"] for j in range(n_b)]
        adopt(model, params, bufs, alpha)
