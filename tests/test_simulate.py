"""The what-if simulator (flodl_exp/simulate): behaviour on small rigs, no processes but one CLI run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flodl_exp.config import ConfigError
from flodl_exp.simulate.engine import Engine, simulate
from flodl_exp.simulate.fast import SimDispatcher
from flodl_exp.simulate.report import summarize
from flodl_exp.simulate.topology import LinkConfig, RankGroupConfig, SimulateConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rig(*speeds: float, epochs: int = 3, **kw: object) -> SimulateConfig:
    cfg = SimulateConfig(ranks=[RankGroupConfig(speed=s) for s in speeds], base_step_ms=9.0, model_mb=0.86,
                         samples=1437, batch_size=16, epochs=epochs, chunk_start_ms=2.0,
                         link=LinkConfig(bandwidth_gbps=20.0, latency_ms=0.5, collective_fixed_ms=10.0))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_a_run_config_built_beforehand_gives_the_same_run() -> None:
    from flodl_exp.simulate.topology import run_config

    cfg = rig(1.0, 0.33)
    run = run_config(cfg, "cpu_async", 2)
    a, b = simulate(cfg, "cpu_async"), simulate(cfg, "cpu_async", run)
    assert a.syncs == b.syncs and a.batches == b.batches and a.events == b.events
    with pytest.raises(ValueError, match="not cpu_cadence on 2"):
        simulate(cfg, "cpu_cadence", run)
    with pytest.raises(ValueError, match="not cpu_async on 3"):
        simulate(rig(1.0, 0.5, 0.25), "cpu_async", run)


def test_same_config_same_numbers() -> None:
    cfg = rig(1.0, 0.33, ranks=[RankGroupConfig(speed=1.0, jitter=0.1), RankGroupConfig(speed=0.33, jitter=0.1)])
    a, b = simulate(cfg, "cpu_async"), simulate(cfg, "cpu_async")
    assert a.syncs == b.syncs and a.batches == b.batches and a.events == b.events
    assert json.dumps(a.epochs) == json.dumps(b.epochs)  # (the loss is NaN: nothing is trained)
    assert len(a.syncs) > 0


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "nccl_sync"])
def test_equal_ranks_share_half(mode: str) -> None:
    row = summarize(simulate(rig(1.0, 1.0), mode), 0)
    assert row["shares"] == pytest.approx([0.5, 0.5], abs=0.03)
    assert row["samples"] == 3 * (1437 // 16) * 16  # every pick of every epoch, once


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_three_to_one_gives_the_fast_rank_three_quarters(mode: str) -> None:
    row = summarize(simulate(rig(1.0, 1 / 3), mode), 0)
    assert 0.70 <= row["fast_share"] <= 0.80
    assert row["idle"][0] < 0.25  # cadence keeps the fast rank busy


def test_sync_wall_is_bounded_by_the_slow_rank() -> None:
    cfg = rig(1.0, 1 / 3)
    st = simulate(cfg, "nccl_sync")
    row = summarize(st, 0)
    slow_share_batches = (1437 // 16) // 2 * cfg.epochs  # equal split: the slow rank trains half of every epoch
    assert st.wall_s >= slow_share_batches * 27.0 / 1e3
    assert row["shares"][0] == pytest.approx(0.5, abs=0.02)
    cadence = simulate(cfg, "nccl_cadence")
    assert cadence.wall_s < st.wall_s  # cadence beats the lockstep on a 3:1 rig


@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 1 / 3), (1.0, 0.5, 0.25)])
def test_nccl_sync_in_lockstep_reduces_every_step_and_trains_every_pick_once(speeds: tuple[float, ...]) -> None:
    """``mode.lockstep_ahead``: the simulated ranks all-reduce after each step on their own, as rank/control.py does,
    with the same core booking their answers: one reduce per step, and the same picks trained as the paced run."""
    paced = simulate(rig(*speeds), "nccl_sync")
    ahead = simulate(rig(*speeds, mode={"lockstep_ahead": 8}), "nccl_sync")
    steps = (1437 // 16) // len(speeds) * 3  # each rank's equal share of 3 epochs
    assert len(ahead.syncs) >= max(0.9 * steps, len(paced.syncs))
    assert summarize(ahead, 0)["samples"] == summarize(paced, 0)["samples"] == 3 * (1437 // 16) * 16


def test_real_books_and_indexed_books_agree() -> None:
    """The coordinator's running books (ChunkBook, a pool's remaining) answer as full scans do, at every
    aggregation check of a simulated run."""
    for mode in ("nccl_cadence", "cpu_async"):
        engine = Engine(rig(1.0, 0.5, 0.25, epochs=2), mode, check=True)
        st = engine.run()
        assert isinstance(engine.books, SimDispatcher)
        assert engine.books.checks >= 10, "the books were compared at every chunk report"
        assert [e["epoch"] for e in st.epochs if e["event"] == "epoch"] == [0, 1]


def test_1024_ranks_finish_within_a_bounded_number_of_events() -> None:
    w, bs = 1024, 8
    cfg = SimulateConfig(ranks=[RankGroupConfig(count=512, speed=1.0), RankGroupConfig(count=512, speed=0.5)],
                         base_step_ms=20.0, model_mb=100.0, samples=w * 6 * bs, batch_size=bs, epochs=1,
                         link=LinkConfig(bandwidth_gbps=200.0, latency_ms=0.005))
    st = simulate(cfg, "nccl_cadence")
    batches = sum(st.batches)
    assert batches == cfg.samples // bs
    # per batch: its end and its report; per chunk: a start, its metrics; per reduce and rank: sync_now,
    # the collective's end, the ack, set_global_step
    assert st.events <= 2 * batches + 2 * 3 * w + 4 * w * (len(st.syncs) + 1)
    assert st.wall_s > 0


def test_refused_mode_is_refused_as_a_run_would_be() -> None:
    with pytest.raises(ConfigError, match="nccl_async"):
        simulate(rig(1.0, 0.5), "nccl_async")


@pytest.mark.e2e  # a subprocess that imports torch: with the end-to-end runs, not in make test-fast
def test_cli_prints_the_table() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "flodl_exp.simulate", "modes=[nccl_cadence]", "epochs=1", "plot=false"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| run | wall s | samples/s |" in out.stdout
    assert "| nccl_cadence |" in out.stdout


def test_a_run_the_core_ends_early_is_an_error_not_a_short_report() -> None:
    """A reduce past the stall ceiling (300 s) ends a real run in ShutdownWithSave; the simulator, driving the same
    core, says so instead of reporting the epochs done so far as a finished run."""
    cfg = SimulateConfig(ranks=[RankGroupConfig(count=1, speed=1.0), RankGroupConfig(count=1, speed=0.5)],
                         model_mb=1000.0, samples=256, batch_size=16, epochs=2,
                         link=LinkConfig(bandwidth_gbps=0.01, coordinator_gbps=0.01))
    with pytest.raises(RuntimeError, match=r"ended in phase saving .*reduce_stall"):
        simulate(cfg, "cpu_cadence")


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_an_overlapped_reduce_longer_than_a_window_holds_the_ranks_and_elche_grows_the_window(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap a rank trains through the reduce, then idles for its next chunk until the reduce finishes; its
    answers say so (``held_ms``, as a real rank's do) and ElChe grows the window for it. A short reduce holds the
    ranks nothing."""
    from flodl_exp.protocol.messages import Snapshot, SyncAck

    held: list[float] = []
    coord_msg = Engine._coord_msg

    def seen(self: Engine, r: int, p: object) -> None:
        if isinstance(p, (Snapshot, SyncAck)) and p.held_ms is not None:
            held.append(p.held_ms)
        coord_msg(self, r, p)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_coord_msg", seen)
    slow = rig(1.0, 1.0, epochs=4, mode={"overlap": True})
    slow.link.collective_fixed_ms = 400.0  # a reduce of ~0.4 s against windows of ~0.1 s
    st = simulate(slow, mode)
    assert held and max(held) > 100.0, held
    anchors = [a for _, _, a in st.syncs]
    assert anchors[-1] > anchors[0], f"ElChe grew no window for a reduce that holds the ranks: {anchors}"
    held.clear()
    simulate(rig(1.0, 1.0, epochs=2, mode={"overlap": True}), mode)
    assert held and max(held) < 20.0, held
