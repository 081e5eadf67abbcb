"""Deterministic permutations and disjoint, covering partitions (algorithms.md 4)."""
from __future__ import annotations

import numpy as np
import pytest

from flodl_exp.partition import (
    batch_aligned_plans,
    decode_pick,
    epoch_permutation,
    equal_sizes,
    make_partition,
    ratio_to_sizes,
    throughput_sizes,
)


def test_permutation_is_a_pure_function_of_seed_epoch_total():
    a = epoch_permutation(42, 3, 1000)
    assert np.array_equal(a, epoch_permutation(42, 3, 1000))
    assert sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, epoch_permutation(42, 4, 1000))
    assert np.array_equal(epoch_permutation(41, 4, 1000), epoch_permutation(42, 3, 1000))  # seed + epoch


@pytest.mark.parametrize("world,total", [(1, 10), (2, 1437), (3, 1437), (7, 100), (4, 3)])
def test_equal_sizes_cover_the_total(world, total):
    sizes = equal_sizes(world, total)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ranks take the extra ones


def test_partitions_are_disjoint_and_cover_the_epoch():
    total, bs = 1437, 32
    plans = batch_aligned_plans(equal_sizes(3, total // bs), bs)
    picks = np.concatenate([make_partition(off, size, total, 5, 42) for off, size in plans])
    assert len(picks) == (total // bs) * bs and len(set(picks.tolist())) == len(picks)
    assert all(size % bs == 0 for _, size in plans)


def test_ratio_and_throughput_sizes():
    assert ratio_to_sizes([0.75, 0.25], 100) == [75, 25]
    assert sum(ratio_to_sizes([0.5, 0.3, 0.2], 7)) == 7
    assert ratio_to_sizes([0, 0], 5) == [3, 2]
    assert throughput_sizes([10.0, 30.0], 40) == [30, 10]
    assert sum(throughput_sizes([1.0, 2.0, 3.0], 101)) == 101


def test_decode_pick_for_augmentation():
    s, v = decode_pick(np.arange(6), 2)
    assert s.tolist() == [0, 0, 1, 1, 2, 2] and v.tolist() == [0, 1, 0, 1, 0, 1]
