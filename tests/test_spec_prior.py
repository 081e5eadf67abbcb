"""The spec prior (algorithms.md 2.3): on CUDA cohorts the hellos' device scores pick ElChe's cold-start anchor."""
from __future__ import annotations

from typing import Any

import pytest
from control_fakes import SAMPLES, Harness

from flodl_exp.devices import RankDevice, device_score, spec_prior_anchor
from flodl_exp.protocol.hello import Hello

GiB = 2**30


def test_the_score_is_generation_times_ten_plus_vram():
    assert device_score(8, 24 * GiB) == pytest.approx(104.0)  # an Ampere/Ada card with 24 GiB
    assert device_score(6, 6 * GiB) == pytest.approx(66.0)  # a Pascal card with 6 GiB
    assert device_score(9, 141 * GiB) > device_score(8, 80 * GiB)


def _devs(*specs):
    return {r: RankDevice(r, "h", dev, f"GPU-{r}" if dev.startswith("cuda") else None, score)
            for r, (dev, score) in enumerate(specs)}


def test_the_lowest_score_is_the_anchor_and_ties_go_to_the_lowest_rank():
    assert spec_prior_anchor(_devs(("cuda:0", 104.0), ("cuda:1", 66.0), ("cuda:2", 90.0)), 3) == 1
    assert spec_prior_anchor(_devs(("cuda:0", 66.0), ("cuda:1", 66.0)), 2) == 0


@pytest.mark.parametrize("devs", [
    _devs(("cuda:0", 104.0), ("cpu", None)),  # a CPU rank: no prior
    _devs(("cuda:0", 104.0), ("cuda:1", None)),  # a failed query
    _devs(("cuda:0", 104.0)),  # not every rank said hello
], ids=["cpu-rank", "no-score", "missing-hello"])
def test_no_prior_without_a_score_for_every_gpu(devs):
    assert spec_prior_anchor(devs, 2) is None


def _start(h: Harness, scores: list) -> None:
    for r, s in enumerate(scores):
        dev = "cpu" if s is None else f"cuda:{r}"
        h.co.on_event(("join", r, Hello(rank=r, samples=SAMPLES, host="h", pid=100 + r, device=dev,
                                   device_uuid=None if s is None else f"GPU-{r}", device_score=s)))
    h.co.start()


def test_the_coordinator_pins_the_cold_start_anchor_from_the_hellos(tmp_path):
    h = Harness(tmp_path, "nccl_cadence", world=3)
    _start(h, [104.0, 66.0, 90.0])
    elche = h.co.core.cycle.elche
    assert elche is not None and elche.anchor_rank == 1 and not elche.is_calibrated


def test_a_speed_hint_wins_over_the_spec_prior_and_cpu_ranks_get_none(tmp_path):
    hint: dict[str, Any] = {"mode.speed_hint_rank": 0, "mode.speed_hint_ratio": 2.0}
    h = Harness(tmp_path / "a", "nccl_cadence", world=2, **hint)
    _start(h, [104.0, 66.0])
    assert h.co.core.cycle.elche is not None and h.co.core.cycle.elche.anchor_rank == 0
    h2 = Harness(tmp_path / "b", "nccl_cadence", world=2)
    _start(h2, [None, None])
    assert h2.co.core.cycle.elche is not None and h2.co.core.cycle.elche.anchor_rank is None
