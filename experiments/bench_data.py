"""Data-plane benchmark: the slow digits data set under each data_plane preset.

    .venv/bin/python experiments/bench_data.py [--epochs 3] [--sleep-ms 1.0] [--ranks 2] [--mode nccl_cadence]

Runs ``experiment=digits_slow`` (digits whose loading sleeps ``sleep_ms`` per
sample, see flodl_exp/zoo/slow_data.py) once per configuration, each a real
run (coordinator + ranks, a throw-away MLflow store), and prints one table:
epoch wall times and the per-epoch data starvation (time ranks spent blocked
waiting for batches, summed over ranks). Configurations:

- ``default``: prefetch + RAM sample cache (ram_max_usage 0.5).
- ``lean``: ram_max_usage 0.1, no device pool.
- ``disk_overflow``: ram_max_usage 0.1 + an 8 GiB disk stage (digits fit in RAM, so
  the stage stays empty: the numbers match lean).
- ``disk_overflow+256KiB``: the same with the RAM share forced to 256 KiB
  (``FLODL_RAM_BUDGET_BYTES``): about half the samples overflow into the disk stage.
- ``ram_max_usage=0``: single-stage synchronous fetch, no retention: the baseline.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: list[tuple[str, list[str], dict[str, str]]] = [
    ("default", ["data_plane=default"], {}),
    ("lean", ["data_plane=lean"], {}),
    ("disk_overflow", ["data_plane=disk_overflow"], {}),
    ("disk_overflow+256KiB", ["data_plane=disk_overflow"], {"FLODL_RAM_BUDGET_BYTES": str(256 * 1024)}),
    ("ram_max_usage=0", ["data_plane=default", "data_plane.ram_max_usage=0"], {}),
]


def run_one(name: str, overrides: list[str], env: dict[str, str], args: argparse.Namespace, tmp: str) -> dict:
    """One real run; returns per-epoch wall and starvation read back from MLflow."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp}/mlflow.db"
    cmd = [sys.executable, "-m", "flodl_exp", "experiment=digits_slow", f"mode={args.mode}",
           f"experiment.epochs={args.epochs}", f"experiment.train_data.sleep_ms={args.sleep_ms}",
           f"cluster.ranks_per_node={args.ranks}", *overrides,
           f"tracking.uri={uri}", "tracking.experiment_name=bench_data", f"hydra.run.dir={tmp}/hydra/{''.join(ch if ch.isalnum() else '_' for ch in name)}",
           f"run.job_root={tmp}/jobs", "run.progress=plain"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    run_id = next(line.split()[2] for line in p.stdout.splitlines() if line.startswith("MLflow run "))
    c = MlflowClient(uri)

    def hist(key: str) -> list[float]:
        return [m.value for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)]

    starve = [sum(v) for v in zip(*(hist(f"rank{r}/data_starve_ms") for r in range(args.ranks)))]
    return {"name": name, "epoch_s": hist("epoch_time_s"), "starve_ms": starve, "wall_s": wall}


def table(rows: list[dict], epochs: int) -> str:
    head = ["config"] + [f"ep{e + 1} s" for e in range(epochs)] + [f"starve ep{e + 1} ms" for e in range(epochs)]
    head += ["starve vs sync", "run wall s"]
    base = next((r for r in rows if r["name"] == "ram_max_usage=0"), None)
    base_total = sum(base["starve_ms"]) if base else 0.0
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rel = f"{100 * sum(r['starve_ms']) / base_total:.0f}%" if base_total > 0 else "-"
        cells = [r["name"]] + [f"{x:.3f}" for x in r["epoch_s"]] + [f"{x:.0f}" for x in r["starve_ms"]]
        cells += [rel, f"{r['wall_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mode", default="nccl_cadence")
    ap.add_argument("--only", nargs="*", help="run only these configurations (names as in the table)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        for name, overrides, env in CONFIGS:
            if args.only and name not in args.only:
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows.append(run_one(name, overrides, env, args, tmp))
    print(f"\nslow digits ({args.sleep_ms} ms/sample), {args.ranks} ranks, mode {args.mode}, {args.epochs} epochs; "
          f"starve = sum over ranks of time blocked waiting for batches\n")
    print(table(rows, args.epochs))


if __name__ == "__main__":
    main()
