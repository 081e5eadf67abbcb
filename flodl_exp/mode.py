"""The training mode as one value: the policy (when replicas are averaged) and the backend (how), with the
predicates the rest of the code asks of them, resolved once from the config.

Config files and the CLI keep their strings (``mode.policy=cadence``, ``mode.backend=cpu``); code asks
``mode.is_nccl`` or ``mode.barrier_paced`` instead of comparing strings. The enums are ``str`` enums, so a
value still equals its string where one is compared (a record, a tag, an old test).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Policy(str, enum.Enum):
    SYNC = "sync"
    """Every rank steps once, then the replicas are averaged (DDP's rhythm)."""
    CADENCE = "cadence"
    """Each rank steps its ElChe count, then the replicas are averaged."""
    ASYNC = "async"
    """Ranks stream on; the coordinator blends in what each sends (cpu backend)."""

    def __str__(self) -> str:
        return self.value


class Backend(str, enum.Enum):
    NCCL = "nccl"
    """A torch.distributed collective among the ranks (NCCL on GPUs, Gloo otherwise)."""
    CPU = "cpu"
    """Averaging through the coordinator (snapshots in, an update out)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Mode:
    policy: Policy
    backend: Backend

    @classmethod
    def of(cls, cfg: Any) -> Mode:
        """The mode of a run config (its ``mode`` group; validated strings)."""
        return cls.parse(cfg.mode.policy, cfg.mode.backend)

    @classmethod
    def parse(cls, policy: str, backend: str) -> Mode:
        try:
            return cls(Policy(str(policy)), Backend(str(backend)))
        except ValueError:
            raise ValueError(f"mode: policy={policy!r} backend={backend!r} is not a mode: policy one of "
                             f"{', '.join(p.value for p in Policy)}, backend one of "
                             f"{', '.join(b.value for b in Backend)}") from None

    @classmethod
    def from_name(cls, name: str) -> Mode:
        """The mode a preset name (``<backend>_<policy>``: ``cpu_async``) names; ValueError when none."""
        backend, _, policy = str(name).partition("_")
        return cls.parse(policy, backend)

    @property
    def name(self) -> str:
        """``<backend>_<policy>``, as the presets are named (``nccl_cadence``)."""
        return f"{self.backend.value}_{self.policy.value}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_nccl(self) -> bool:
        return self.backend is Backend.NCCL

    @property
    def is_cpu(self) -> bool:
        return self.backend is Backend.CPU

    @property
    def is_sync(self) -> bool:
        return self.policy is Policy.SYNC

    @property
    def is_cadence(self) -> bool:
        return self.policy is Policy.CADENCE

    @property
    def is_async(self) -> bool:
        return self.policy is Policy.ASYNC

    @property
    def barrier_paced(self) -> bool:
        """Epochs advance in lockstep: a rank does not start the next epoch's plan before the others (sync,
        cadence); async streams across the boundary."""
        return self.policy is not Policy.ASYNC

    @property
    def progressive_by_default(self) -> bool:
        """Chunks from a pool unless ``mode.progressive_dispatch`` says otherwise (cadence, async)."""
        return self.policy is not Policy.SYNC

    @property
    def window_grows(self) -> bool:
        """ElChe sizes windows of several steps (not sync's one)."""
        return self.policy is not Policy.SYNC

    @property
    def lockstep_capable(self) -> bool:
        """nccl_sync: every reduce is one step of every rank, so ranks can all-reduce after each step on their own
        (``mode.lockstep_ahead``) instead of waiting for the coordinator's ``sync_now``."""
        return self.backend is Backend.NCCL and self.policy is Policy.SYNC

    def folds_updates(self, progressive: bool) -> bool:
        """cpu cadence, progressive: each rank's next chunk rides in its Update (algorithms.md 5.6)."""
        return self.backend is Backend.CPU and self.policy is Policy.CADENCE and progressive

    @property
    def guard_capable(self) -> bool:
        """The guard's verdict may reshape the window: cpu cadence and async, nccl cadence."""
        return self.policy is Policy.CADENCE or (self.backend is Backend.CPU and self.policy is Policy.ASYNC)

    @property
    def default_easgd_alpha(self) -> float | None:
        """cpu_async blends (EASGD, alpha 0.5) unless ``mode.easgd_alpha`` says otherwise; the others overwrite."""
        return 0.5 if (self.backend is Backend.CPU and self.policy is Policy.ASYNC) else None
