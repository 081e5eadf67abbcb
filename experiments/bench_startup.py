"""Start-up benchmark: where the seconds of a short run go, next to PyTorch DDP's.

    python experiments/bench_startup.py [--runs 3] [--epochs 1] [--out outputs/bench/startup]

Runs ``python -m flodl_exp experiment=digits_mlp experiment.epochs=1`` (2 local ranks, nccl_cadence) ``--runs``
times on one MLflow store (the first on a fresh store, the rest on it as it then exists) and times each phase
from the command's start, by wall clock: the launcher (imports, config, the job folder) until it submits the job;
the run id printed (the launcher creates the MLflow run after the submission, while the job starts); the coordinator up (its first log line); every rank joined; the process group formed (``started``);
the first trained batch; the last epoch; the final eval; the run's end (result written); the command's exit.
The coordinator's events carry wall times (``events.jsonl``: ``wall``), so no phase is inferred. The data
set cache (``FLODL_DATA_CACHE``) is the store's own: the fresh-store run builds it, as a new machine would.

Then runs ``experiments/ddp_baseline.py`` (2 processes, Gloo, DistributedDataParallel, the same preset and
epochs, no MLflow) the same number of times: process start to its ``started`` barrier (first batch next),
training, and exit.

``--compare CHECKOUT`` pairs this checkout with another one (before/after a change): their runs and DDP's alternate
run by run, so the load of a shared machine weighs on both alike.

Prints one table of medians (seconds from the command's start, and each phase's own length), the end-to-end ratio
to DDP and the first batch's lag behind DDP's, and the load average at the start and the end. The machine is noisy:
quote medians, compare within one sitting.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

PHASES = [
    ("submitted", "job submitted (imports, config, job folder, submission)"),
    ("launcher", "run id printed (MLflow imported, run created; the job starts meanwhile)"),
    ("coordinator_up", "coordinator listening"),
    ("ranks_joined", "every rank said hello"),
    ("group_ready", "process group formed, first chunks out"),
    ("first_batch", "first trained batch"),
    ("last_epoch", "last epoch aggregated"),
    ("final_eval", "final eval back"),
    ("run_end", "result written (bundle, MLflow run closed after)"),
    ("command_exit", "the command returned"),
]
AFTER = {"coordinator_up": "submitted"}
"""A phase that does not follow the row above it: its own length is from this one (the run id is printed while the
job starts, so the coordinator's start-up counts from the submission)."""


def _stamp(line: str) -> Optional[float]:
    """The wall time of a ``YYYY-mm-dd HH:MM:SS,mmm`` log line."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def flodl_run(store: Path, epochs: int, root: Path = ROOT) -> dict[str, float]:
    """One CLI run (of the checkout ``root``); each phase's wall time minus the command's start."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    cmd = [sys.executable, "-u", "-m", "flodl_exp", "experiment=digits_mlp", f"experiment.epochs={epochs}",
           f"tracking.uri={uri}", "tracking.experiment_name=bench_startup", f"run.job_root={store / 'jobs'}",
           "run.progress=plain", f"hydra.run.dir={store / 'hydra'}/${{now:%H-%M-%S-%f}}"]
    env = dict(os.environ, FLODL_DATA_CACHE=str(store / "data_cache"))  # the first run builds it, as on a new machine
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks: dict[str, float] = {}
    job: Optional[Path] = None
    assert proc.stdout is not None
    export_pid: Optional[int] = None
    for line in proc.stdout:
        if line.startswith("MLflow run ") and "launcher" not in marks:
            marks["launcher"] = time.time()
            job = Path(line.split(" folder ", 1)[1].strip())
        if "in the background (pid " in line:
            export_pid = int(line.split("in the background (pid ", 1)[1].split(";", 1)[0].split(")", 1)[0])
    rc = proc.wait()
    marks["command_exit"] = time.time()
    if rc != 0 or job is None:
        raise SystemExit(f"flodl_exp run failed (exit {rc})")
    _wait_model_export(job, export_pid)
    submitted = sorted((job / "submitit").glob("*_submitted.pkl"))
    if submitted:  # submitit's pickle of the submission: written as the launcher submits
        marks["submitted"] = submitted[0].stat().st_mtime
    for line in (job / "coordinator.log").read_text().splitlines():
        stamp = _stamp(line) if "listening on" in line else None
        if stamp is not None:
            marks["coordinator_up"] = stamp
            break
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    if all("wall" in e for e in events):  # (a checkout older than the wall stamps times the rest only)
        marks["ranks_joined"] = max(e["wall"] for e in events if e["event"] == "joined")

        def first(kind: str, **match: object) -> Optional[float]:
            return next((e["wall"] for e in events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())),
                        None)

        for key, kind, match in (("group_ready", "started", {}), ("first_batch", "first_batch", {}),
                                 ("final_eval", "eval", {"final": True}), ("run_end", "end", {})):
            t = first(kind, **match)
            if t is not None:
                marks[key] = t
        marks["last_epoch"] = [e["wall"] for e in events if e["event"] == "epoch"][-1]
    return {k: v - t0 for k, v in marks.items()}


