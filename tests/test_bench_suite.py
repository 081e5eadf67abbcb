"""The benchmark suite (python -m flodl_exp.bench): its report math on synthetic rows, its config and plan, and
one end-to-end ``--quick`` run into a fresh store (every section for one model of each kind, parent/child runs; the
plan of every model of the zoo is checked without running it, and each zoo model trains in test_zoo_models)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_exp.bench.collect import anchors_from_log, epoch_windows, make_row, timeline_fields
from flodl_exp.bench.plots import write_plots
from flodl_exp.bench.report import (
    SECTIONS,
    BenchRow,
    anchor_changes,
    best_mode,
    build_markdown,
    epoch_overlap,
    eval_delta,
    eval_key,
    idle_rows,
    intervals_ms,
    loss_ratio,
    percentile,
    sections_of,
    speedup,
)
from flodl_exp.bench.suite import ZOO, BenchConfig, plan, spec_for
from flodl_exp.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def row(run: str, ev: float | None = None, total: float = 1.0, *, key: str = "eval/accuracy", model: str = "m",
        losses: tuple[float, ...] = (1.0, 0.5), world: int = 2, status: str = "FINISHED", **kw) -> BenchRow:
    n = len(losses)
    return BenchRow(model=model, run=run, status=status, world_size=world,
                    losses=list(enumerate(losses)), epoch_times=[(e, total / n) for e in range(n)],
                    evals={} if ev is None else {key: ev}, **kw)


# -- best mode ----------------------------------------------------------------------------
def picked(rows: list[BenchRow], key: str | None) -> tuple[BenchRow, BenchRow]:
    """best_mode's (best, fastest close to the best), both asserted present."""
    got = best_mode(rows, key)
    assert got is not None and got[1] is not None, got
    return got[0], got[1]


def test_best_mode_fastest_within_two_percent_of_solo_fast():
    rows = [row("solo_fast", 0.90, 10.0), row("ddp", 0.91, 8.0), row("cpu_async", 0.885, 5.0),
            row("nccl_sync", 0.85, 3.0)]
    best, fast = picked(rows, eval_key(rows))
    assert best.run == "ddp"  # best eval
    assert fast.run == "cpu_async"  # 0.885 >= 0.90 x 0.98 = 0.882; nccl_sync is faster but 5.6 % worse


def test_best_mode_lower_is_better_for_mse_and_loss():
    rows = [row("solo_fast", 0.100, 10.0, key="eval/mse"), row("a", 0.1019, 2.0, key="eval/mse"),
            row("b", 0.090, 9.0, key="eval/mse"), row("c", 0.103, 1.0, key="eval/mse")]
    assert eval_key(rows) == "eval/mse"
    best, fast = picked(rows, "eval/mse")
    assert (best.run, fast.run) == ("b", "a")  # c is 3 % worse than solo_fast


def test_best_mode_without_solo_fast_uses_the_best_eval_and_skips_failed_rows():
    rows = [row("ddp", 0.90, 4.0), row("cpu_async", 0.89, 2.0), row("nccl_sync", 0.99, 1.0, status="FAILED")]
    best, fast = picked(rows, "eval/accuracy")
    assert (best.run, fast.run) == ("ddp", "cpu_async")
    assert best_mode([row("ddp")], None) is None


def test_eval_key_prefers_accuracy_then_mse_then_loss():
    assert eval_key([row("a", 1.0, key="eval/loss"), row("b", 0.5, key="eval/accuracy")]) == "eval/accuracy"
    assert eval_key([row("a", 1.0, key="eval/loss"), row("b", 0.5, key="eval/mse")]) == "eval/mse"
    assert eval_key([row("a")]) is None


