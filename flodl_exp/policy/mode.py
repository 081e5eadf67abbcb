"""The training mode as one value: the policy (when replicas are averaged) and the backend (how), resolved once
from the config.

Config files and the CLI keep their strings (``mode.policy=cadence``, ``mode.backend=cpu``); code asks the
policy object (``mode.policy.barrier_paced``, ``mode.policy.window_target(count)``) and the backend
(``mode.is_nccl``) instead of comparing strings. The policies are objects from
:mod:`flodl_exp.policy.registry`, so one a user registers is a mode like the built-in ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.policy.backend import Backend
from flodl_exp.policy.base import AveragingPolicy
from flodl_exp.policy.registry import policy_named, policy_names

__all__ = ["Backend", "Mode"]


@dataclass(frozen=True)
class Mode:
    policy: AveragingPolicy
    backend: Backend

    @classmethod
    def of(cls, cfg: Any) -> Mode:
        """The mode of a run config (its ``mode`` group; validated strings)."""
        return cls.parse(cfg.mode.policy, cfg.mode.backend)

    @classmethod
    def parse(cls, policy: str, backend: str) -> Mode:
        try:
            return cls(policy_named(str(policy)), Backend(str(backend)))
        except (KeyError, ValueError):
            raise ValueError(f"mode: policy={policy!r} backend={backend!r} is not a mode: policy one of "
                             f"{', '.join(policy_names())}, backend one of "
                             f"{', '.join(b.value for b in Backend)}") from None

    @classmethod
    def from_name(cls, name: str) -> Mode:
        """The mode a preset name (``<backend>_<policy>``: ``cpu_async``) names; ValueError when none."""
        backend, _, policy = str(name).partition("_")
        return cls.parse(policy, backend)

    @property
    def name(self) -> str:
        """``<backend>_<policy>``, as the presets are named (``nccl_cadence``)."""
        return f"{self.backend.value}_{self.policy.name}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_nccl(self) -> bool:
        return self.backend is Backend.NCCL

    @property
    def is_cpu(self) -> bool:
        return self.backend is Backend.CPU

    @property
    def unavailable(self) -> Optional[str]:
        """Why this policy cannot run on this backend (nccl_async), or None."""
        return self.policy.unavailable_with(self.backend)

    # The policy's answers for this backend (the policy object owns each rule; these only bind the backend).
    @property
    def barrier_paced(self) -> bool:
        return self.policy.barrier_paced

    @property
    def progressive_by_default(self) -> bool:
        return self.policy.progressive_by_default

    @property
    def window_grows(self) -> bool:
        return self.policy.window_grows

    @property
    def streams(self) -> bool:
        return self.policy.streams

    @property
    def lockstep_capable(self) -> bool:
        return self.policy.lockstep_capable(self.backend)

    @property
    def overlap_capable(self) -> bool:
        return self.policy.overlap_capable(self.backend)

    def folds_updates(self, progressive: bool) -> bool:
        return self.policy.folds_updates(self.backend, progressive)

    @property
    def guard_capable(self) -> bool:
        return self.policy.guard_capable(self.backend)

    @property
    def default_easgd_alpha(self) -> Optional[float]:
        return self.policy.default_easgd_alpha(self.backend)

    @property
    def paces_reports(self) -> bool:
        return self.policy.paces_reports(self.backend)

    def window_target(self, count: int) -> int:
        return self.policy.window_target(count)

    def reduce_budget(self, count: int, overshoot: int) -> int:
        return self.policy.reduce_budget(count, overshoot)


def known_modes() -> tuple[str, ...]:
    """Every mode name that exists now: each registered policy on each backend it runs on (nccl first)."""
    out = []
    for backend in Backend:
        for name in policy_names():
            mode = Mode(policy_named(name), backend)
            if mode.unavailable is None:
                out.append(mode.name)
    return tuple(out)


OVERLAP = "+overlap"
"""The suffix of a mode run with ``mode.overlap=true`` where ``mode=auto`` names its candidates (``cpu_cadence+overlap``)."""


def variant_of(name: str) -> tuple[str, bool]:
    """A candidate's mode name and whether it overlaps (``cpu_async+overlap`` -> ``("cpu_async", True)``)."""
    return (name[:-len(OVERLAP)], True) if name.endswith(OVERLAP) else (name, False)


def variant_name(mode: str, overlap: bool) -> str:
    """The candidate name of ``mode`` run with or without overlap (the inverse of :func:`variant_of`)."""
    return mode + OVERLAP if overlap else mode


def configured_variant(mode_cfg: Any) -> str:
    """The candidate name a run's ``mode`` config group trains as (``cpu_cadence``, ``cpu_cadence+overlap``)."""
    return variant_name(f"{mode_cfg.backend}_{mode_cfg.policy}", bool(mode_cfg.overlap))


def with_overlap(modes: list[str] | tuple[str, ...]) -> list[str]:
    """``modes`` and, after them, each overlap-capable one run with ``mode.overlap=true``: what mode=auto weighs."""
    return [*modes, *(m + OVERLAP for m in modes if Mode.from_name(m).overlap_capable)]
