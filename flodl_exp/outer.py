"""Outer optimizers (algorithms.md 11.1): a step applied to the consensus between the reduce and the
broadcast, over parameters only (buffers pass through). Pure tensor code, no I/O.

* ``avg`` (default): identity, ``new = consensus``; no state, nothing in the bundle.
* ``slowmo`` (SlowMo, heavy ball): ``v = mu*v + g``; ``new = prev - lr*v``.
* ``diloco`` (DiLoCo, Nesterov): ``v = mu*v + g``; ``new = prev - lr*(mu*v + g)``; the inner
  optimizer's state is reset after each adoption (:attr:`OuterSpec.resets_inner`).

``g = prev - consensus`` is the outer gradient: how far the window's averaged training moved the
global model, with ``prev`` the global adopted at the end of the previous window. The first window
has no ``prev``: the step is a no-op that seeds the momentum at zero. A change in the parameter
count or shapes restarts the momentum the same way.

The same class runs once at the coordinator (cpu backend, on each window's parameter frame) or
replicated on every rank after the all-reduce (nccl backend): identical inputs give identical
results, so no extra collective is needed (except after a regroup: a collective that failed on some
ranks and not others can leave the survivors' states apart, so the rank re-syncs it from the group's
rank 0). Arithmetic is float32 whatever the parameters' dtype. The state is one flat buffer updated in
place: on a GPU it is allocated once, up front, and a step allocates no parameter-sized tensor.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch

from flodl_exp.averaging import pack_into
from flodl_exp.config import OUTER_DEFAULTS as DEFAULTS  # noqa: F401  (the spec lives with the config: the launcher needs no torch)
from flodl_exp.config import OUTERS as OUTER_KINDS  # noqa: F401
from flodl_exp.config import OuterSpec
from flodl_exp.outer_step import OuterStep

SIDECAR_FORMAT = 1

log = logging.getLogger("flodl_exp.outer")


class OuterOptimizer:
    """The outer optimizer's state: ``prev`` and the momentum ``v``, float32, one tensor per parameter.

    Both live in one flat float32 buffer (``[prev | v | seeded]``), allocated once (:meth:`allocate`, which
    the nccl rank calls at start-up, before its data plane sizes the device pool) and updated in place: a
    step allocates no parameter-sized tensor beyond its scratch (its own, kept, or the caller's
    ``workspace``). ``prev`` and ``momentum`` are views of it (None until the first window seeded them)."""

    def __init__(self, spec: OuterSpec) -> None:
        self.spec = spec
        self.prev: Optional[list[torch.Tensor]] = None
        self.momentum: Optional[list[torch.Tensor]] = None
        self._state: Optional[torch.Tensor] = None
        """``[prev (n) | momentum (n) | seeded flag (1)]``, float32, on the parameters' device."""
        self._shapes: tuple[tuple[int, ...], ...] = ()
        self._scratch: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        """Elements of one parameter-sized vector of the state (0 before :meth:`allocate`)."""
        return sum(math.prod(s) for s in self._shapes)

    def allocate(self, params: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> None:
        """Create the state's storage for parameters shaped as ``params`` (on their device unless ``device``), unseeded;
        kept when it fits already. ``avg`` keeps no state."""
        if not self.spec.stateful:
            return
        shapes = tuple(tuple(p.shape) for p in params)
        dev = device if device is not None else (params[0].device if params else torch.device("cpu"))
        if self._state is not None and self._shapes == shapes and self._state.device == dev:
            return
        self.prev = self.momentum = None
        self._state = self._scratch = None  # the old storage goes before the new one comes
        self._shapes = shapes
        self._state = torch.zeros(2 * self.numel + 1, dtype=torch.float32, device=dev)

    @property
    def state_buffer(self) -> Optional[torch.Tensor]:
        """The whole state as one tensor (what a regroup broadcasts so the survivors hold the same); call
        :meth:`state_changed` after writing into it."""
        return self._state

    def state_changed(self) -> None:
        """The state buffer was overwritten (a broadcast): take its seeded flag (one host read)."""
        if self._state is None:
            return
        seeded = bool(self._state[-1].item())
        self.prev, self.momentum = (self._views(0), self._views(self.numel)) if seeded else (None, None)

    def forget(self) -> None:
        """Drop the state (its storage kept): the next window seeds it again, as the first one does."""
        if self._state is not None:
            self._state[-1] = 0.0
        self.prev = self.momentum = None

    def _views(self, base: int) -> list[torch.Tensor]:
        assert self._state is not None
        out, off = [], base
        for s in self._shapes:
            k = math.prod(s)
            out.append(self._state[off:off + k].view(s))
            off += k
        return out

    def _work(self, workspace: Optional[torch.Tensor]) -> torch.Tensor:
        """A float32 scratch of ``numel`` on the state's device: the caller's ``workspace`` when it fits, else ours (kept)."""
        assert self._state is not None
        n, dev = self.numel, self._state.device
        if workspace is not None and workspace.dtype == torch.float32 and workspace.device == dev and workspace.numel() >= n:
            return workspace[:n]
        if self._scratch is None:
            self._scratch = torch.empty(n, dtype=torch.float32, device=dev)
        return self._scratch

    @torch.no_grad()
    def _advance(self, consensus: Sequence[torch.Tensor], workspace: Optional[torch.Tensor]) -> OuterStep:
        """Step the state for this window's ``consensus``, in place: ``prev`` becomes the new global."""
        shapes = tuple(tuple(t.shape) for t in consensus)
        if self._state is None or shapes != self._shapes:  # first use, or the model changed: restart
            self.allocate(consensus, consensus[0].device if consensus else None)
        assert self._state is not None
        n = self.numel
        prev, mom = self._state[:n], self._state[n:2 * n]
        if self.prev is None:  # the first window: seed prev = consensus, v = 0, adopt the consensus
            pack_into(consensus, prev)
            mom.zero_()
            self._state[-1] = 1.0
            self.prev, self.momentum = self._views(0), self._views(n)
            return OuterStep(0.0, 0.0, seeded=True)
        lr, mu = self.spec.lr, self.spec.mu
        g = self._work(workspace)
        pack_into(consensus, g)
        g.neg_().add_(prev)  # g = prev - consensus
        mom.mul_(mu).add_(g)
        direction = mom if self.spec.kind == "slowmo" else g.add_(mom, alpha=mu)
        moved = torch.linalg.vector_norm(direction) * lr  # ||new - prev|| = lr ||direction||
        prev.sub_(direction, alpha=lr)
        step_norm, momentum_norm = torch.stack([moved, torch.linalg.vector_norm(mom)]).tolist()  # one host read
        return OuterStep(step_norm, momentum_norm, seeded=False)

    @torch.no_grad()
    def step(self, consensus: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[OuterStep]]:
        """The global to adopt for this window's ``consensus`` (parameters, in model order), in the
        consensus's dtypes and devices: new tensors, the caller's to keep. ``avg`` returns the consensus
        itself and no step record."""
        if not self.spec.stateful:
            return list(consensus), None
        rec = self._advance(consensus, None)
        assert self.prev is not None
        return [p.to(device=c.device, dtype=c.dtype, copy=True) for p, c in zip(self.prev, consensus)], rec

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], workspace: Optional[torch.Tensor] = None) -> Optional[OuterStep]:
        """The nccl rank's step: ``params`` hold the window's consensus and take the new global, in place.
        ``workspace``: a free float32 buffer of at least the parameter count on their device (the sync's
        all-reduce buffer), used as the step's scratch. None for ``avg``."""
        if not self.spec.stateful:
            return None
        rec = self._advance([p.detach() for p in params], workspace)
        if not rec.seeded:
            assert self.prev is not None
            for p, v in zip(params, self.prev):
                p.copy_(v)
        return rec

    def momentum_norm(self) -> float:
        if self._state is None or self.prev is None:
            return 0.0
        n = self.numel
        return float(torch.linalg.vector_norm(self._state[n:2 * n]))

    # -- the bundle sidecar ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sidecar's content: ``momentum`` and ``prev``, one CPU tensor per parameter (copies), positional."""
        return {
            "format": SIDECAR_FORMAT,
            "kind": self.spec.kind,
            "lr": self.spec.lr,
            "mu": self.spec.mu,
            "momentum": [t.detach().to("cpu", copy=True) for t in self.momentum or []],
            "prev": [t.detach().to("cpu", copy=True) for t in self.prev or []],
        }

    def load_state_dict(self, state: dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore a sidecar (the knobs may differ from the saved ones: the run's config wins), into the
        state's storage (allocated for the sidecar's shapes unless it fits)."""
        mom = list(state.get("momentum") or [])
        prev = list(state.get("prev") or [])
        if len(mom) != len(prev):
            raise ValueError(f"outer sidecar: {len(mom)} momentum tensors but {len(prev)} prev tensors")
        if not mom:
            self.prev = self.momentum = None
            return
        dev = device if device is not None else (self._state.device if self._state is not None else torch.device("cpu"))
        self.allocate(prev, dev)
        assert self._state is not None
        n = self.numel
        with torch.no_grad():
            pack_into(prev, self._state[:n])
            pack_into(mom, self._state[n:2 * n])
            self._state[-1] = 1.0
        self.prev, self.momentum = self._views(0), self._views(n)


class UserOuterProtocol(Protocol):
    """What an outer optimizer of your own implements (``outer._target_=my_module.MyOuter``, built with ``outer.args``
    as keyword arguments; see docs/concepts/outer.md). Only :meth:`step` is required: each window it gets the
    consensus (the window's average, float32 CPU or device tensors, one per parameter, in model order) and returns
    the global to adopt (same count and shapes). ``state_dict()`` / ``load_state_dict(state)`` (tensors and plain
    values) let bundles keep its state; ``reset()`` is called when its state must restart (a regroup that could not
    agree on it); ``momentum_norm() -> float`` is logged; a class attribute ``resets_inner = True`` clears the ranks'
    inner optimizer state after each adoption, as DiLoCo does."""

    def step(self, consensus: list[torch.Tensor]) -> Sequence[torch.Tensor]: ...


def _user_class(target: str) -> Any:
    from hydra.utils import get_class  # as for any _target_

    return get_class(target)


def resets_inner(spec: OuterSpec) -> bool:
    """Whether adoption clears the inner optimizer's state: DiLoCo, or a user class saying so (``resets_inner``)."""
    if spec.target is None:
        return spec.resets_inner
    return bool(getattr(_user_class(spec.target), "resets_inner", False))


class UserOuter(OuterOptimizer):
    """The user's outer optimizer behind OuterOptimizer's interface (the coordinator's averager and the nccl rank
    call it as the built-ins). It has no flat state buffer to re-broadcast after a regroup (nccl), and a collective
    that failed on some ranks only can leave its states apart: every member resets it at a regroup instead
    (rank/control.py ``_resync_outer``), as the built-ins' momentum restarts when their re-sync fails."""

    def __init__(self, spec: OuterSpec) -> None:
        super().__init__(spec)
        assert spec.target is not None
        self.inner = _user_class(spec.target)(**dict(spec.args))
        if not callable(getattr(self.inner, "step", None)):
            raise TypeError(f"outer._target_={spec.target!r}: the object has no step(consensus) method")
        self._last: Optional[list[torch.Tensor]] = None
        """The global adopted last (for the step's norm, ``||new - prev||`` as the built-ins report it)."""

    def allocate(self, params: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> None:
        return None

    @property
    def state_buffer(self) -> Optional[torch.Tensor]:
        return None

    def state_changed(self) -> None:
        return None

    def forget(self) -> None:
        self._last = None
        fn = getattr(self.inner, "reset", None)
        if callable(fn):
            fn()

    @torch.no_grad()
    def step(self, consensus: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[OuterStep]]:
        c32 = [t.detach().float() for t in consensus]
        new = list(self.inner.step(c32))
        if len(new) != len(c32) or any(tuple(n.shape) != tuple(c.shape) for n, c in zip(new, c32)):
            raise ValueError(f"outer._target_={self.spec.target!r}: step() returned {len(new)} tensors shaped "
                             f"{[tuple(n.shape) for n in new][:3]}..., expected {len(c32)} shaped as the parameters")
        last = self._last
        seeded = last is None or [tuple(t.shape) for t in last] != [tuple(c.shape) for c in c32]
        moved = 0.0 if seeded else math.sqrt(sum(float(torch.sum((n.float() - q) ** 2)) for n, q in zip(new, last or [])))
        self._last = [n.detach().float().clone() for n in new]
        out = [n.to(device=c.device, dtype=c.dtype, copy=True) for n, c in zip(new, consensus)]
        return out, OuterStep(moved, self.momentum_norm(), seeded=seeded)

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], workspace: Optional[torch.Tensor] = None) -> Optional[OuterStep]:
        new, rec = self.step([p.detach() for p in params])
        for p, v in zip(params, new):
            p.copy_(v)
        return rec

    def momentum_norm(self) -> float:
        fn = getattr(self.inner, "momentum_norm", None)
        return float(fn()) if callable(fn) else 0.0

    def state_dict(self) -> dict[str, Any]:
        fn = getattr(self.inner, "state_dict", None)
        return {"format": SIDECAR_FORMAT, "kind": "user", "target": self.spec.target,
                "state": dict(fn()) if callable(fn) else {}}

    def load_state_dict(self, state: dict[str, Any], device: Optional[torch.device] = None) -> None:
        """The sidecar's state into the user's class, when it was saved by the same class; another outer optimizer's
        sidecar (a built-in's, another class's) is not handed to it: its state starts fresh, with a warning."""
        if state.get("kind") != "user" or state.get("target") != self.spec.target:
            saved = state.get("target") or state.get("kind")
            log.warning("outer._target_=%s: the bundle's outer state was saved by %r: not loaded, the state starts "
                        "fresh", self.spec.target, saved)
            return
        fn = getattr(self.inner, "load_state_dict", None)
        if callable(fn):
            fn(dict(state.get("state") or {}))


def make_outer(spec: OuterSpec) -> OuterOptimizer:
    """The run's outer optimizer: the user's class (``outer._target_``) or the built-in ``outer.kind``."""
    return UserOuter(spec) if spec.target is not None else OuterOptimizer(spec)
