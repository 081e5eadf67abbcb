"""Per-sample row layout of a dataset's batches: what the caches store and how batches are rebuilt.

A batch from ``fetch_batch`` is a tensor, a tuple/list of tensors or a dict of
tensors (nested), each with the sample on dim 0. The caches keep one fixed
size *row* per sample and leaf; ``Layout`` remembers the structure, dtypes and
row shapes so rows gathered from any tier rebuild exactly the batch the
dataset would have returned. Data sets whose rows change shape from batch to
batch (padding to the batch maximum) or whose leaves are not tensors cannot
be retained; ``Layout.of`` says so and the pipeline falls back to the plain
fetch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


def copy_is_async(src: torch.Tensor, dst_device: Union[torch.device, str]) -> bool:
    """Whether ``src.to(dst_device)`` may be ``non_blocking``: only a pinned host tensor going to a CUDA device.

    Any other non-blocking copy is wrong or pointless: device-to-host copies
    land in memory the host reads before the copy has run (garbage), and a
    pageable host source is staged synchronously anyway. Every ``.to`` of the
    data plane goes through this rule.
    """
    dst = torch.device(dst_device)
    return dst.type == "cuda" and src.device.type == "cpu" and bool(src.is_pinned())


def to_device(t: torch.Tensor, device: Union[torch.device, str]) -> torch.Tensor:
    """``t.to(device)``, non-blocking exactly when ``copy_is_async`` allows it."""
    return t.to(device, non_blocking=copy_is_async(t, device))


Spec = Union[None, tuple, dict]
"""None = a leaf; ("tuple"|"list", [specs]); ("dict", [(key, spec)])."""


def flatten(batch: Any) -> tuple[list[Any], Any]:
    """Leaves in a fixed order plus the structure to rebuild them."""
    if isinstance(batch, (tuple, list)):
        leaves: list[Any] = []
        specs = []
        for b in batch:
            lv, sp = flatten(b)
            leaves += lv
            specs.append(sp)
        return leaves, ("tuple" if isinstance(batch, tuple) else "list", specs)
    if isinstance(batch, dict):
        leaves = []
        items = []
        for k, v in batch.items():
            lv, sp = flatten(v)
            leaves += lv
            items.append((k, sp))
        return leaves, ("dict", items)
    return [batch], None


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)

    def build(sp: Any) -> Any:
        if sp is None:
            return next(it)
        kind, parts = sp
        if kind == "dict":
            return {k: build(s) for k, s in parts}
        seq = [build(s) for s in parts]
        return tuple(seq) if kind == "tuple" else seq

    return build(spec)


@dataclass(frozen=True)
class Layout:
    """Structure, dtypes and per-sample row shapes of a cacheable batch."""

    spec: Any
    dtypes: tuple[torch.dtype, ...]
    row_shapes: tuple[tuple[int, ...], ...]

    @property
    def row_bytes(self) -> tuple[int, ...]:
        out = []
        for dt, shape in zip(self.dtypes, self.row_shapes):
            n = 1
            for s in shape:
                n *= int(s)
            out.append(n * torch.empty((), dtype=dt).element_size())
        return tuple(out)

    @property
    def sample_bytes(self) -> int:
        return int(sum(self.row_bytes))

    @staticmethod
    def of(batch: Any, n: int) -> tuple[Optional[Layout], str]:
        """The layout of a batch of ``n`` samples, or (None, why it cannot be retained)."""
        leaves, spec = flatten(batch)
        if not leaves:
            return None, "the batch has no tensors"
        dtypes, shapes = [], []
        for lf in leaves:
            if not isinstance(lf, torch.Tensor):
                return None, f"a batch leaf is {type(lf).__name__}, not a tensor"
            if lf.dim() == 0 or lf.shape[0] != n:
                return None, f"a batch leaf has shape {tuple(lf.shape)}, not [{n}, ...]"
            dtypes.append(lf.dtype)
            shapes.append(tuple(int(s) for s in lf.shape[1:]))
        return Layout(spec, tuple(dtypes), tuple(shapes)), ""

    def matches(self, batch: Any, n: int) -> bool:
        other, _ = Layout.of(batch, n)
        return other == self

    def empty(self, n: int, device: torch.device, pin: bool = False) -> list[torch.Tensor]:
        """Uninitialised leaves for ``n`` rows (pinned host memory when asked and possible: staging buffers only)."""
        out = []
        for dt, shape in zip(self.dtypes, self.row_shapes):
            if pin and device.type == "cpu":
                try:
                    out.append(torch.empty((n, *shape), dtype=dt, pin_memory=True))
                    continue
                except RuntimeError:
                    pass
            out.append(torch.empty((n, *shape), dtype=dt, device=device))
        return out
