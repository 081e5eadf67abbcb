"""Benchmark report (flodl_exp.report) against a hand-built MLflow store: no training runs.

One SQLite store per module (creating one costs ~3-4 s). Numbers are chosen so
every column has a known value: solo eval 95.00 %, nccl_sync 95.50 % (best,
8 s), cpu_cadence 95.20 % (within 2 %, 5 s: the fastest near-best), cpu_async
90.00 % (fastest overall but outside 2 %).
"""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_exp import report as rep
from flodl_exp import reporting

ROOT = Path(__file__).resolve().parents[1]
EXP = "bench"
EPOCHS = 4


def _log_run(c, exp_id: str, *, mode: str, ws: int, eval_acc: float | None, epoch_s: float, idle: list[float],
             shares: list[float], start: int, experiment: str = "digits_mlp", parent: str | None = None,
             loss0: float = 2.0) -> str:
    from mlflow.entities import Metric

    tags = {"mode": mode, "policy": mode.split("_")[-1], "backend": mode.split("_")[0], "guard": "trend", "cluster": "local",
            "world_size": str(ws), "experiment": experiment, "git_commit": "0123456789abcdef", "job_id": str(start)}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = c.create_run(exp_id, start_time=start, tags=tags, run_name=mode)
    rid, ts, ms = run.info.run_id, start, []
    for e in range(EPOCHS):
        m = {"loss": loss0 / (e + 1), "epoch_time_s": epoch_s, "samples_per_s": 1000.0 / epoch_s,
             "syncs": 0.0 if ws == 1 else 10.0, "sync_ms_avg": 0.0 if ws == 1 else 4.0 + e,
             "alive_ranks": float(ws), "anchor": 10.0, "global_step": 100.0 * (e + 1)}
        for r in range(ws):
            m |= {f"rank{r}/idle_frac": idle[r], f"rank{r}/batch_share": shares[r], f"rank{r}/samples_per_s": 500.0,
                  f"rank{r}/loss": m["loss"]}
        if eval_acc is not None:
            m |= {"eval/accuracy": eval_acc - 0.01 * (EPOCHS - 1 - e), "eval/loss": 0.3}
        ms += [Metric(k, v, ts + e, e) for k, v in m.items()]
    c.log_batch(rid, metrics=ms)
    c.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("report_store")
    uri = f"sqlite:///{d}/mlflow.db"
    c = MlflowClient(tracking_uri=uri)
    exp_id = c.create_experiment(EXP, artifact_location=(d / "artifacts").as_uri())
    c.create_experiment("empty", artifact_location=(d / "artifacts_empty").as_uri())
    parent = c.create_run(exp_id, run_name="sweep", tags={"sweep": "1"}).info.run_id
    ids = {
        "solo": _log_run(c, exp_id, mode="cpu_sync", ws=1, eval_acc=0.95, epoch_s=2.5, idle=[0.1], shares=[1.0], start=1000),
        "old_cadence": _log_run(c, exp_id, mode="cpu_cadence", ws=2, eval_acc=0.5, epoch_s=9.0, idle=[0.5, 0.5],
                                shares=[0.5, 0.5], start=1500, loss0=9.0),
        "nccl_sync": _log_run(c, exp_id, mode="nccl_sync", ws=2, eval_acc=0.955, epoch_s=2.0, idle=[0.1, 0.4],
                              shares=[0.5, 0.5], start=2000, parent=parent),
        "cpu_cadence": _log_run(c, exp_id, mode="cpu_cadence", ws=2, eval_acc=0.952, epoch_s=1.25, idle=[0.2, 0.05],
                                shares=[0.6, 0.4], start=3000, parent=parent, loss0=2.5),
        "cpu_async": _log_run(c, exp_id, mode="cpu_async", ws=2, eval_acc=0.90, epoch_s=1.0, idle=[0.0, 0.1],
                              shares=[0.7, 0.3], start=4000, parent=parent, loss0=3.0),
        "lenet": _log_run(c, exp_id, mode="cpu_cadence", ws=2, eval_acc=None, epoch_s=1.0, idle=[0.1, 0.1],
                          shares=[0.5, 0.5], start=5000, experiment="digits_lenet"),
    }
    return {"dir": d, "uri": uri, "parent": parent, "ids": ids, "client": c}


