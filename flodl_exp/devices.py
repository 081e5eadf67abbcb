"""One collective backend for the whole cohort, chosen from the ranks' hellos (pure: no I/O, no torch).

Each rank says in its hello which device it trains on (``device``) and, for a CUDA
device, the device's UUID (``device_uuid``: the same string for one physical GPU or MIG
slice whatever ``CUDA_VISIBLE_DEVICES`` renumbered it to). Deciding per rank went wrong
twice: a CPU rank picked Gloo while its GPU peers picked NCCL on the same store (a hang
on mixed hardware), and two ranks on one GPU both picked NCCL, which refuses duplicate
devices, and the error only surfaced as a "dead peer" at the first sync.

The rule, with ``cluster.collective`` (``auto`` | ``nccl`` | ``gloo``):

* ``gloo``: Gloo, whatever the devices (CUDA tensors are staged through the host).
* ``auto``: NCCL when every rank has a CUDA device of its own that is not a MIG slice; otherwise
  Gloo, with the reason logged once (ranks on CPU, ranks sharing a GPU, or ranks on MIG slices: each
  slice has a UUID of its own, but NCCL does not run on MIG).
* ``nccl``: NCCL, or the run is refused with one line naming the ranks that prevent it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional

from flodl_exp.config import COLLECTIVES
from flodl_exp.protocol.hello import Hello


@dataclass(frozen=True)
class RankDevice:
    """What a rank trains on, as its hello said it."""

    rank: int
    host: str
    device: str
    """``cpu`` or ``cuda:<i>`` (the index inside the rank's own CUDA_VISIBLE_DEVICES)."""
    uuid: Optional[str] = None
    """The device's UUID; a MIG slice's starts with ``MIG-`` (rank/worker.device_uuid marks it)."""
    score: Optional[float] = None
    """The spec prior's device score (CUDA: architecture generation x 10 + VRAM GiB); None when not reported."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def is_mig(self) -> bool:
        """A MIG slice: NCCL does not run on one."""
        return self.is_cuda and bool(self.uuid) and str(self.uuid).upper().startswith("MIG-")

    @property
    def key(self) -> tuple[str, str]:
        """One physical device: its UUID, else (no UUID reported) host and device name."""
        return ("uuid", self.uuid) if self.uuid else (self.host, self.device)

    @classmethod
    def of(cls, rank: int, hello: Hello) -> RankDevice:
        return cls(rank=rank, host=hello.host or "unknown", device=hello.device or "cpu",
                   uuid=hello.device_uuid or None, score=hello.device_score)


@dataclass(frozen=True)
class CollectiveChoice:
    backend: str
    """``nccl`` or ``gloo``."""
    reason: str
    """One line for the log: why this backend."""


class CollectiveRefused(ValueError):
    """``cluster.collective=nccl`` with devices NCCL cannot use (the run is refused, one line)."""


def shared_devices(devices: list[RankDevice]) -> list[list[int]]:
    """Groups of ranks (>= 2) that train on one physical CUDA device."""
    by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for d in devices:
        if d.is_cuda:
            by_key[d.key].append(d.rank)
    return [sorted(rs) for rs in by_key.values() if len(rs) > 1]


def choose_collective(devices: list[RankDevice], requested: str = "auto") -> CollectiveChoice:
    """The cohort's backend (see the module doc); raises :class:`CollectiveRefused` for a forced NCCL it cannot run."""
    if requested not in COLLECTIVES:
        raise ValueError(f"cluster.collective={requested!r} is not allowed: one of {', '.join(COLLECTIVES)}")
    if requested == "gloo":
        return CollectiveChoice("gloo", "cluster.collective=gloo")
    on_cpu = sorted(d.rank for d in devices if not d.is_cuda)
    shared = shared_devices(devices)
    on_mig = sorted(d.rank for d in devices if d.is_mig)
    if not on_cpu and not shared and not on_mig:
        return CollectiveChoice("nccl", "every rank has a CUDA device of its own")
    if on_cpu and len(on_cpu) == len(devices):
        why = "no rank has a CUDA device"
    elif on_cpu:
        why = f"ranks {on_cpu} train on CPU (a mixed CPU/GPU cohort)"
    elif on_mig:
        why = f"ranks {on_mig} train on MIG slices (NCCL does not run on MIG)"
    else:
        why = "; ".join(f"ranks {rs} share one GPU" for rs in shared) + " (NCCL needs one device per rank)"
    if requested == "nccl":
        raise CollectiveRefused(
            f"cluster.collective=nccl is not possible: {why}; give each rank a whole GPU of its own "
            "(fewer ranks_per_node, more GPUs, no MIG) or use cluster.collective=auto to average through Gloo")
    return CollectiveChoice("gloo", f"Gloo for the collective: {why}")


def device_score(major: int, total_memory_bytes: int) -> float:
    """The spec prior's score of a CUDA device (algorithms.md 2.3): architecture generation (the compute
    capability's major) x 10 + VRAM in GiB. Higher is faster, as a guess before any measurement."""
    return float(major) * 10.0 + total_memory_bytes / 2**30


def spec_prior_anchor(devices: Mapping[int, RankDevice], world_size: int) -> Optional[int]:
    """The cold-start anchor rank the spec prior picks: the lowest device score (the slowest guess; ties go
    to the lowest rank). None unless every rank is on CUDA and reported a score (a CPU rank, a mixed cohort
    or a failed query: no prior, ElChe measures from equal counts)."""
    if len(devices) != world_size or world_size < 2:
        return None
    if any(not d.is_cuda or d.score is None for d in devices.values()):
        return None
    return min(devices, key=lambda r: (devices[r].score, r))


def arch_runs_on(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build whose ``torch.cuda.get_arch_list()`` is ``arch_list`` has kernels for a device of
    compute ``capability`` (major, minor). A cubin ``sm_XY`` runs on the same major at minor >= Y (``sm_XYa``, an
    architecture-specific cubin, on X.Y only); PTX ``compute_XY`` is compiled by the driver for any capability
    >= X.Y. A list with no CUDA entries (a ROCm build, or none reported) cannot be judged: True."""
    major, minor = int(capability[0]), int(capability[1])
    judged = False
    for entry in arch_list:
        kind, _, num = str(entry).partition("_")
        digits = "".join(ch for ch in num if ch.isdigit())
        if kind not in ("sm", "compute") or len(digits) < 2:
            continue
        judged = True
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        specific = num[len(digits):] != ""  # sm_90a, sm_100a: that exact architecture only
        if kind == "compute" and (major, minor) >= (a_major, a_minor):
            return True
        if kind == "sm" and major == a_major and (minor == a_minor if specific else minor >= a_minor):
            return True
    return not judged
