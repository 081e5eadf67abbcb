"""mode=auto against every fixed mode, side by side in one sitting, on three rigs (issue 31).

    python experiments/bench_auto.py [--rigs 3:1,1:1,4:2:1] [--epochs N] [--reps N] [--out DIR]

For each rig (``cluster.rank_speeds``: 3:1 = [1.0, 0.33], 1:1 = [1.0, 1.0], 4:2:1 = [1.0, 0.5, 0.25] on three
ranks) the five fixed modes and ``mode=auto`` run ``experiment=digits_wide`` (experiments/bench_hetero.py's
compute-bound CNN) in this process through ``flodl_exp.launch``, interleaved per repetition (every mode once, then
again), all logged to one MLflow experiment (``bench_auto``). Samples/s and the final eval are bench_hetero's
definitions (training wall from the coordinator's ``started`` event to the last epoch's aggregation). mode=auto
probes before ``started``; that time is reported on its own (``probe s``: from the last rank's hello to
``started``) and is also charged to auto in ``auto/best (probe in)``. ``first batch s`` (``started`` to the first
trained batch's report: a fixed mode's first steps pay the warm-up that auto's probe already paid) and ``start s``
(the coordinator's start to ``started``: the ranks' start-up, and auto's probe) say what the two walls leave out.
For auto, the ``auto_mode`` event's own timing (medians): ``probe`` (the probe sent to the last answer),
``simulate`` (the last answer to the choice) and ``prepare`` (the simulations' set-up, as the coordinator starts).

Prints and writes ``<out>/auto.md``: per rig, each mode's median samples/s and eval accuracy, the mode auto chose
(each repetition), auto's samples/s as a fraction of the best fixed mode's, and the eval difference in points.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench_hetero import _read_json, _read_jsonl, run_flodl_inprocess, summarize  # noqa: E402

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
RIGS: dict[str, list[float]] = {"3:1": [1.0, 0.33], "1:1": [1.0, 1.0], "4:2:1": [1.0, 0.5, 0.25]}
TARGET = 0.95
"""auto's samples/s over the best fixed mode's (issue 31), with the eval within EVAL_POINTS."""
EVAL_POINTS = 0.5


def _rig_overrides(speeds: list[float]) -> list[str]:
    return ["cluster=local_hetero", f"cluster.ranks_per_node={len(speeds)}",
            f"cluster.rank_speeds=[{','.join(str(s) for s in speeds)}]", "tracking.predict=false"]


def _probe_s(events: list[dict]) -> float:
    joined = [float(e["t"]) for e in events if e.get("event") == "joined" and "t" in e]
    started = next((float(e["t"]) for e in events if e.get("event") == "started" and "t" in e), None)
    return started - max(joined) if joined and started is not None else float("nan")


def _first_batch_s(events: list[dict]) -> float:
    started = next((float(e["t"]) for e in events if e.get("event") == "started" and "t" in e), None)
    first = next((float(e["t"]) for e in events if e.get("event") == "first_batch" and "t" in e), None)
    return first - started if first is not None and started is not None else float("nan")


def _start_s(events: list[dict]) -> float:
    return next((float(e["t"]) for e in events if e.get("event") == "started" and "t" in e), float("nan"))


def _auto_timing(events: list[dict]) -> dict[str, float]:
    ev = next((e for e in events if e.get("event") == "auto_mode"), {})
    return {k: float(ev.get(f"{k}_s", float("nan"))) for k in ("probe", "simulate", "prepare")}


def _choice(events: list[dict]) -> Optional[str]:
    return next((str(e["mode"]) for e in events if e.get("event") == "auto_mode"), None)


def _rec_from_log(out: str, name: str) -> dict[str, Any]:
    """A finished run of this sitting, found through its log (``MLflow run <id>  job <id>  folder <dir>``)."""
    with open(os.path.join(out, "logs", f"{name}.log")) as fh:
        head = fh.read(4096)
    words = head.split("MLflow run ", 1)[1].split()
    run_id, job_dir = words[0], words[words.index("folder") + 1]
    result = _read_json(os.path.join(job_dir, "result.json"))
    return {"name": name, "kind": "flodl", "rc": 0 if result.get("status") == "FINISHED" else 1, "run_id": run_id,
            "dir": job_dir, "events": _read_jsonl(os.path.join(job_dir, "events.jsonl")), "result": result,
            "launch_s": float("nan"), "cmd": []}


def _paired(rows: dict[str, list[dict[str, Any]]], best: str) -> tuple[float, float, list[float]]:
    """auto's samples/s over ``best``'s in the same round, then with auto's probe charged: the medians over the
    rounds, and each round's (probe in)."""
    by_rep = {r["rep"]: r for r in rows[best]}
    plain, charged = [], []
    for r in rows["auto"]:
        b = by_rep.get(r["rep"])
        if b is None or not (b["samples_per_s"] > 0 and r["samples_per_s"] > 0):
            continue
        plain.append(r["samples_per_s"] / b["samples_per_s"])
        charged.append(r["samples_per_s"] * r["wall_s"] / (r["wall_s"] + r["probe_s"]) / b["samples_per_s"])
    return _median(plain), _median(charged), charged


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rigs", default="3:1,1:1,4:2:1")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES),
                   help="the fixed modes to run beside auto (default all five; the best of these is auto's yardstick)")
    p.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench-auto"))
    p.add_argument("--from-logs", action="store_true",
                   help="re-score the sitting already in --out (its logs/ name each run's job folder): nothing runs")
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes {a.modes!r}: each must be one of {', '.join(MODES)}")
    a.out = os.path.abspath(a.out)
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    a.tracking_uri = f"sqlite:///{a.out}/mlflow.db"
    a.experiment_name = "bench_auto"
    a.artifact_location = os.path.join(a.out, "mlartifacts")
    a.run_timeout_s = 600.0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(a.tracking_uri)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    lines = ["# mode=auto vs the fixed modes", "",
             f"`python experiments/bench_auto.py --rigs {a.rigs} --epochs {a.epochs} --reps {a.reps} --modes {a.modes}`: "
             f"experiment=digits_wide, {a.epochs} epochs, medians of {a.reps} run(s) per mode, interleaved.", ""]
    verdicts = []
    for rig in a.rigs.split(","):
        speeds = RIGS[rig]
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in (*modes, "auto")}
        for rep in range(a.reps):
            order = (*modes, "auto")
            k = rep % len(order)  # rotated each rep: no mode always runs first or last in a round
            for m in order[k:] + order[:k]:
                name = f"{rig.replace(':', 'to')}-{m}-{rep}"
                if a.from_logs:
                    rec = _rec_from_log(a.out, name)
                else:
                    print(f"[bench_auto] {rig} {m} rep {rep}", flush=True)
                    rec = run_flodl_inprocess(name, [f"mode={m}", *_rig_overrides(speeds)], a)
                s = summarize(rec, client)
                s["rep"] = rep
                s["probe_s"] = _probe_s(rec["events"])
                s["first_batch_s"] = _first_batch_s(rec["events"])
                s["start_s"] = _start_s(rec["events"])
                s["choice"] = _choice(rec["events"])
                s["auto_timing"] = _auto_timing(rec["events"])
                rows[m].append(s)
        sps = {m: _median([r["samples_per_s"] for r in rs]) for m, rs in rows.items()}
        acc = {m: _median([r["accuracy"] for r in rs]) for m, rs in rows.items()}
        probe = {m: _median([r["probe_s"] for r in rs]) for m, rs in rows.items()}
        first = {m: _median([r["first_batch_s"] for r in rs]) for m, rs in rows.items()}
        start = {m: _median([r["start_s"] for r in rs]) for m, rs in rows.items()}
        timing = {k: _median([r["auto_timing"][k] for r in rows["auto"]]) for k in ("probe", "simulate", "prepare")}
        best = max(modes, key=lambda m: sps[m] if sps[m] == sps[m] else -1.0)
        ratio = sps["auto"] / sps[best]
        walls = {m: _median([r["wall_s"] for r in rs]) for m, rs in rows.items()}
        ratio_probe = (sps["auto"] * walls["auto"] / (walls["auto"] + probe["auto"])) / sps[best]
        paired = _paired(rows, best)
        d_eval = 100 * (acc["auto"] - acc[best])
        chose = ", ".join(str(r["choice"]) for r in rows["auto"])
        ok = ratio >= TARGET and abs(d_eval) <= EVAL_POINTS
        verdicts.append(ok)
        lines += [f"## rig {rig} (rank_speeds {speeds})", "",
                  "| mode | samples/s | eval acc | probe s | first batch s | start s |", "|---|---:|---:|---:|---:|---:|"]
        for m in (*modes, "auto"):
            lines.append(f"| {m}{' (best fixed)' if m == best else ''} | {sps[m]:.0f} | {acc[m]:.4f} | {probe[m]:.2f} "
                         f"| {first[m]:.3f} | {start[m]:.2f} |")
        lines += ["", f"auto chose: {chose}; auto/best = **{ratio:.3f}** ({ratio_probe:.3f} with its probe in); eval "
                      f"{d_eval:+.2f} points vs {best}: {'MET' if ok else 'MISSED'} (>= {TARGET}, within "
                      f"{EVAL_POINTS} point)",
                  f"paired by round (auto and {best} in the same round of the rotation, so a load that drifts across "
                  f"the sitting weighs on both): median auto/{best} {paired[0]:.3f}, {paired[1]:.3f} with its probe in "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in paired[2])})",
                  f"auto_mode timing (medians): probe {timing['probe']:.3f} s, simulate {timing['simulate']:.3f} s, "
                  f"prepare {timing['prepare']:.3f} s (at the coordinator's start)", ""]
    load1 = os.getloadavg()
    lines.append(f"Bench wall {time.monotonic() - t0:.0f} s; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end.")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "auto.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