# -- ratios -----------------------------------------------------------------------------------
def test_speedup_loss_ratio_and_eval_delta_vs_solo_fast():
    ref = row("solo_fast", 0.90, 10.0, losses=(1.0, 0.2))
    r = row("cpu_async", 0.92, 4.0, losses=(1.0, 0.3))
    assert speedup(r, ref) == pytest.approx(2.5)
    assert loss_ratio(r, ref) == pytest.approx(1.5)
    assert eval_delta(r, ref, "eval/accuracy") == pytest.approx(0.02)
    assert speedup(row("x", total=4.0, losses=(1.0, 0.5, 0.2)), ref) is None  # unequal epochs: no ratio
    assert speedup(r, None) is None and loss_ratio(r, None) is None
    assert speedup(row("x", status="FAILED"), ref) is None


# -- ElChe calibration ------------------------------------------------------------------------
def test_percentile_is_linear_between_closest_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_sync_intervals_and_anchor_changes():
    assert intervals_ms([0.3, 0.1, 0.15]) == pytest.approx([50.0, 150.0])
    assert intervals_ms([1.0]) == []
    log = "x INFO anchor 10 -> 20\ny INFO anchor 20 -> 15\n"
    assert anchors_from_log(log, 10.0) == [10.0, 20.0, 15.0]
    assert anchors_from_log("nothing", 10.0) == [10.0]
    assert anchor_changes([10.0, 20.0, 20.0, 15.0]) == 2 and anchor_changes(None) is None


# -- streaming overlap ----------------------------------------------------------------------------
def test_epoch_overlap_counts_time_two_epochs_are_in_flight():
    assert epoch_overlap([(0.0, 1.0), (0.8, 2.0), (2.0, 3.0)]) == pytest.approx((0.2, 3.0))
    assert epoch_overlap([(0.0, 1.0), (1.0, 2.0)]) == (0.0, 2.0)
    assert epoch_overlap([(0.0, 1.0), (0.9995, 2.0)])[0] == 0.0  # ms rounding of event times is no overlap
    assert epoch_overlap([]) == (0.0, 0.0)
    assert epoch_overlap([(0.0, 3.0), (1.0, 2.0)]) == pytest.approx((1.0, 3.0))  # nested: the inner one overlaps


def test_total_is_the_training_wall_when_epoch_windows_are_known():
    r = row("cpu_async", total=4.0, epoch_windows=[(0.0, 2.5), (2.0, 3.5)])
    assert r.total_s == pytest.approx(3.5)  # Σ epoch_time_s = 4.0 counts the 0.5 s overlap twice
    assert row("x", total=4.0).total_s == pytest.approx(4.0)


def test_epoch_windows_from_events():
    evs = [{"event": "started", "t": 1.0}, {"event": "epoch", "epoch": 0, "t": 3.0, "epoch_time_s": 2.0},
           {"event": "epoch", "epoch": 1, "t": 4.0, "epoch_time_s": 1.5}]
    assert epoch_windows(evs) == [(1.0, 3.0), (2.5, 4.0)]


# -- rows from a run's files ------------------------------------------------------------------------
TIMELINE = {
    "columns": ["rank", "kind", "start_s", "end_s", "epoch", "window", "n", "busy_ms", "data_ms", "note"],
    "spans": [[0, "compute", 0.0, 0.1, 0, 0, 3, 90.0, 1.0, ""],
              [0, "sync", 0.10, 0.12, None, 0, 1, 0.0, 0.0, ""], [1, "sync", 0.11, 0.12, None, 0, 1, 0.0, 0.0, ""],
              [0, "cpu_avg", 0.12, 0.13, None, 0, 1, 0.0, 0.0, ""], [1, "cpu_avg", 0.12, 0.13, None, 0, 1, 0.0, 0.0, ""],
              [0, "sync", 0.30, 0.31, None, 1, 1, 0.0, 0.0, "final"], [0, "cpu_avg", 0.31, 0.33, None, 1, 1, 0.0, 0.0, ""]],
    "epochs": [{"epoch": 0, "start_s": 0.0, "end_s": 0.2}, {"epoch": 1, "start_s": 0.15, "end_s": 0.35}],
    "idle_analysis": {"ranks": {"1": {"idle_by_cause_s": {"sync": 0.5, "short": 0.1}},
                                "0": {"idle_by_cause_s": {"epoch_boundary": 0.2}}}},
}


