"""`python -m flodl_exp.simulate.validate`: predicted against measured, from a run's job folder and store.

The job folder and the store are written here in the shapes the runner writes (an events.jsonl with `started`
and `epoch` lines; MLflow's `runs` and `metrics` tables), so the test needs no real run."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from flodl_exp.simulate import validate


def _fake_run(root: Path, name: str = "r3to1_cpu_async") -> tuple[Path, Path]:
    job = root / "jobs" / name / "0"
    job.mkdir(parents=True)
    lines = [{"event": "started", "t": 1.0, "world_size": 2}]
    for e in range(2):
        lines.append({"event": "epoch", "epoch": e, "t": 2.0 + e, "samples": 1437, "syncs": 8,
                      "sync_ms_avg": 30.0, "rank0/batch_share": 0.8})
    (job / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    db = root / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table runs (run_uuid text, name text)")
    con.execute("create table metrics (run_uuid text, key text, value real)")
    con.execute("insert into runs values ('u1', ?)", (f"sim/{name}",))
    for r, (nb, ms) in enumerate([(144, 7.0), (36, 30.0)]):
        con.executemany("insert into metrics values ('u1', ?, ?)",
                        [(f"rank{r}/batches", nb), (f"rank{r}/compute_only_ms", nb * ms), (f"rank{r}/data_starve_ms", 0.0)])
    con.commit()
    con.close()
    return root / "jobs", db


def test_measured_reads_the_bench_numbers_and_per_rank_times(tmp_path: Path) -> None:
    jobs, db = _fake_run(tmp_path)
    m = validate.measured(str(jobs / "r3to1_cpu_async"), str(db), "sim/r3to1_cpu_async")
    assert m is not None
    assert m["samples_per_s"] == 2 * 1437 / 2.0 and m["syncs"] == 16 and m["epochs"] == 2
    assert m["step_ms"] == [7.0, 30.0] and m["fast_share"] == 0.8


def test_the_table_has_a_row_per_run_and_set_changes_the_prediction(tmp_path: Path) -> None:
    jobs, db = _fake_run(tmp_path)
    base = validate.table(str(jobs), str(db))
    rows = [ln for ln in base.splitlines() if ln.startswith("| 3to1 | cpu_async |")]
    assert len(rows) == 1 and "7.0, 30.0" in rows[0]
    slow_link = validate.table(str(jobs), str(db), ["link.collective_fixed_ms=500"])
    sync_ms = [float(ln.split("|")[6].split("/")[0]) for ln in (base, slow_link)
               for ln in ln.splitlines() if ln.startswith("| 3to1")]
    assert sync_ms[1] > sync_ms[0] + 400  # the override reached every preset's link


def test_a_run_missing_from_the_store_is_left_out(tmp_path: Path) -> None:
    jobs, db = _fake_run(tmp_path)
    assert validate.measured(str(jobs / "r3to1_cpu_async"), str(db), "sim/other") is None