def _wait_model_export(job: Path, pid: Optional[int], limit_s: float = 300.0) -> None:
    """The model export a run leaves in the background (after its command returned) ends before the next run
    starts, so it does not take the next run's CPU: the bench times each run alone, as a user's single run is.
    Its process (``pid``, from the summary) is waited for to its exit, not to its last log line: its teardown
    took CPU too."""
    log = job / "model_export.log"
    if not any((job / name).exists() for name in ("model_export.json", "model_export.json.claimed")):
        return  # (the export process renames the request as it claims it: a claimed one is still running)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        done = "consensus model logged" in text or "not logged" in text or "Traceback" in text
        if done and (pid is None or not Path(f"/proc/{pid}").exists()):
            return
        time.sleep(0.1)


def ddp_run(out: Path, epochs: int) -> dict[str, float]:
    """One DDP baseline run (2 processes, Gloo, equal speeds): started (barrier before the first batch), end, exit."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "experiments/ddp_baseline.py", "--experiment", "digits_mlp", "--epochs", str(epochs),
           "--rank-speeds", "1.0", "1.0", "--out", str(out)]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    t_exit = time.time()
    if r.returncode != 0:
        raise SystemExit(f"ddp baseline failed:\n{r.stderr[-2000:]}")
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]
    wall = {e["event"]: e["wall"] for e in events}
    last_epoch = [e["wall"] for e in events if e["event"] == "epoch"][-1]
    return {"group_ready": wall["started"] - t0, "last_epoch": last_epoch - t0, "final_eval": wall["eval"] - t0,
            "run_end": wall["end"] - t0, "command_exit": t_exit - t0}


def table(flodl: list[dict[str, float]], ddp: list[dict[str, float]], fresh: dict[str, float],
          other: Optional[tuple[str, list[dict[str, float]], dict[str, float]]] = None) -> str:
    """The medians' table; ``other`` = (its name, runs, fresh-store run): a second checkout's columns and lines."""
    def med(rows: list[dict[str, float]], k: str) -> Optional[float]:
        vals = [r[k] for r in rows if k in r]
        return statistics.median(vals) if vals else None

    def fmt(x: Optional[float]) -> str:
        return "" if x is None else f"{x:.2f}"

    def own(rows: list[dict[str, float]], k: str) -> Optional[float]:
        """The median over runs of this phase's own length (from the previous phase each run timed)."""
        keys = [key for key, _ in PHASES]
        lengths = []
        for r in rows:
            before = [r[p] for p in keys[:keys.index(k)] if p in r]
            if k in AFTER and AFTER[k] in r:
                before = [r[AFTER[k]]]
            if k in r:
                lengths.append(r[k] - (before[-1] if before else 0.0))
        return statistics.median(lengths) if lengths else None

    head = "| phase (until) | flodl_exp s from start | flodl_exp phase s | first run, fresh store |"
    if other is not None:
        head += f" {other[0]} s from start | {other[0]} phase s | {other[0]} fresh store |"
    lines = [head + " DDP s from start |", "|---" * (head.count("|")) + "|"]
    for k, what in PHASES:
        row = f"| {k}: {what} | {fmt(med(flodl, k))} | {fmt(own(flodl, k))} | {fmt(fresh.get(k))} |"
        if other is not None:
            row += f" {fmt(med(other[1], k))} | {fmt(own(other[1], k))} | {fmt(other[2].get(k))} |"
        lines.append(row + f" {fmt(med(ddp, k))} |")
    lines.append("")
    for name, rows in [("flodl_exp", flodl), *([other[:2]] if other is not None else [])]:
        wall, ddp_wall = med(rows, "command_exit"), med(ddp, "command_exit")
        first, ddp_first = med(rows, "first_batch"), med(ddp, "group_ready")
        if wall and ddp_wall:
            lines.append(f"{name}: end to end {wall / ddp_wall:.2f}x DDP's wall (target <= 1.1x)" +
                         (f"; first batch DDP's + {first - ddp_first:.2f} s (target <= + 1 s)"
                          if first is not None and ddp_first is not None else ""))
    return "\n".join(lines)