@pytest.fixture(scope="module")
def full(store, tmp_path_factory) -> tuple[str, str]:
    """Report over the whole experiment, generated in-process: (path, markdown)."""
    out = tmp_path_factory.mktemp("full")
    path = rep.generate_report(EXP, store["uri"], str(out))
    return path, Path(path).read_text()


def _row(md: str, label: str) -> list[str]:
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _section(md: str, exp: str) -> str:
    """One experiment's part of the report (up to the next experiment or the best-mode table)."""
    return md.split(f"## Experiment `{exp}`")[1].split("\n## ")[0]


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return False
    w, h = struct.unpack(">II", data[16:24])
    return w > 100 and h > 100 and data.endswith(b"IEND\xaeB`\x82")


def test_main_table_rows_and_columns(full):
    path, md = full
    assert os.path.isabs(path) and path.endswith("report.md")
    md = _section(md, "digits_mlp")
    head = _row(md, "Mode")
    assert head[:8] == ["Mode", "Ranks", "Final loss", "Eval acc", "Δ vs solo", "Total s", "Syncs", "Avg sync ms"]
    assert head[8:] == ["R0 util", "R1 util", "R0 idle s", "R1 idle s"]
    solo = _row(md, "solo (cpu_sync)")
    assert solo[1:6] == ["1", "0.5000", "95.00%", "—", "10.0"] and solo[6] == "0"
    assert solo[8:] == ["90%", "—", "1.00", "—"]
    cad = _row(md, "cpu_cadence")  # the latest cpu_cadence run, not the older duplicate
    assert cad[:8] == ["cpu_cadence", "2", "0.6250", "95.20%", "+0.20 pp", "5.00", "40", "5.5"]
    assert cad[8:] == ["80%", "95%", "1.00", "0.25"]  # util = 1 - idle; idle s = Σ idle_frac · epoch_time_s
    assert _row(md, "nccl_sync")[4] == "+0.50 pp"
    assert _row(md, "cpu_async")[4] == "-5.00 pp"
    assert "1 older duplicate run(s) not shown" in full[1]
    order = [md.index(f"| {m} |") for m in ("solo (cpu_sync)", "nccl_sync", "cpu_cadence", "cpu_async")]
    assert order == sorted(order)


def test_best_mode_speedup_and_trajectory(full):
    _, whole = full
    best = _row(whole, "digits_mlp")
    md = _section(whole, "digits_mlp")
    assert best == ["digits_mlp", "95.50%", "nccl_sync", "5.00 s (95.20%)", "cpu_cadence"]
    assert "| cpu_async | 2.50× | 1.50 |" in md  # speedup 10/4, loss ratio 0.75/0.5
    traj = md.split("### Per-epoch loss trajectory")[1].split("##")[0]
    assert "| Epoch | solo (cpu_sync) | nccl_sync | cpu_cadence | cpu_async |" in traj
    # epochs counted from 1, as the console counts them (MLflow steps 0-3)
    assert [ln.split("|")[1].strip() for ln in traj.splitlines() if ln.startswith("| ") and ln[2].isdigit()] == ["1", "2", "3", "4"]
    assert "- Epochs count from 1, as the console does (MLflow's step is the 0-based index: epoch 1 is step 0)." in whole


def test_experiment_without_solo_or_eval(full):
    _, md = full
    section = _section(md, "digits_lenet")
    assert "Δ vs solo" not in section and "| cpu_cadence | 2 | 0.5000 | — |" in section
    assert "| digits_lenet |" not in md.split("## Best mode per experiment")[1]


def test_plots_are_valid_pngs(full):
    out = Path(full[0]).parent
    for name in rep.PLOTS:
        assert _is_png(out / name), name
        assert f"]({name})" in full[1]


