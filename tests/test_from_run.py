"""Issue 31, items 2 and 3: a run's measured rig and the simulator's prediction for it (flodl_exp/simulate/from_run.py),
from fixed values (no processes), the I/O edge on a fake client, and ``--from-run`` on a small store of
hand-made runs (one CLI process). The real run's ``predicted/*`` and its replay: tests/test_e2e_timeline.py."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from flodl_exp.simulate.__main__ import translate_argv
from flodl_exp.simulate.engine import simulate
from flodl_exp.simulate.from_run import (
    NotReplayable,
    adopt_auto_choice,
    error_pct,
    log_prediction,
    measured,
    measured_rig,
    predict,
    prediction_metrics,
    run_mode,
)
from flodl_exp.simulate.report import summarize
from flodl_exp.simulate.topology import LinkConfig, SimulateConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = 1_700_000_000_000  # ms

PARAMS = {"mode.name": "nccl_cadence", "mode.policy": "cadence", "mode.backend": "nccl", "mode.anchor": "10",
          "mode.max_overshoot": "None", "mode.gamma": "1.0", "experiment.batch_size": "16", "experiment.epochs": "3",
          "experiment.scheduler": "None", "guard.kind": "trend", "guard.threshold": "None", "outer.kind": "avg",
          "outer.lr": "None", "seed": "7", "cluster.name": "local_hetero"}


def history(epochs: int = 3, *, w: int = 2, step_ms: tuple[float, ...] = (9.0, 27.0), data_ms: float = 1.0,
            wall_s: float = 0.5, syncs: int = 2, sync_ms: float = 30.0) -> dict[str, list[tuple[int, float, int]]]:
    """A run's per-epoch metric points ``(step, value, timestamp_ms)``: epochs of ``wall_s`` end to end, rank r
    training in proportion to its speed."""
    speed = [1.0 / s for s in step_ms[:w]]
    total_b = 88
    h: dict[str, list[tuple[int, float, int]]] = {}

    def put(key: str, e: int, v: float) -> None:
        h.setdefault(key, []).append((e, v, T0 + int((e + 1) * wall_s * 1000)))

    for e in range(epochs):
        put("epoch_time_s", e, wall_s)
        put("samples", e, total_b * 16.0)
        put("syncs", e, float(syncs))
        put("sync_ms_avg", e, sync_ms)
        for r in range(w):
            b = round(total_b * speed[r] / sum(speed))
            put(f"rank{r}/batches", e, float(b))
            put(f"rank{r}/compute_only_ms", e, b * step_ms[r])
            put(f"rank{r}/data_starve_ms", e, b * data_ms)
    return h


def base() -> SimulateConfig:
    return SimulateConfig(link=LinkConfig(bandwidth_gbps=20.0, latency_ms=0.5, collective_fixed_ms=99.0,
                                          batch_message_ms=1.0), model_mb=0.86)


def test_measured_is_the_simulators_definition() -> None:
    m = measured(history())
    assert m["world_size"] == 2 and m["epochs"] == 3
    assert m["wall_s"] == pytest.approx(1.5)  # first epoch's start (its stamp - its wall) to the last one's stamp
    assert m["samples_per_s"] == pytest.approx(3 * 88 * 16 / 1.5)
    assert m["syncs"] == 6 and m["sync_ms"] == pytest.approx(30.0)
    assert m["share.rank0"] == pytest.approx(66 / 88) and m["share.rank1"] == pytest.approx(22 / 88)
    assert m["step_ms.rank0"] == pytest.approx(9.0) and m["step_ms.rank1"] == pytest.approx(27.0)
    assert m["data_ms.rank1"] == pytest.approx(1.0)


def test_a_resumed_epoch_counts_once_and_without_stamps_the_walls_add_up() -> None:
    h = history(2)
    h["samples"].append((1, 88 * 16.0, T0 + 5000))  # epoch 1 logged again (a resume)
    h = {k: [(s, v, 0) for s, v, _ in pts] for k, pts in h.items()}
    m = measured(h)
    assert m["samples"] == 2 * 88 * 16 and m["wall_s"] == pytest.approx(1.0)


def test_measured_rig_takes_the_runs_steps_data_and_knobs() -> None:
    params = {**PARAMS, "mode.anchor": "20", "guard.kind": "msf", "outer.kind": "slowmo", "outer.mu": "0.8"}
    rig = measured_rig(params, history(), {"total_picks": 1437, "stem": "/nowhere"}, base=base(), model_mb=0.04)
    assert [(g.count, g.step_ms, g.data_ms) for g in rig.ranks] == [(1, pytest.approx(9.0), pytest.approx(1.0)),
                                                                    (1, pytest.approx(27.0), pytest.approx(1.0))]
    assert (rig.samples, rig.batch_size, rig.epochs, rig.model_mb, rig.chunk_start_ms) == (1437, 16, 3, 0.04, 0.0)
    assert rig.modes == ["nccl_cadence"] and rig.mode == {"anchor": 20}  # only what differs from the preset
    assert rig.guard.kind == "msf" and rig.outer.kind == "slowmo" and rig.outer.mu == 0.8 and rig.seed == 7
    assert rig.link.latency_ms == 0.5 and rig.link.batch_message_ms == 1.0  # not measured: the base's
    # without result.json: the picks per epoch from the trained samples
    assert measured_rig(PARAMS, history(), None, base=base(), calibrate=False).samples == 88 * 16


def test_a_replayed_run_and_an_auto_probe_build_their_rig_alike() -> None:
    """from_run.measured_rig and auto.probe_rig share topology.measured_rig_config: the same times, data and knobs
    give the same ranks, link and data; the link is a copy (the replay fits its fixed cost)."""
    from flodl_exp.simulate.auto import probe_rig
    from flodl_exp.simulate.topology import measured_rig_config

    b = base()
    replay = measured_rig(PARAMS, history(), {"total_picks": 1437}, base=b, calibrate=False)
    probed = probe_rig({0: [90.0, 9.0, 9.0], 1: [90.0, 27.0, 27.0]}, {0: [5.0, 1.0, 1.0], 1: [5.0, 1.0, 1.0]},
                       model_bytes=860_000, samples=1437, batch_size=16, epochs=2, knobs={}, base=b,
                       guard=replay.guard, outer=replay.outer, seed=7)
    assert [(g.step_ms, g.data_ms) for g in probed.ranks] == [(pytest.approx(g.step_ms), pytest.approx(g.data_ms))
                                                              for g in replay.ranks]
    assert (probed.samples, probed.batch_size, probed.chunk_start_ms, probed.link, probed.seed) == \
        (replay.samples, replay.batch_size, 0.0, replay.link, 7)
    assert replay.link is not b.link and probed.link is not b.link
    rig = measured_rig_config(b, "x", [0.0, -1.0], [-2.0, 3.0], samples=10, batch_size=2, epochs=1)
    assert [(g.step_ms, g.data_ms) for g in rig.ranks] == [(1e-3, 0.0), (1e-3, 3.0)]  # clamped
    assert (rig.mode, rig.guard, rig.seed, rig.model_mb) == (b.mode, b.guard, b.seed, b.model_mb)  # unset: base's
    with pytest.raises(ValueError):
        measured_rig_config(b, "x", [1.0], [], samples=10, batch_size=2, epochs=1)


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_the_links_fixed_cost_is_fitted_to_the_measured_sync_ms(mode: str) -> None:
    params = {**PARAMS, "mode.name": mode, "mode.backend": mode.split("_")[0]}
    rig = measured_rig(params, history(sync_ms=40.0), None, base=base())
    assert 0 < rig.link.collective_fixed_ms < 40.0
    assert summarize(simulate(rig, mode), 0)["sync_ms"] == pytest.approx(40.0, rel=0.1)


def test_predict_and_the_error() -> None:
    rig = measured_rig(PARAMS, history(), {"total_picks": 1437}, base=base())
    p = predict(rig, "nccl_cadence")
    assert {"predicted/samples_per_s", "predicted/syncs", "predicted/share.rank0", "predicted/share.rank1"} <= set(p)
    assert p["predicted/share.rank0"] + p["predicted/share.rank1"] == pytest.approx(1.0)
    assert p["predicted/share.rank0"] > 0.6  # a 3:1 rig under cadence: the fast rank takes about three quarters
    assert p["predicted/syncs"] >= 1 and p["predicted/samples_per_s"] > 0
    out = prediction_metrics(PARAMS, history(), {"total_picks": 1437}, base=base())
    meas = measured(history())["samples_per_s"]
    assert out["predicted/error_pct"] == pytest.approx(100 * (meas - out["predicted/samples_per_s"])
                                                       / out["predicted/samples_per_s"])
    assert error_pct(110.0, 100.0) == pytest.approx(10.0)


def test_an_overlapped_run_is_replayed_with_overlap() -> None:
    """A run with ``mode.overlap`` is replayed as ``<mode>+overlap`` (the simulator runs its ranks overlapped), the key
    carried by the name, not as a knob applied to every simulated mode."""
    params = {**PARAMS, "mode.name": "cpu_cadence", "mode.policy": "cadence", "mode.backend": "cpu",
              "mode.overlap": "True"}
    rig = measured_rig(params, history(), {"total_picks": 1437}, base=base())
    assert rig.modes == ["cpu_cadence+overlap"] and "overlap" not in rig.mode
    out = prediction_metrics(params, history(), {"total_picks": 1437}, base=base())
    assert out["predicted/samples_per_s"] > 0
    auto = {**PARAMS, "mode.auto": "True"}
    adopt_auto_choice(auto, "cpu_async+overlap")  # mode=auto chose it: replayed in it
    assert run_mode(auto) == "cpu_async+overlap"


@pytest.mark.parametrize("hist, params, match", [
    ({}, PARAMS, "no epoch metrics"),
    (history(w=1, step_ms=(9.0,)), PARAMS, "world size is 1"),
    (history(), {**PARAMS, "mode.name": "nccl_async"}, "not one the simulator runs"),
    (history(), {**PARAMS, "experiment.batch_size": "None"}, "batch_size"),
])
def test_what_cannot_be_replayed_says_why(hist: Any, params: dict, match: str) -> None:
    with pytest.raises(NotReplayable, match=match):
        measured_rig(params, hist, None, base=base())


def test_translate_argv() -> None:
    assert translate_argv(["--from-run", "abc", "epochs=2"]) == ["from_run=abc", "epochs=2"]
    assert translate_argv(["--from-run=abc"]) == ["from_run=abc"]
    assert translate_argv(["--from-run"]) == ["--from-run"]  # no value: Hydra refuses it


class FakeClient:
    """The MlflowClient calls the edge makes, on fixed values."""

    def __init__(self, params: dict, hist: dict) -> None:
        self.hist = hist
        self.logged: list[Any] = []
        metrics = {k: pts[-1][1] for k, pts in hist.items()}
        self.run = SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics, tags={}),
                                   info=SimpleNamespace(status="FINISHED", run_name="r"))

    def get_run(self, run_id: str) -> Any:
        return self.run

    def get_metric_history(self, run_id: str, key: str) -> list:
        return [SimpleNamespace(step=s, value=v, timestamp=t) for s, v, t in self.hist[key]]

    def download_artifacts(self, run_id: str, path: str, dst: str) -> str:
        raise OSError("no artifacts here")

    def log_batch(self, run_id: str, metrics: list) -> None:
        self.logged += metrics


def test_log_prediction_logs_predicted_metrics_at_the_last_epoch(caplog: pytest.LogCaptureFixture) -> None:
    c = FakeClient(PARAMS, history())
    logger = logging.getLogger("flodl_exp.coordinator")
    before = logger.level
    with caplog.at_level(logging.INFO):
        out = log_prediction(c, "r", {"total_picks": 1437})
    # the simulated core's lines (anchor changes ...) would read as the run's own in the launching process
    assert not [r for r in caplog.records if r.name == "flodl_exp.coordinator"] and logger.level == before
    logged = {m.key: (m.value, m.step) for m in c.logged}
    assert {"predicted/samples_per_s", "predicted/syncs", "predicted/share.rank0", "predicted/share.rank1",
            "predicted/error_pct"} <= set(logged)
    assert {step for _, step in logged.values()} == {2}
    assert logged["predicted/samples_per_s"][0] == pytest.approx(out["predicted/samples_per_s"])
    assert out["measured/samples_per_s"] == pytest.approx(measured(history())["samples_per_s"])


@pytest.mark.e2e  # a CLI process that imports torch, and an MLflow store
def test_cli_from_run_replays_a_run_and_refuses_bad_input(tmp_path) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    exp = c.create_experiment("e", artifact_location=str(tmp_path / "art"))

    def make(params: dict, hist: dict) -> str:
        rid = c.create_run(exp).info.run_id
        c.log_batch(rid, params=[Param(k, v) for k, v in params.items()],
                    metrics=[Metric(k, v, t, s) for k, pts in hist.items() for s, v, t in pts])
        c.set_terminated(rid, "FINISHED")
        return rid

    good, solo, empty = make(PARAMS, history()), make(PARAMS, history(w=1, step_ms=(9.0,))), make(PARAMS, {})

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flodl_exp.simulate", *args, f"tracking.uri={uri}"], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=180)

    r = cli("--from-run", good, f"out={tmp_path}/sim")
    assert r.returncode == 0, r.stderr
    assert f"Replay of MLflow run `{good}`" in r.stdout and "| run | wall s | samples/s |" in r.stdout
    for mode in ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"):
        assert f"| {mode} |" in r.stdout
    assert "The run's own mode nccl_cadence: predicted" in r.stdout
    assert (tmp_path / "sim" / "report.md").exists() and (tmp_path / "sim" / "report.png").exists()
    for rid, said in (("0123abcd", "no run 0123abcd"), (solo, "world size is 1"), (empty, "no epoch metrics")):
        r = cli(f"--from-run={rid}")
        assert r.returncode == 2, r.stdout
        lines = [x for x in r.stderr.splitlines() if x.strip() and " INFO " not in x]
        assert len(lines) == 1 and said in lines[0] and lines[0].startswith("simulate --from-run:"), r.stderr
