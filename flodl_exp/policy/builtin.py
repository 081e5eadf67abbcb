"""The three policies of the reference's trainer (algorithms.md 3): sync, cadence and async."""
from __future__ import annotations

from typing import Optional

from flodl_exp.policy.backend import Backend
from flodl_exp.policy.base import AveragingPolicy


class SyncPolicy(AveragingPolicy):
    """Every rank steps once, then the replicas are averaged (DDP's rhythm)."""

    name = "sync"
    window_grows = False
    progressive_by_default = False
    default_anchor = 1

    def window_target(self, count: int) -> int:
        return 1

    def guard_capable(self, backend: Backend) -> bool:
        return False

    def lockstep_capable(self, backend: Backend) -> bool:
        return backend is Backend.NCCL

    def overlap_capable(self, backend: Backend) -> bool:
        """nccl_sync: the rank launches each step's all-reduce and trains its next step meanwhile (the paced sync's
        wait for the coordinator's round trip and its peer, gone); cpu_sync would send a snapshot a step."""
        return backend is Backend.NCCL

    def paces_reports(self, backend: Backend) -> bool:
        return False


class CadencePolicy(AveragingPolicy):
    """Each rank steps its ElChe count, then the replicas are averaged (the base class's defaults)."""

    name = "cadence"

    def folds_updates(self, backend: Backend, progressive: bool) -> bool:
        return backend is Backend.CPU and progressive


class AsyncPolicy(AveragingPolicy):
    """Ranks stream on; the coordinator blends in what each sends (EASGD, cpu backend only)."""

    name = "async"
    barrier_paced = False
    requires_progressive = True
    streams = True

    def unavailable_with(self, backend: Backend) -> Optional[str]:
        if backend is Backend.NCCL:
            return ("it measured within noise of nccl_cadence and its in-place write-back raced autograd on "
                    "heterogeneous GPUs; use mode=nccl_cadence or mode=cpu_async")
        return None

    def guard_capable(self, backend: Backend) -> bool:
        return backend is Backend.CPU

    def default_easgd_alpha(self, backend: Backend) -> Optional[float]:
        return 0.5 if backend is Backend.CPU else None


SYNC = SyncPolicy()
CADENCE = CadencePolicy()
ASYNC = AsyncPolicy()
BUILTIN = (SYNC, CADENCE, ASYNC)
