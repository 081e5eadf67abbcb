"""Predicted vs measured: ``python -m flodl_exp.simulate.validate --runs DIR --store DB``.

Reads real runs (their job folders under ``DIR/<rig>_<mode>/`` and the MLflow SQLite store ``DB``, as the
commands in the README section write them), takes each run's own per-rank step and data-wait times
(``rank<r>/compute_only_ms`` and ``data_starve_ms`` over ``rank<r>/batches``: the load of the moment is in
them), simulates the same rig preset (``conf/simulate/rig_<rig>.yaml``) and mode with those times, and
prints samples/s, syncs, mean sync ms and the fast rank's batch share, predicted / measured, with the ratio.
Measured numbers are defined as experiments/bench_hetero.py defines them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any, Optional

from omegaconf import OmegaConf

from flodl_exp.package_conf import CONF_DIR
from flodl_exp.simulate.topology import RankGroupConfig, SimulateConfig, register

CONF = os.path.join(CONF_DIR, "simulate")


def measured(job_dir: str, db: str, run_name: str) -> Optional[dict[str, Any]]:
    """The bench's numbers for one real run, and its per-rank step and data ms."""
    paths = glob.glob(os.path.join(job_dir, "*", "events.jsonl"))
    if not paths:
        return None
    with open(paths[0]) as fh:
        ev = [json.loads(line) for line in fh if line.strip()]
    started = next((e for e in ev if e.get("event") == "started"), None)
    epochs = [e for e in ev if e.get("event") == "epoch"]
    if started is None or not epochs:
        return None
    w = int(started["world_size"])
    wall = float(epochs[-1]["t"]) - float(started["t"])
    samples = sum(float(e["samples"]) for e in epochs)
    syncs = sum(float(e.get("syncs", 0)) for e in epochs)
    sync_ms = sum(float(e.get("syncs", 0)) * float(e.get("sync_ms_avg", 0)) for e in epochs) / syncs if syncs else 0.0
    share = sum(float(e.get("rank0/batch_share", 0)) * float(e["samples"]) for e in epochs) / samples
    con = sqlite3.connect(db)
    try:
        run = con.execute("select run_uuid from runs where name = ?", (run_name,)).fetchone()
        if run is None:
            return None

        def total(key: str) -> float:
            row = con.execute("select sum(value) from metrics where run_uuid = ? and key = ?", (run[0], key)).fetchone()
            return float(row[0] or 0.0)

        steps, data = [], []
        for r in range(w):
            nb = max(total(f"rank{r}/batches"), 1.0)
            steps.append(total(f"rank{r}/compute_only_ms") / nb)
            data.append(total(f"rank{r}/data_starve_ms") / nb)
    finally:
        con.close()
    return {"wall_s": wall, "samples_per_s": samples / wall, "syncs": int(round(syncs)), "sync_ms": sync_ms,
            "fast_share": share, "step_ms": steps, "data_ms": data, "epochs": len(epochs)}


def predict(rig: str, mode: str, m: dict[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``mode`` simulated on the rig preset with the run's measured per-rank times (``overrides``: Hydra
    overrides of the preset, e.g. ``link.collective_fixed_ms=12`` to try another calibration)."""
    from hydra import compose, initialize_config_dir

    from flodl_exp.simulate.engine import simulate
    from flodl_exp.simulate.report import summarize

    register()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name=f"rig_{rig}", overrides=list(overrides)))
    assert isinstance(cfg, SimulateConfig)
    cfg.ranks = [RankGroupConfig(step_ms=s, data_ms=d) for s, d in zip(m["step_ms"], m["data_ms"])]
    cfg.epochs, cfg.modes = int(m["epochs"]), [mode]
    return summarize(simulate(cfg, mode), 0)


def table(runs: str, db: str, overrides: Sequence[str] = ()) -> str:
    lines = ["| rig | mode | step ms (measured, per rank) | samples/s pred / meas (ratio) | syncs pred / meas (ratio) | "
             "mean sync ms pred / meas | fast-rank share pred / meas (ratio) |", "|---|---|---|---|---|---|---|"]
    for d in sorted(glob.glob(os.path.join(runs, "*_*"))):
        name = os.path.basename(d)
        tag, _, mode = name.partition("_")
        rig = tag[1:] if tag.startswith("r") else tag
        m = measured(d, db, f"sim/{name}")
        if m is None or not os.path.exists(os.path.join(CONF, f"rig_{rig}.yaml")):
            continue
        p = predict(rig, mode, m, overrides)

        def cell(a: float, b: float, spec: str) -> str:
            return f"{format(a, spec)} / {format(b, spec)} ({a / b:.2f})" if b else f"{format(a, spec)} / -"

        steps = ", ".join(f"{s:.1f}" for s in m["step_ms"])
        lines.append(f"| {rig} | {mode} | {steps} | {cell(p['samples_per_s'], m['samples_per_s'], '.0f')} | "
                     f"{cell(p['syncs'], m['syncs'], 'd')} | {p['sync_ms']:.1f} / {m['sync_ms']:.1f} | "
                     f"{cell(p['fast_share'], m['fast_share'], '.2f')} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", required=True, help="folder of <rig>_<mode> job roots (run.job_root of each run)")
    ap.add_argument("--store", required=True, help="the runs' MLflow SQLite file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override of every rig preset (repeatable), e.g. --set link.collective_fixed_ms=12")
    a = ap.parse_args(argv)
    print(table(a.runs, a.store, a.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
