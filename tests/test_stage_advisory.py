"""Staging advisories (algorithms.md 5.10): the coordinator names the picks a rank is likely to get next; the
rank's data plane retains those samples while its readers are idle. Purely advisory."""
from __future__ import annotations

import time

import numpy as np
from control_fakes import Harness
from test_data_plane import Synth, drain, make_trainer

from flodl_exp.core.chunk_pool import ChunkPool, stage_advisory
from flodl_exp.partition import make_partition
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import StageAdvisory
from flodl_exp.rank.data.cache import SampleCache


def test_a_rank_is_advised_its_own_span_first_then_its_live_peers_tails():
    pool = ChunkPool(0, 960, 8, [4, 2, 2])  # spans by counts: rank 0 half, ranks 1-2 a quarter each
    spans = [pool.span(r) for r in range(3)]
    pool.take_chunk(32, 0)  # rank 0 has taken its first chunk
    got = stage_advisory(pool, 0, [4, 2, 2], [True, True, True])
    assert got[0] == (spans[0][0] + 32, spans[0][1] - spans[0][0] - 32), "the rest of its own span first"
    assert got[1:] == [(spans[1][1] - 16, 16), (spans[2][1] - 16, 16)], "then count x batch of each peer's tail"
    assert stage_advisory(pool, 0, [4, 2, 2], [True, False, True])[1:] == [(spans[2][1] - 16, 16)], "dead peers: none"
    small = ChunkPool(0, 48, 8, [1, 1])
    small.take_chunk(16, 1)
    assert stage_advisory(small, 0, [100, 100], [True, True])[1] == (40, 8), "a peer's tail is capped at its residue"


def test_warm_retains_the_misses_in_the_host_tiers_and_stops_when_full():
    ds = Synth(100, dim=4)
    row = 4 * 4 + 8
    cache = SampleCache(ds, 100, ram_bytes=30 * row)
    assert cache.warm(np.arange(20)) == 20 and ds.loaded == 20
    assert cache.warm(np.arange(10)) == 0 and ds.loaded == 20, "held samples are not fetched again"
    assert cache.warm(np.arange(20, 60)) == 10, "only what fits: retention never evicts"
    cache.load(np.arange(30))
    assert ds.loaded == 60 and cache.stats["miss"] == 0 and cache.stats["ram"] == 30
    assert SampleCache(ds, 100, ram_bytes=0).warm(np.arange(5)) == 0
    cache.close()


def test_staged_picks_are_served_from_the_cache_when_the_chunk_comes():
    ds = Synth(64, dim=4, sleep_ms=0.2)
    tr = make_trainer(ds, ram_max_usage=0.5)
    picks = make_partition(0, 64, tr.total_picks, 0, tr.seed)
    tr.data_pipeline().stage(picks)
    cache = tr.pipeline.cache
    deadline = time.monotonic() + 30
    while cache.stats.get("staged", 0) < 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.loaded == 64, "the stager retained every advised sample while the readers were idle"
    drain(tr, 0, 0, 64)
    assert ds.loaded == 64 and cache.stats["miss"] == 0 and cache.stats["staged"] == 64
    tr.close_data()


def test_the_coordinator_advises_each_rank_at_epoch_start_this_epoch_and_the_next(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=3)
    for r in range(2):
        h.co.on_event(("join", r, Hello(rank=r, samples=960, host="h", pid=100 + r)))
    h.co.start()
    adv = {r: p for r, p in h.transport.take() if isinstance(p, StageAdvisory)}
    assert sorted(adv) == [0, 1]
    for a in adv.values():
        epochs = [e for e, _, _ in a.segments]
        assert epochs[0] == 0 and 1 in epochs and epochs == sorted(epochs), a.segments
        assert all(size > 0 for _, _, size in a.segments)
    off = Harness(tmp_path / "off", "cpu_cadence", world=2, epochs=3, **{"data_plane.stage_advisories": False})
    off.start(samples=960)
    assert not [p for _, p in off.transport.take() if isinstance(p, StageAdvisory)]


def test_the_schedule_rides_an_advisory_only_when_it_changed_since_the_ranks_last_one(tmp_path):
    """W counts to each of W ranks at every reduce was O(W^2) a round at a thousand ranks: the counts go to a rank
    when they changed since its last advisory (empty: unchanged)."""
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=3)
    for r in range(2):
        h.co.on_event(("join", r, Hello(rank=r, samples=960, host="h", pid=100 + r)))
    h.co.start()
    first = {r: p for r, p in h.transport.take() if isinstance(p, StageAdvisory)}
    counts = list(h.co.core.cycle.counts)
    assert sorted(first) == [0, 1] and all(a.counts == counts for a in first.values())
    d = h.co.core.dispatch
    d.send_advisories()
    again = [p for _, p in h.transport.take() if isinstance(p, StageAdvisory)]
    assert len(again) == 2 and all(a.counts == [] and a.segments for a in again), "unchanged: not sent again"
    h.co.core.cycle.elche.counts_view[1] += 3  # type: ignore[union-attr,index]  # a new schedule
    d.send_advisories()
    changed = [p for _, p in h.transport.take() if isinstance(p, StageAdvisory)]
    assert [a.counts for a in changed] == [[counts[0], counts[1] + 3]] * 2


def test_an_advisory_names_at_most_eight_peers_the_largest_residues() -> None:
    """At a thousand ranks an advisory naming every peer was O(W) each, O(W^2) a round: it names the
    ADVISORY_DONORS largest residues (what take_chunk steals from first); up to 9 ranks, every peer as before."""
    from flodl_exp.core.chunk_pool import ADVISORY_DONORS, ChunkPool, advisory_donors, stage_advisory

    w = 20
    pool = ChunkPool(0, 8 * 400, 8, [1] * w)
    for r in range(w):  # rank r has taken r batches of its 20: residues fall with the rank
        if r:
            pool.take_chunk(8 * r, r)
    alive = [True] * w
    donors = advisory_donors(pool, alive)
    assert donors == list(range(ADVISORY_DONORS + 1))
    segs = stage_advisory(pool, 5, [1] * w, alive, donors)
    assert len(segs) == 1 + ADVISORY_DONORS  # its own span, then 8 peers (itself left out)
    small = ChunkPool(0, 8 * 40, 8, [1] * 4)
    assert len(stage_advisory(small, 0, [1] * 4, [True] * 4)) == 4
