"""Deterministic epoch permutations and per-rank partitions (algorithms.md 4).

Every process (coordinator and each rank) computes the same permutation of the
epoch's pick space from ``(seed, epoch, total)`` alone, so a plan on the wire
is just ``(offset, size)``: the rank slices the permutation itself. The
algorithm is named in checkpoint metadata so a resume can refuse a mismatch.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

PERMUTATION_ALGORITHM = "numpy-pcg64-permutation"


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, total: int) -> np.ndarray:
    """Permutation of ``[0, total)`` for ``epoch``: PCG64 seeded with ``seed + epoch``. Cached (a rank asks for
    the same epochs at every chunk and staging advisory) and read-only, so no caller can change the cached one."""
    rng = np.random.Generator(np.random.PCG64((int(seed) + int(epoch)) % (2**64)))
    perm = rng.permutation(int(total))
    perm.setflags(write=False)
    return perm


def make_partition(offset: int, size: int, total: int, epoch: int, seed: int) -> np.ndarray:
    """The consecutive slice ``[offset, offset + size)`` of the epoch permutation."""
    perm = epoch_permutation(seed, epoch, total)
    return perm[offset : min(offset + size, total)]


def decode_pick(pick: np.ndarray, augment: int) -> tuple[np.ndarray, np.ndarray]:
    """A pick in ``[0, samples * augment)`` names (sample, view)."""
    return pick // augment, pick % augment


def equal_sizes(world: int, total: int) -> list[int]:
    """``total // world`` each; the first ``total % world`` ranks get one more."""
    base, extra = divmod(int(total), int(world))
    return [base + (1 if r < extra else 0) for r in range(world)]


def _largest_first_remainder(weights: Sequence[float], total: int) -> list[int]:
    s = float(sum(weights))
    norm = [w / s for w in weights]
    sizes = [int(np.floor(n * total)) for n in norm]
    rem = total - sum(sizes)
    order = sorted(range(len(weights)), key=lambda r: -norm[r])  # stable: ties keep rank order
    for i in range(rem):
        sizes[order[i % len(order)]] += 1
    return sizes


def ratio_to_sizes(ratios: Sequence[float], total: int) -> list[int]:
    """Sizes proportional to ``ratios``; leftovers go to the largest ratios first."""
    if sum(ratios) <= 0:
        return equal_sizes(len(ratios), total)
    return _largest_first_remainder(ratios, total)


def throughput_sizes(smoothed_ms: Sequence[float], total: int) -> list[int]:
    """Sizes proportional to measured throughput ``1 / ms_per_batch``."""
    tp = [1.0 / max(ms, 0.001) for ms in smoothed_ms]
    if sum(tp) <= 0:
        return equal_sizes(len(smoothed_ms), total)
    return _largest_first_remainder(tp, total)


def batch_aligned_plans(sizes_in_batches: Sequence[int], batch_size: int) -> list[tuple[int, int]]:
    """Consecutive, disjoint ``(offset, size)`` sample ranges from per-rank batch counts.

    Plans are batch-aligned so every pick a rank is given is trained (no
    sub-batch remainder is silently dropped inside a partition); the epoch's
    trained range is ``[0, (total // batch_size) * batch_size)``.
    """
    plans, off = [], 0
    for n in sizes_in_batches:
        size = int(n) * batch_size
        plans.append((off, size))
        off += size
    return plans