def test_timeline_fields_one_start_per_reduce_and_idle_by_rank():
    tf = timeline_fields(TIMELINE)
    assert tf["sync_starts"] == pytest.approx([0.10, 0.30])  # the earliest member's span per window
    assert tf["cpu_avg_ms"] == pytest.approx([10.0, 20.0])
    assert tf["epoch_windows"] == [(0.0, 0.2), (0.15, 0.35)]
    assert tf["idle_by_cause"] == [{"epoch_boundary": 0.2}, {"sync": 0.5, "short": 0.1}]


def test_make_row_reads_metrics_timeline_and_throttle_rule():
    tags = {"bench.model": "mlp", "bench.run": "cpu_async", "bench.kind": "flodl", "world_size": "2", "backend": "cpu",
            "mode": "cpu_async"}
    hist = {"loss": [(0, 2.0), (1, 1.0)], "epoch_time_s": [(0, 1.0), (1, 2.0)], "syncs": [(0, 2.0), (1, 2.0)],
            "sync_ms_avg": [(0, 10.0), (1, 20.0)], "anchor": [(0, 10.0), (1, 20.0)], "eval/accuracy": [(1, 0.9)],
            "rank0/idle_frac": [(0, 0.5), (1, 0.0)], "rank1/idle_frac": [(0, 0.0), (1, 0.25)]}
    r = make_row(tags, "FINISHED", hist, [], TIMELINE, "anchor 10 -> 14\nanchor 14 -> 20\n", {"mode.backend": "cpu",
                                                                                              "mode.max_batch_diff": "None"})
    assert (r.model, r.run, r.syncs, r.final_loss) == ("mlp", "cpu_async", 4.0, 1.0)
    assert r.total_s == pytest.approx(0.35)  # the timeline's epoch windows: 0.0 -> 0.35
    assert r.sync_ms_avg == pytest.approx(15.0) and r.evals == {"eval/accuracy": 0.9}
    assert r.idle_s == pytest.approx([0.5, 0.5]) and r.util == pytest.approx([0.75, 0.875])
    assert r.anchors == [10.0, 14.0, 20.0] and r.throttles == 0
    assert r.cpu_avg_ms == pytest.approx([10.0, 20.0]) and r.epoch_windows == [(0.0, 0.2), (0.15, 0.35)]
    assert [x[1] for x in idle_rows(r)] == pytest.approx([0.2, 0.6]) and idle_rows(r)[0][3] == "timeline"
    r2 = make_row(tags, "FINISHED", hist, [], None, None, {"mode.backend": "cpu", "mode.max_batch_diff": "4"})
    assert r2.throttles is None and r2.anchors == [10.0, 20.0] and r2.idle_by_cause is None  # no log: metric history
    ddp = make_row({**tags, "bench.kind": "torch", "bench.run": "ddp"}, "FINISHED", hist, [], None, None)
    assert ddp.anchors is None and idle_rows(ddp)[1] == (1, pytest.approx(0.5), {}, "idle_frac")


# -- the markdown -----------------------------------------------------------------------------
def _suite_rows(models=("a", "b")) -> list[BenchRow]:
    rows = []
    for m in models:
        rows += [row("solo_fast", 0.9, 4.0, model=m, world=1, kind="torch"),
                 row("solo_slow", 0.9, 12.0, model=m, world=1, kind="torch"),
                 row("ddp", 0.91, 6.0, model=m, kind="torch"),
                 row("cpu_async", 0.89, 3.0, model=m, anchors=[10.0, 20.0], throttles=0, sync_starts=[0.1, 0.2, 0.4],
                     cpu_avg_ms=[5.0, 7.0], epoch_windows=[(0.0, 1.6), (1.4, 3.0)],
                     idle_by_cause=[{"sync": 0.1}, {"epoch_boundary": 0.3}])]
    return rows