@pytest.mark.e2e  # the report's CLI in a subprocess (imports mlflow and torch): make test, not make test-fast
def test_cli_parent_run_logs_artifacts(store, tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "flodl_exp.report", "--experiment", EXP, "--parent-run", store["parent"],
                        "--tracking-uri", store["uri"], "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out / "report.md")
    md = (out / "report.md").read_text()
    assert all(f"| {m} |" in md for m in ("nccl_sync", "cpu_cadence", "cpu_async"))
    assert "solo" not in md and "Δ vs solo" not in md and "digits_lenet" not in md  # children only
    assert "older duplicate" not in md
    names = {os.path.basename(a.path) for a in store["client"].list_artifacts(store["parent"], "report")}
    assert names == {"report.md", *rep.PLOTS}


@pytest.mark.parametrize("args,needle", [
    (["--experiment", "nope"], "unknown experiment 'nope': the store has Default, bench, empty"),
    (["--experiment", "empty"], "no runs with training metrics in experiment 'empty'"),
    (["--experiment", EXP, "--parent-run", "0" * 32], "unknown parent run"),
])
def test_error_paths_exit_2(store, tmp_path, capsys, args, needle):
    rc = rep.main([*args, "--tracking-uri", store["uri"], "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "o").exists()


def test_batch_share_plot_counts_epochs_from_1(store, tmp_path):
    rows, _ = rep.select_runs(rep.load_runs(store["client"], EXP))
    fig = rep.plot_batch_share(rows, str(tmp_path / "share.png"))
    xs = {float(x) for ax in fig.axes if ax.get_visible() for line in ax.get_lines()
          if str(line.get_label()).startswith("rank ") for x in line.get_xdata()}  # not the 1/world_size guide line
    assert xs == {1.0, 2.0, 3.0, 4.0}, xs
    assert all(float(t).is_integer() for ax in fig.axes if ax.get_visible() for t in ax.get_xticks())


def test_missing_store_is_an_error_and_creates_nothing(tmp_path, capsys):
    db = tmp_path / "absent.db"
    assert rep.main(["--experiment", EXP, "--tracking-uri", f"sqlite:///{db}"]) == 2
    assert "no MLflow store" in capsys.readouterr().err and not db.exists()


def test_default_out_dir_under_cwd(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = rep.generate_report(EXP, store["uri"], parent_run_id=None)
    assert path == str(tmp_path / "outputs" / "reports" / EXP / "report.md")


# -- pure pieces ------------------------------------------------------------------
def _rd(**hist) -> rep.RunData:
    return rep.RunData("r", {"mode": "cpu_async", "world_size": "2", "experiment": "x"},
                       history={k.replace("__", "/"): list(enumerate(v)) for k, v in hist.items()})


def test_summarize_weights_sync_ms_and_reports_lost_ranks():
    s = rep.summarize(_rd(loss=[1.0, 0.5], epoch_time_s=[1.0, 3.0], syncs=[1, 3], sync_ms_avg=[10.0, 2.0],
                          rank0__idle_frac=[0.5, 0.0], rank1__idle_frac=[0.0, 0.5], alive_ranks=[2, 1]), None)
    assert s.total_s == 4.0 and s.syncs == 4 and s.sync_ms_avg == pytest.approx(4.0)
    assert s.util == [0.75, 0.75] and s.idle_s == [0.5, 1.5] and s.eval_value is None
    md = "\n".join(rep.experiment_section("x", [s], None))
    assert "| cpu_async | 2 (1 alive) | 0.5000 | — |" in md and "Eval loss" in md


def test_best_modes_lower_is_better_for_eval_loss():
    def row(label, ev, t):
        s = rep.summarize(_rd(loss=[1.0], epoch_time_s=[t], eval__loss=[ev]), "eval/loss")
        s.label = label
        return s
    picked = rep.best_modes([row("a", 0.50, 10), row("b", 0.505, 3), row("c", 0.6, 1)], higher_better=False)
    assert picked is not None
    best, fast = picked
    assert (best.label, fast.label) == ("a", "b")
    assert rep.best_modes([row("n", math.nan, 1)], higher_better=False) is None


def test_trajectory_sampling_keeps_first_and_last():
    assert reporting.sampled(5) == [0, 1, 2, 3, 4]
    s = reporting.sampled(200)
    assert s[0] == 0 and s[-1] == 199 and len(s) == reporting.MAX_TRAJECTORY_ROWS
