"""Hierarchical cpu averaging's arithmetic (issue 52, item 2): node partials summed at the coordinator give the flat
reduce's consensus to the last bit of float32, with the same masses, buffers, EASGD idle mean, outer step and drift."""
from __future__ import annotations

import random

import pytest
import torch

from flodl_exp.averaging import divide_sums, weighted_average
from flodl_exp.config import OuterSpec
from flodl_exp.node_average import member_update, node_drift, node_partial, partial_sums
from flodl_exp.protocol import codec
from flodl_exp.protocol.messages import NodePartial, NodeUpdate, Snapshot
from flodl_exp.torch_averager import TorchAverager


def _snaps(count: int, seed: int, steps: tuple[int, ...] = (0, 1, 3, 5, 17, 40), dtype: torch.dtype = torch.float32) -> list[Snapshot]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    return [Snapshot(n=rng.choice(steps), version=7,
                     tensors={"p0": torch.randn(40, 30, generator=g).to(dtype), "p1": torch.randn(30, generator=g).to(dtype),
                              "b0": torch.randn(30, generator=g)})
            for _ in range(count)]


def _flat(snaps: list[Snapshot], gamma: float) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    return weighted_average([s.n for s in snaps], [[s.tensors["p0"].float(), s.tensors["p1"].float()] for s in snaps],
                            [[s.tensors["b0"]] for s in snaps], gamma)


def _hier(snaps: list[Snapshot], per_node: int, gamma: float,
          idle_mean: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    parts = []
    for k in range(0, len(snaps), per_node):
        p = node_partial(7, list(range(k, k + per_node)), snaps[k:k + per_node], gamma)
        back = codec.decode(codec.encode(p))  # through the wire, as the coordinator reads it
        assert isinstance(back, NodePartial)
        parts.append(partial_sums(back))
    return divide_sums(parts, gamma, idle_mean=idle_mean)


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_64_nodes_of_16_give_the_flat_consensus_bit_for_bit(gamma: float, dtype: torch.dtype) -> None:
    snaps = _snaps(1024, seed=int(gamma * 10) + (dtype == torch.bfloat16), dtype=dtype)
    flat, hier = _flat(snaps, gamma), _hier(snaps, 16, gamma)
    assert flat is not None and hier is not None
    for a, b in zip(flat[0] + flat[1], hier[0] + hier[1]):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


def test_a_node_nobody_on_moved_adds_nothing_and_the_idle_mean_is_the_flat_one() -> None:
    snaps = _snaps(8, seed=3, steps=(0,))
    for s in snaps[4:]:
        s.n = 5
    flat, hier = _flat(snaps, 1.0), _hier(snaps, 4, 1.0)  # node 0 idle: its plain sums are left out
    assert flat is not None and hier is not None
    assert all(torch.equal(a, b) for a, b in zip(flat[0] + flat[1], hier[0] + hier[1]))
    for s in snaps:
        s.n = 0
    assert _flat(snaps, 1.0) is None and _hier(snaps, 4, 1.0) is None  # nobody moved: no consensus
    mean = weighted_average([1] * 8, [[s.tensors["p0"], s.tensors["p1"]] for s in snaps], [[s.tensors["b0"]] for s in snaps])
    idle = _hier(snaps, 4, 1.0, idle_mean=True)  # EASGD's final round: the plain mean of idle replicas
    assert mean is not None and idle is not None
    assert all(torch.equal(a, b) for a, b in zip(mean[0] + mean[1], idle[0] + idle[1]))


@pytest.mark.parametrize("outer", [OuterSpec(), OuterSpec(kind="diloco", lr=0.7, mu=0.9)])
def test_the_averager_with_partials_matches_the_flat_one_and_the_leaders_measure_the_same_drift(outer: OuterSpec) -> None:
    snaps = _snaps(12, seed=11)
    flat_avg, hier_avg = TorchAverager(outer), TorchAverager(outer)
    for _ in range(2):  # two rounds: the outer optimizer's second step moves the update off the average
        flat = flat_avg.average(snaps, gamma=1.0, idle_mean=False)
        partials = [node_partial(7, list(range(k, k + 4)), snaps[k:k + 4], 1.0) for k in (0, 4, 8)]
        hier = hier_avg.average([], gamma=1.0, idle_mean=False, partials=partials)
        assert flat.tensors is not None and hier.tensors is not None and hier.leader_tensors is not None
        assert all(torch.equal(flat.tensors[k], hier.tensors[k]) for k in flat.tensors)
        assert hier.post == flat.post
        assert ("c0" in hier.leader_tensors) == outer.stateful
        drift: list[float] = []
        pre: list[float] = []
        for p, k in zip(partials, (0, 4, 8)):
            upd = NodeUpdate(version=7, ranks=list(p.ranks), ns=list(p.ns), tensors=dict(hier.leader_tensors))
            drift += node_drift(snaps[k:k + 4], upd)
            pre += list(p.pre)
            m = member_update(upd, p.ranks[1])
            assert m.n == p.ns[1] and set(m.tensors) == set(flat.tensors)
        assert drift == [d for d, _ in flat.drift]
        assert pre == [p for _, p in flat.drift]
        if outer.stateful:
            snaps = _snaps(12, seed=12)


def test_a_partial_says_the_most_its_members_were_held() -> None:
    """mode.overlap: the coordinator feeds ElChe the most any rank was held; a node's partial carries its members'."""
    t = {"p0": torch.ones(3)}
    snaps = [Snapshot(n=2, tensors=t, held_ms=1.5), Snapshot(n=2, tensors=t, held_ms=4.0), Snapshot(n=2, tensors=t)]
    assert node_partial(3, [0, 1, 2], snaps, 1.0).held_ms == 4.0
    assert node_partial(3, [2], snaps[2:], 1.0).held_ms is None
    back = codec.decode(codec.encode(node_partial(3, [0, 1, 2], snaps, 1.0)))
    assert isinstance(back, NodePartial) and back.held_ms == 4.0