def test_markdown_has_every_section_for_every_model(tmp_path):
    rows = _suite_rows()
    md = build_markdown(rows, title="t", models=["a", "b"])
    secs = sections_of(md)
    for m in ("a", "b"):
        assert f"Model `{m}`" in secs and f"`{m}`: per-epoch loss trajectory" in secs[f"Model `{m}`"]
        for s in SECTIONS:
            assert f"| {m} |" in secs[s], f"{s}: no row for {m}"
    assert "| a | 0.90 (eval/accuracy) |" not in md and "91.00% (eval/accuracy) | ddp | 3.00 s (89.00%) | cpu_async |" in md
    assert "| a | cpu_async | 1 | 20 | 0 | 0 | 0.0 | 150.0 | 195.0 | 2 | 6.0 |" in secs["ElChe calibration"]
    assert "| a | cpu_async | 2 | 0.20 | 6.7% | 3.00 |" in secs["Streaming epoch overlap"]
    assert "1.33×" in secs["Speedup vs solo_fast"] and "Speed ratio (solo_slow total / solo_fast total): a 3.00" in md
    paths = write_plots(rows, str(tmp_path), ["a", "b"])
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_markdown_keeps_a_model_without_runs_and_marks_failures():
    rows = [row("solo_fast", 0.9, model="a", world=1), row("cpu_async", None, model="a", status="FAILED", losses=())]
    md = build_markdown(rows, title="t", models=["a", "z"])
    assert "## Model `z`" in md and "cpu_async [FAILED]" in md and math.isfinite(rows[0].total_s)


# -- config and plan ----------------------------------------------------------------------------
def _compose(overrides: list[str]) -> BenchConfig:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flodl_exp.bench.suite import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "bench"), version_base="1.3"):
        d = compose("config", overrides=overrides)
    d.out_dir = "x"  # ${hydra:run.dir} resolves inside the app only
    obj = OmegaConf.to_object(d)
    assert isinstance(obj, BenchConfig)
    return obj


def test_quick_and_full_presets_plan_every_model():
    from flodl_exp.bench.__main__ import translate_argv

    assert translate_argv(["--quick", "models=[mlp]"]) == ["preset=quick", "models=[mlp]"]
    quick, full = _compose(["preset=quick"]), _compose([])
    assert quick.name == "quick" and full.name == "full"
    q, f = plan(quick), plan(full)
    assert {s.model for s in q} == set(ZOO) == {s.model for s in f}
    assert len(f) == 7 * 9 and {s.name for s in f} >= {"ddp", "nccl_cadence+diloco", "cpu_sync"}
    assert [s.name for s in q if s.model == "mlp"] == ["solo_fast", "solo_slow", "ddp", "cpu_async"]
    assert all(s.kind == "torch" for s in q if s.name != "cpu_async")  # solo=torch in quick
    assert spec_for(full, "mlp", "solo_slow").overrides[-1] == "cluster.rank_speeds=[0.33]"
    assert "outer=diloco" in spec_for(full, "mlp", "nccl_cadence+diloco").overrides


def test_bad_run_names_and_knobs_are_one_line_errors():
    with pytest.raises(ConfigError, match="runs entry 'nccl_async'"):
        plan(BenchConfig(runs=["nccl_async"]))
    with pytest.raises(ConfigError, match="cpu_sync\\+adam"):
        plan(BenchConfig(runs=["cpu_sync+adam"]))
    with pytest.raises(ConfigError, match="rank_speeds"):
        plan(BenchConfig(rank_speeds=[1.0]))
    with pytest.raises(ConfigError, match="solo="):
        plan(BenchConfig(solo="jax"))


