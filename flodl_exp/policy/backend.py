"""The backend of a mode: how replicas are averaged once the policy says when."""
from __future__ import annotations

import enum


class Backend(str, enum.Enum):
    """A ``str`` enum, so a value still equals its string where one is compared (a record, a tag)."""

    NCCL = "nccl"
    """A torch.distributed collective among the ranks (NCCL on GPUs, Gloo otherwise)."""
    CPU = "cpu"
    """Averaging through the coordinator (snapshots in, an update out)."""

    def __str__(self) -> str:
        return self.value

    @property
    def ranks_reduce(self) -> bool:
        """The ranks average among themselves (a collective); the coordinator only paces and reads acks."""
        return self is Backend.NCCL

    @property
    def coordinator_averages(self) -> bool:
        """Snapshots go to the coordinator, which averages them and sends the consensus back."""
        return self is Backend.CPU