def _load(avg: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in avg)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per side (medians); flodl_exp runs one more on a fresh store")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench" / "startup"))
    p.add_argument("--compare", metavar="CHECKOUT", default=None,
                   help="another checkout of this project (e.g. `git worktree add /tmp/old <commit>`): its runs "
                        "alternate with this one's and DDP's, run by run, so a shared machine's load drifts over both")
    a = p.parse_args(argv)
    out = Path(a.out)
    trees = [("flodl_exp", ROOT, out / "store")]
    if a.compare:
        trees.append((f"compare ({Path(a.compare).name})", Path(a.compare).resolve(), out / "store_compare"))
    for _, _, store in trees:
        if store.exists():
            shutil.rmtree(store)
        store.mkdir(parents=True)
    load_start = os.getloadavg()
    print(f"load average at start: {_load(load_start)} ({os.cpu_count()} CPUs)", flush=True)
    print(f"{' and '.join(name for name, _, _ in trees)}: {a.runs + 1} runs of {a.epochs} epoch(s) each (the first on a "
          f"fresh store), DDP {a.runs}, alternating", flush=True)
    fresh = {name: flodl_run(store, a.epochs, root) for name, root, store in trees}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in trees}
    ddp = []
    for i in range(a.runs):
        # the two checkouts take turns going first: a run's leftovers (its interpreter's exit, the page cache,
        # the scheduler's memory) weigh on the next one, and two runs of one checkout differed by 0.65 s
        # (median) only by their order
        for name, root, store in (trees if i % 2 == 0 else trees[::-1]):
            r = flodl_run(store, a.epochs, root)
            runs[name].append(r)
            first_batch = r.get("first_batch")
            print(f"  {name} run {i + 1}: {r['command_exit']:.2f} s" +
                  (f", first batch at {first_batch:.2f} s" if first_batch else ""), flush=True)
        ddp.append(ddp_run(out / "ddp", a.epochs))
        print(f"  DDP run {i + 1}: {ddp[-1]['command_exit']:.2f} s", flush=True)
    load_end = os.getloadavg()
    other = (trees[1][0], runs[trees[1][0]], fresh[trees[1][0]]) if a.compare else None
    text = table(runs["flodl_exp"], ddp, fresh["flodl_exp"], other)
    if other is not None:  # run i of this checkout beside run i of the other, under the same moment's load
        pairs = []
        for k in ("first_batch", "command_exit"):
            diffs = [x[k] - y[k] for x, y in zip(runs["flodl_exp"], other[1]) if k in x and k in y]
            if diffs:
                pairs.append(f"{k} {statistics.median(diffs):+.2f} s ({', '.join(f'{d:+.2f}' for d in diffs)})")
        text += f"\nflodl_exp minus {other[0]}, run by run (median): " + "; ".join(pairs)
    text += f"\nload average (1, 5, 15 min): {_load(load_start)} at start, {_load(load_end)} at end"
    print()
    print(text)
    (out / "startup.md").write_text(text + "\n")
    (out / "startup.json").write_text(json.dumps({"flodl_exp": runs["flodl_exp"], "fresh_store": fresh["flodl_exp"],
                                                  "ddp": ddp, "load_start": load_start, "load_end": load_end,
                                                  **({"compare": {"checkout": str(a.compare), "runs": other[1],
                                                                  "fresh_store": other[2]}} if other else {})},
                                                 indent=1))
    print(f"\nwritten: {out / 'startup.md'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