# -- end to end ---------------------------------------------------------------------------------------
KINDS = ("mlp", "gpt_nano", "conv_ae")
"""The end-to-end run's models: a classifier, a language model and an autoencoder (each kind's metrics and rows;
the seven models' full ``--quick`` takes over two minutes of make test)."""


@pytest.mark.e2e
@pytest.mark.timeout(560)
def test_quick_bench_reports_every_section_for_each_kind_of_model(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flodl_exp.bench", "--quick", f"models=[{','.join(KINDS)}]",
                        f"tracking.uri={uri}", f"out_dir={out}", f"hydra.run.dir={tmp_path}/hydra"],
                       cwd=ROOT, capture_output=True, text=True, timeout=540)
    wall = time.monotonic() - t0
    assert r.returncode == 0, f"exit {r.returncode} after {wall:.0f} s\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    md = (out / "report.md").read_text()
    secs = sections_of(md)
    for m in KINDS:
        body = secs[f"Model `{m}`"]
        for run in ("solo_fast", "solo_slow", "ddp", "cpu_async"):
            assert f"| {run} |" in body, f"{m}: no {run} row"
        assert "per-epoch loss trajectory" in body
        for s in SECTIONS:
            assert f"| {m} |" in secs[s], f"section {s!r} has no row for {m}"
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("flodl_bench")
    assert exp is not None
    parents = c.search_runs([exp.experiment_id], "tags.`flodl.bench` = 'parent'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    pid = parents[0].info.run_id
    children = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{pid}'")
    assert len(children) == len(KINDS) * 4 and all(ch.info.status == "FINISHED" for ch in children)
    assert {ch.data.tags["bench.model"] for ch in children} == set(KINDS)
    assert {a.path for a in c.list_artifacts(pid, "report")} == {f"report/{p}" for p in
                                                                 ("report.md", "loss_vs_time.png", "speedup.png", "idle.png")}
    print(f"quick bench: {wall:.1f} s")


# -- the runner's schedule (fakes: no process, no store) -------------------------------------------------
@pytest.mark.parametrize("parallel", [1, 2])
def test_run_all_keeps_order_overlaps_only_when_parallel_and_records_failures(monkeypatch, parallel):
    from flodl_exp.bench import runner

    log: list[str] = []

    class FakeHandle:
        def __init__(self, name: str) -> None:
            self.name, self.polls = name, 0

        def done(self) -> bool:
            self.polls += 1
            return self.polls > 2

    def start(cfg, spec, parent, out):
        if spec.model == "bad":
            raise RuntimeError("launch refused")
        log.append(f"start {spec.label}")
        return runner.Pending(spec, FakeHandle(spec.label), time.monotonic(), time.monotonic() + 60)

    def finish(p, timeout_s):
        log.append(f"end {p.spec.label}")
        return runner.RunRecord(p.spec, "id", "FINISHED", "", 0.0)

    def torch_run(cfg, spec, parent, out):
        log.append(f"torch {spec.label}")
        return runner.RunRecord(spec, "id", "FINISHED", "", 0.0)

    monkeypatch.setattr(runner, "start_flodl", start)
    monkeypatch.setattr(runner, "finish_flodl", finish)
    monkeypatch.setattr(runner, "run_torch_entry", torch_run)
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    cfg = BenchConfig(models=["a", "bad"], runs=["cpu_async", "ddp"], parallel=parallel)
    specs = plan(cfg)  # a/ddp, a/cpu_async, bad/ddp, bad/cpu_async
    specs = [specs[1], specs[0], specs[3], specs[2]]  # flodl first: does the torch run wait for it?
    recs = runner.run_all(cfg, specs, "parent", "/nowhere")
    assert [r.spec.label for r in recs] == [s.label for s in specs]
    assert [r.status for r in recs] == ["FINISHED", "FINISHED", "FAILED", "FINISHED"]
    assert "launch refused" in recs[2].error
    overlapped = log.index("torch a/ddp") < log.index("end a/cpu_async")
    assert overlapped == (parallel > 1)
