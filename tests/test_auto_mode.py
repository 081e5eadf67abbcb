"""mode=auto (issue 31): the probe before the first chunk, the simulated candidates, the choice, and the run in the
chosen mode keeping every invariant (every pick of every epoch trained once); no process, no socket, except the
rank-side probe, which runs a real trainer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from control_fakes import Harness
from test_trainer import _trainer

from flodl_exp.config import ConfigError
from flodl_exp.config_rules import validate
from flodl_exp.core.lifecycle import Phase
from flodl_exp.policy.mode import variant_of, with_overlap
from flodl_exp.protocol.messages import Probe, ProbeResult, StartEpoch
from flodl_exp.simulate.auto import (
    KEEP_MARGIN,
    PROBE_STEPS,
    SIM_EPOCHS,
    AutoChoice,
    Candidate,
    candidate_modes,
    choose,
    prepare,
    probe_ms,
    probe_rig,
)
from flodl_exp.simulate.from_run import base_config
from flodl_exp.simulate.topology import MODES


def _rig(fast_ms: float, slow_ms: float, epochs: int = 3) -> Any:
    return probe_rig({0: [50.0] + [fast_ms] * 5, 1: [80.0] + [slow_ms] * 5}, {0: [0.0] * 6, 1: [0.0] * 6},
                     model_bytes=40_000, samples=1437, batch_size=32, epochs=epochs, knobs={}, base=base_config())


def test_the_probe_leaves_out_the_warm_up_step():
    assert probe_ms([100.0, 5.0, 7.0, 6.0]) == 6.0
    assert probe_ms([9.0]) == 9.0, "one step: it is all there is"
    with pytest.raises(ValueError):
        probe_ms([])
    rig = _rig(4.0, 12.0)
    assert [g.step_ms for g in rig.ranks] == [4.0, 12.0] and rig.epochs == min(3, SIM_EPOCHS) and rig.samples == 1437


def test_the_choice_is_the_best_predicted_mode_within_the_window_limit():
    rig = _rig(4.0, 12.0)
    c = choose(rig, list(MODES), configured="nccl_sync", max_window=1000)
    ok = [x for x in c.candidates if x.eligible]
    assert [x.mode for x in c.candidates] == list(MODES)
    assert {x.mode for x in ok} == set(MODES) - {"cpu_sync"}, "the configured sync mode is simulated, not the other"
    skipped = next(x for x in c.candidates if x.mode == "cpu_sync")
    assert skipped.samples_per_s == 0 and skipped.why.startswith("not simulated")
    best = max(ok, key=lambda x: x.samples_per_s)
    assert c.mode == best.mode and c.mode != "nccl_sync", "a 3:1 rig: a mode with windows beats per-step sync"
    assert c.mode in c.reason and "others:" in c.reason
    tags = c.tags()
    assert tags["auto.choice"] == c.mode and all(f"auto.predicted.{m}" in tags for m in MODES)
    overlapped = AutoChoice("cpu_cadence+overlap", "r", [Candidate("cpu_cadence+overlap", 100.0, 3.0, 10.0)]).tags()
    assert "auto.predicted.cpu_cadence.overlap" in overlapped and all("+" not in k for k in overlapped), \
        "an MLflow key takes no '+'"
    # a window ceiling below what the windowed modes need leaves the per-step modes
    tight = choose(rig, list(MODES), configured="nccl_cadence", max_window=3)
    assert tight.mode.endswith("sync") and any(not x.eligible for x in tight.candidates)
    assert all(x.samples_per_s > 0 for x in tight.candidates if x.mode.endswith("sync")), "then both are simulated"


def test_the_configured_mode_is_kept_unless_another_is_clearly_faster():
    rig = _rig(5.0, 5.0)
    c = choose(rig, list(MODES), configured="cpu_cadence", max_window=1000)
    by = {x.mode: x.samples_per_s for x in c.candidates}
    best = max(by.values())
    if c.mode == "cpu_cadence":
        assert best < by["cpu_cadence"] * (1 + KEEP_MARGIN)
    else:
        assert by[c.mode] == best >= by["cpu_cadence"] * (1 + KEEP_MARGIN)


def test_prepared_run_configs_choose_exactly_as_building_them_at_once():
    """The coordinator prepares every mode's run config as it starts (auto.prepare): the choice on the probed rig is
    the one choose makes building them itself, number for number."""
    base = base_config()
    prep = prepare(MODES, world_size=2, batch_size=32, epochs=3, knobs={"anchor": 8}, base=base)
    assert set(prep.runs) == set(MODES) and all(not isinstance(r, Exception) for r in prep.runs.values())
    steps = {0: [50.0] + [4.0] * 5, 1: [80.0] + [12.0] * 5}
    waits = {0: [0.0] * 6, 1: [0.0] * 6}
    rig = prep.probed(steps, waits, model_bytes=40_000, samples=1437)
    same = probe_rig(steps, waits, model_bytes=40_000, samples=1437, batch_size=32, epochs=3, knobs={"anchor": 8},
                     base=base)
    assert rig == same
    a = choose(rig, list(MODES), configured="nccl_sync", max_window=1000, runs=prep.runs)
    b = choose(same, list(MODES), configured="nccl_sync", max_window=1000)
    assert a.mode == b.mode and a.reason == b.reason and a.candidates == b.candidates
    # a mode whose run config could not be built fails the choice where it is simulated, as when built at once
    broken = prepare(["cpu_cadence"], world_size=2, batch_size=32, epochs=3, knobs={"no_such_knob": 1}, base=base)
    assert isinstance(broken.runs["cpu_cadence"], Exception)
    with pytest.raises(type(broken.runs["cpu_cadence"])):
        choose(rig, ["cpu_cadence"], configured="cpu_cadence", max_window=1000, runs=broken.runs)


def test_without_a_process_group_only_the_cpu_modes_are_candidates():
    assert candidate_modes(True) == [*MODES, "nccl_sync+overlap", "nccl_cadence+overlap", "cpu_cadence+overlap",
                                    "cpu_async+overlap"]
    assert candidate_modes(False) == [*(m for m in MODES if m.startswith("cpu")), "cpu_cadence+overlap", "cpu_async+overlap"]
    assert "nccl_sync+overlap" not in candidate_modes(True, lockstep=True), "mode.lockstep_ahead and overlap are refused together"
    assert "nccl_cadence+overlap" in candidate_modes(True, lockstep=True)


def _answer_probes(h: Harness, fast: float = 4.0, slow: float = 12.0, error: str | None = None) -> None:
    h.msg(0, ProbeResult(step_ms=[40.0] + [fast] * (PROBE_STEPS - 1), data_ms=[0.0] * PROBE_STEPS, model_bytes=40_000))
    h.msg(1, ProbeResult(step_ms=[] if error else [60.0] + [slow] * (PROBE_STEPS - 1), data_ms=[0.0] * PROBE_STEPS,
                         model_bytes=40_000, error=error))


def test_auto_probes_before_the_first_chunk_and_trains_every_pick_once_in_the_chosen_mode(tmp_path: Path):
    h = Harness(tmp_path, "nccl_cadence", world=2, epochs=3, **{"mode.auto": True})
    sent = _join_and_start(h)
    assert not any(isinstance(p, StartEpoch) for _, p in sent), "no chunk before the probe answered"
    assert h.co.core.life.is_(Phase.CONNECTING)
    probes = [(r, p) for r, p in sent if isinstance(p, Probe)]
    assert sorted(r for r, _ in probes) == [0, 1] and all(p.steps == PROBE_STEPS for _, p in probes)
    _answer_probes(h)
    assert h.co.auto is not None
    choice = h.co.auto.choice
    assert choice is not None and choice.mode in with_overlap(MODES)
    name, overlap = variant_of(choice.mode)
    assert h.co.core.mode.name == name == h.co.cfg.mode.name, "the core was built for the chosen mode"
    assert h.co.cfg.mode.overlap == overlap and h.co.core.cycle.overlap == overlap
    assert h.sink.tags["auto.choice"] == choice.mode and h.sink.tags["mode"] == name
    events = [e for e in _events(h) if e.get("event") == "auto_mode"]
    assert len(events) == 1 and len(events[0]["candidates"]) == len(with_overlap(MODES))
    assert {"probe_s", "simulate_s", "prepare_s", "step_ms"} <= set(events[0])
    assert events[0]["step_ms"]["1"][1:] == [12.0] * (PROBE_STEPS - 1)
    h.co.start()  # as the connect loop does after the pump that brought the last answer: a no-op now
    plans = h.plans()
    assert sorted(plans) == [0, 1], "the first chunks go out once the mode is chosen"
    assert all(len({(p.epoch, p.offset) for p in ps}) == len(ps) for ps in plans.values()), "a chunk sent twice"
    h.play([0, 1], until=lambda: h.co.core.dispatch.all_aggregated(), pending=[(r, p) for r, ps in plans.items() for p in ps])
    total = h.co.core.dispatch.total
    for e in range(3):
        assert sum(size for _, size in h.co.core.dispatch.coverage[e]) == total, f"epoch {e} not trained whole"
    assert h.co.result()["auto"]["mode"] == choice.mode


def test_a_rank_that_cannot_probe_keeps_the_configured_mode(tmp_path: Path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=2, **{"mode.auto": True})
    _join_and_start(h)
    _answer_probes(h, error="RuntimeError: no step")
    assert h.co.auto is not None
    choice = h.co.auto.choice
    assert choice is not None and choice.mode == "cpu_cadence" and "rank 1: RuntimeError: no step" in choice.reason
    assert h.co.core.mode.name == "cpu_cadence" and h.plans()


def test_the_simulations_are_prepared_before_the_ranks_join(tmp_path: Path):
    """The run configs are built as the coordinator starts (the ranks start up meanwhile); a failure to prepare keeps
    the configured mode, with the reason."""
    h = Harness(tmp_path, "nccl_cadence", world=2, epochs=2, **{"mode.auto": True})
    auto = h.co.auto
    assert auto is not None and auto.prepared is not None and set(auto.prepared.runs) == set(with_overlap(MODES))
    assert not auto.sent, "nothing is sent before every rank joined"
    auto.prepared, auto.prepare_error = None, RuntimeError("no config")
    _join_and_start(h)
    _answer_probes(h)
    choice = auto.choice
    assert choice is not None and choice.mode == "nccl_cadence" and "RuntimeError: no config" in choice.reason
    assert h.co.core.mode.name == "nccl_cadence" and h.plans()


def test_a_run_without_auto_sends_no_probe(tmp_path: Path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=2)
    assert h.co.auto is None
    sent = _join_and_start(h)
    assert any(isinstance(p, StartEpoch) for _, p in sent) and not any(isinstance(p, Probe) for _, p in sent)


def _join_and_start(h: Harness) -> list[tuple[int, Any]]:
    """Every rank says hello and the coordinator starts (with auto: it probes): what it sent."""
    from flodl_exp.protocol.hello import Hello

    for r in range(h.world):
        h.co.on_event(("join", r, Hello(rank=r, samples=96, host="h", pid=100 + r)))
    h.co.start()
    return h.transport.take()


def _events(h: Harness) -> list[dict]:
    import json

    with open(Path(h.job_dir) / "events.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_the_rank_probe_times_real_steps_and_keeps_nothing():
    tr = _trainer()
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    rng = torch.get_rng_state()
    steps, waits = tr.probe(4)
    assert len(steps) == 4 == len(waits) and all(ms > 0 for ms in steps)
    after = tr.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the probe's steps were kept"
    assert not tr.optimizer.state or all(not s for s in tr.optimizer.state.values())
    assert torch.equal(rng, torch.get_rng_state())
    assert tr.step_count == 0


def test_auto_is_refused_with_a_cooperative_loop():
    from conftest import compose

    validate(compose(["mode=auto"]))
    with pytest.raises(ConfigError) as ei:
        validate(compose(["mode=auto", "experiment=digits_accumulate"]))
    assert str(ei.value).startswith("config error: mode.auto=True")


def test_a_resumed_auto_run_trains_on_in_the_mode_its_bundle_was_saved_in(tmp_path: Path):
    """A requeue or resume_from of an auto run does not probe again mid-trajectory: the bundle's meta names its mode."""
    from control_fakes import FakeSink, FakeTransport, make_config, make_spec

    from flodl_exp import checkpoint as ck
    from flodl_exp.bundle_meta import Resume
    from flodl_exp.coordinator.coordinator import Coordinator
    from flodl_exp.protocol.messages import EvalResult, SaveResult

    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    evals, saves = h.final_saves()
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    meta = ck.load_meta(h.co.core.writer.stem)
    assert meta.mode == "cpu_sync" and meta.extra == {}
    spec = make_spec(make_config("nccl_cadence", 2, 2, **{"mode.auto": True}), tmp_path / "next", attempt=1,
                     resume=Resume(h.co.core.writer.stem, meta))
    sink = FakeSink()
    co = Coordinator(spec, FakeTransport(), None, sink, str(tmp_path), clock=h.clock)  # type: ignore[arg-type]
    assert co.auto is None and co.core.mode.name == "cpu_sync" and sink.tags["auto.choice"] == "cpu_sync"
