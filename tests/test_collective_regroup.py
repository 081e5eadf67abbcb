"""The collective backend's regroup on real processes over Gloo: a survivor whose all_reduce is still
pending when it learns of a regroup must leave that group at once and reduce in the next generation.

Before Gloo groups were standalone, that survivor sat in ``_abort_process_group`` (Gloo's abort waits for the
pending collective until the group's timeout) while the other survivor waited for it in the new generation's
rendezvous: ``nccl_sync`` with a rank killed hung for good (issue 26)."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import run_spawned

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _survivor(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.rank.backends import CollectiveBackend, CollectiveInterrupted

    looks = [0]

    def poll() -> None:  # rank 0: the regroup message arrives while its all_reduce waits for rank 1
        looks[0] += 1
        if rank == 0 and gen[0] == 0 and looks[0] > 200:
            raise CollectiveInterrupted("regroup to generation 1 arrived mid-collective")

    gen = [0]
    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60, poll=poll)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    b.sync(model, 1, 1.0)  # generation 0 works for both
    t0 = time.monotonic()
    if rank == 0:
        try:
            b.sync(model, 1, 1.0)  # rank 1 never joins this one: it gave up on generation 0
            q.put((rank, "the pending collective completed", 0.0))
            return
        except CollectiveInterrupted:
            pass
        b.abort()  # must not wait for the pending collective
    else:
        kept = b.group  # a peer that gave up on generation 0 but still holds its sockets open (as Gloo's abort
        b.abort()       # left them): rank 0's collective stays pending, however long it is waited for
    gen[0] = 1
    b.rebuild(1, rank, 2, session="s1")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    b.sync(model, 1, 1.0)
    value = float(next(model.parameters()).flatten()[0])
    b.close()
    if rank == 1:
        assert kept is not None
    q.put((rank, value, time.monotonic() - t0))


def test_a_survivor_with_a_pending_collective_regroups_at_once(master_store):
    results, codes = run_spawned(_survivor, [(0, master_store.port), (1, master_store.port)], timeout=90)
    got = {r: (v, s) for r, v, s in results}
    assert got[0][0] == got[1][0] == pytest.approx(1.5), got  # the new generation averaged (1 + 2) / 2
    assert got[0][1] < 20, f"leaving the old group and forming the new one took {got[0][1]:.1f}s"
    assert codes == [0, 0], codes


def _resyncing(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.outer import OuterOptimizer, OuterSpec
    from flodl_exp.rank.backends import CollectiveBackend

    outer = OuterOptimizer(OuterSpec("slowmo", lr=1.0, mu=0.9))
    outer.allocate([torch.zeros(2, 1), torch.zeros(2)])
    for k in range(2 - rank):  # rank 0 stepped one window more than rank 1 (its collective failed, rank 1's did not)
        outer.step([torch.full((2, 1), float(k)), torch.full((2,), float(k))])
    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60)
    b.rebuild(1, rank, 2, session="resync")
    assert outer.state_buffer is not None
    b.broadcast_(outer.state_buffer, src=0)
    outer.state_changed()
    b.close()
    q.put((rank, [t.tolist() for t in outer.prev or []], outer.momentum_norm()))


def test_a_regroup_broadcast_gives_every_survivor_rank_0s_outer_state(master_store):
    """The survivors' replicated outer states can differ after a partial collective failure: the regroup's
    broadcast (RankControl._resync_outer) makes them equal again, over a real Gloo group."""
    results, codes = run_spawned(_resyncing, [(0, master_store.port), (1, master_store.port)], timeout=90)
    got = {r: (prev, m) for r, prev, m in results}
    assert got[0] == got[1] and got[0][1] > 0, got
    assert codes == [0, 0], codes


def _lockstep(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.rank.backends import CollectiveBackend, LockstepMisaligned

    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    b.sync(model, 1, 1.0, lockstep_version=4)  # both in reduce 4: averaged
    aligned = float(next(model.parameters()).flatten()[0])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(3 * rank + 1))
    b.sync(model, 1, 1.0, lockstep_version=5 + rank)  # rank 1 one reduce ahead (a regroup's redo paired them)
    realigned = b.realigned_to
    averaged = float(next(model.parameters()).flatten()[0])
    try:
        b.sync(model, 1, 1.0, lockstep_version=None if rank == 0 else 7)  # one paced, one in lockstep
        outcome = "paired"
    except LockstepMisaligned:
        outcome = "refused"
    after = float(next(model.parameters()).flatten()[0])
    b.close()
    q.put((rank, aligned, realigned, averaged, outcome, after))


def test_lockstep_reduces_of_two_versions_realign_and_a_paced_one_is_refused(master_store):
    """Two ranks whose lockstep counts differ (one completed a reduce the other redid after a regroup) see it in the
    head, average all the same and learn the furthest version; a paced member beside a lockstep one is refused by
    every member alike, nothing averaged, so no rank waits in a collective the other never starts."""
    results, codes = run_spawned(_lockstep, [(0, master_store.port), (1, master_store.port)], timeout=90)
    got = {r: rest for r, *rest in results}
    assert got[0][0] == got[1][0] == pytest.approx(1.5)
    assert got[0][1] == got[1][1] == 6  # the furthest version, on both
    assert got[0][2] == got[1][2] == pytest.approx(2.5)  # (1 + 4) / 2: averaged all the same
    assert got[0][3] == got[1][3] == "refused"
    assert got[0][4] == got[1][4] == pytest.approx(2.5)  # the replica as before the refused reduce
    assert codes == [0, 0], codes


def _one_collective(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.rank.backends import CollectiveBackend

    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60)
    calls: list[int] = []
    real = b._start_all_reduce

    def counting(t, op=None):
        calls.append(t.numel())
        return real(t, op)

    b._start_all_reduce = counting  # type: ignore[method-assign]
    bn = torch.nn.BatchNorm1d(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), bn)
    mean = bn.running_mean
    assert mean is not None
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
        mean.fill_(float(10 * (rank + 1)))
    b.sync(model, 1 + 2 * rank, 1.0)  # masses 1 and 3: (1 * 1 + 3 * 2) / 4 = 1.75
    weighted = float(next(model.parameters()).detach().flatten()[0])
    buffers = float(mean[0])  # movers vote equally: (10 + 20) / 2
    one_call = list(calls)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 7))
    reduced_before = b.reduced
    b.sync(model, 0, 1.0)  # nobody moved: every replica as it was
    idle = float(next(model.parameters()).detach().flatten()[0])
    b.close()
    q.put((rank, weighted, buffers, one_call, reduced_before, b.reduced, idle))


def test_a_sync_is_one_all_reduce_with_its_head_and_weighs_by_mass(master_store):
    """The masses, movers and lockstep flags travel appended to the replica (backends.HEAD_SLOTS): one all_reduce a
    paced sync, not a head collective and then the sum (one round trip less on every nccl_sync step). The weighting
    is unchanged: parameters by mass n^gamma, float buffers equally among movers, nothing when nobody moved."""
    results, codes = run_spawned(_one_collective, [(0, master_store.port), (1, master_store.port)], timeout=90)
    got = {r: rest for r, *rest in results}
    n_all = 3 * 2 + 2 + 2 + 2 + 2 + 2  # Linear weight and bias, BatchNorm weight and bias, running mean and var
    for r in (0, 1):
        weighted, buffers, calls, reduced, reduced_idle, idle = got[r]
        assert weighted == pytest.approx(1.75) and buffers == pytest.approx(15.0)
        assert calls == [n_all + 3], calls  # one collective: the replica and its 3 head slots
        assert reduced is True and reduced_idle is False and idle == pytest.approx(r + 7.0)
    assert codes == [0, 0], codes


def _overlapped(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    from flodl_exp.rank.backends import CollectiveBackend

    b = CollectiveBackend(host="127.0.0.1", store_port=port, rank=rank, world_size=2, device=torch.device("cpu"),
                          backend="gloo", op_timeout_s=60, store_timeout_s=60)
    bn = torch.nn.BatchNorm1d(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), bn)
    params = list(model.parameters())
    mean = bn.running_mean
    assert mean is not None

    def fill(v: float) -> None:
        with torch.no_grad():
            for t in params + [mean]:
                t.fill_(v)

    def first() -> tuple[float, float]:
        return float(params[0].detach().flatten()[0]), float(mean[0])

    # 1. trained on while the all-reduce ran: W + (W_avg - W_sent), parameters and float buffers alike
    fill(float(rank + 1))
    b.start_overlapped(model, rank + 1, 1.0)  # masses 1 and 2: the weighted mean of 1 and 2 is 5/3
    with torch.no_grad():
        for t in params + [mean]:
            t.add_(10.0 * (rank + 1))  # what the rank trains while the all-reduce is in flight
    d, _, _ = b.land_overlapped(model, True, keep_current=True)
    b.apply_correction(model)
    corrected = first()
    # 2. nothing trained since: the consensus as is, bit-exact on every rank
    fill(float(rank + 1))
    b.start_overlapped(model, 1, 1.0)
    b.land_overlapped(model, False, keep_current=False)
    b.apply_correction(model)  # nothing kept: no-op
    plain = [t.detach().clone() for t in params]
    # 3. the group fails with the all-reduce in flight: it goes again, as sent, in the next generation
    fill(float(rank + 1))
    if rank == 0:
        b.start_overlapped(model, 1, 1.0)  # rank 1 gave up on generation 0 and never joins this one
    b.abort()
    b.rebuild(1, rank, 2, session="s1")
    if rank == 1:
        b.start_overlapped(model, 1, 1.0)
    else:
        b.relaunch_overlapped()
    with torch.no_grad():
        params[0].add_(100.0 if rank == 0 else 0.0)  # rank 0 trained on meanwhile
    b.land_overlapped(model, False, keep_current=True)
    b.apply_correction(model)
    again = first()
    b.close()
    q.put((rank, corrected, d, [t.tolist() for t in plain], again))


def test_an_overlapped_all_reduce_lands_as_a_correction_and_goes_again_after_a_regroup(master_store):
    """``mode.overlap`` on the nccl backend: the rank launches its all-reduce and trains on; the consensus lands as
    ``W + (W_avg - W_sent)`` (mass-weighted parameters, movers' mean of float buffers), or as is when nothing was
    trained since (the replicas equal to the last bit); a failed one goes again, with the replica as sent, in the
    group formed after it."""
    results, codes = run_spawned(_overlapped, [(0, master_store.port), (1, master_store.port)], timeout=90)
    got = {r: rest for r, *rest in results}
    for r in (0, 1):
        corrected, d, _, again = got[r]
        assert corrected[0] == pytest.approx(5.0 / 3.0 + 10.0 * (r + 1))  # parameters: masses 1 and 2
        assert corrected[1] == pytest.approx(1.5 + 10.0 * (r + 1))  # float buffers: the movers' plain mean
        assert d is not None and d > 0
        assert again[0] == pytest.approx(1.5 + (100.0 if r == 0 else 0.0))
    assert got[0][2] == got[1][2], "without training since, every replica holds the same consensus"
    assert codes == [0, 0], codes
