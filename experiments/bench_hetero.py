"""ElChe heterogeneity benchmark vs PyTorch DDP on the simulated 3:1 rig.

    python experiments/bench_hetero.py [--rig 3:1|1:1] [--epochs N] [--out DIR] [--tracking-uri URI] [--quick]

One fixed experiment (``experiment=digits_wide``: a compute-bound 48/96/192-channel
CNN on the digits data, batch 16, ~7 ms per train step on one CPU thread), run in one session as

* ``solo_fast``  flodl_exp, one rank at speed 1.0 (``cluster.ranks_per_node=1 cluster.rank_speeds=[1.0]``)
* ``solo_slow``  flodl_exp, one rank at speed 0.33 (``[0.33]``)
* ``ddp``        PyTorch DistributedDataParallel, 2 processes, Gloo, rank 1 at 0.33 (experiments/ddp_baseline.py)
* ``nccl_sync``, ``nccl_cadence``, ``cpu_sync``, ``cpu_cadence``, ``cpu_async``
                 flodl_exp on ``cluster=local_hetero`` (rank_speeds [1.0, 0.33])
* ``nccl_sync+overlap``, ``nccl_cadence+overlap``, ``cpu_cadence+overlap``, ``cpu_async+overlap``
                 the same with ``mode.overlap=true`` (issue 51: the next window trains while the replicas are averaged)
* ``nccl_cadence+slowmo``, ``nccl_cadence+diloco``, ``cpu_async+slowmo``, ``cpu_async+diloco``
                 the same with an outer optimizer (``outer=slowmo|diloco``, their defaults)

every run in its own subprocess (``python -m flodl_exp ...`` / the DDP script),
all logged to one MLflow experiment (``bench_hetero``). Metrics are read back
from each run's event log (the flodl_exp job folder's ``events.jsonl``, which
the DDP baseline writes in the same schema) and from MLflow; the script prints
and writes ``<out>/hetero.md`` and ``<out>/hetero_loss.png``.

``--rig 1:1`` runs the homogeneous rig instead (``cluster.rank_speeds=[1.0, 1.0]``): one solo run (its
samples/s counted twice as the ideal), DDP and the five modes, default out ``outputs/bench-1to1``.

Definitions (identical for every run):

* **wall s** = training wall: from the moment every rank is up and training
  starts (flodl_exp: the coordinator's ``started`` event; DDP: a barrier after
  the process group and model are built) to the end of the last epoch
  (flodl_exp: the coordinator aggregating the last epoch; DDP: the epoch-end
  collective of the last epoch). Process start-up, data load, model build,
  the final eval and the checkpoint are excluded.
* **samples/s** = training samples of all epochs / wall s.
* **efficiency** = samples/s / (solo_fast + solo_slow samples/s): 1.0 = the two
  ranks' standalone throughputs add up perfectly.
* **first 3 epochs** = the same efficiency over epochs 0-2 only (the run's and the solo runs' own first
  three epochs): the cold start, before ElChe has seen a reduce.
* **syncs** = parameter averages (flodl_exp) or gradient all_reduces (DDP, one
  per step), summed over epochs; **mean sync ms** = the coordinator's reduce
  cycle wall (flodl_exp) or the all_reduce wall on the rank that arrives last
  (DDP).
* **fast-rank batch share** = rank 0's share of all trained batches.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

EXPERIMENT = "digits_wide"
MLFLOW_EXPERIMENT = "bench_hetero"
RIGS: dict[str, tuple[float, ...]] = {"3:1": (1.0, 0.33), "1:1": (1.0, 1.0)}
DEFAULT_EPOCHS = 10
QUICK_EPOCHS = 3
FIRST_EPOCHS = 3
"""Epochs of the cold-start column."""

# (name, kind, hydra overrides)
RUNS: list[tuple[str, str, list[str]]] = [
    ("solo_fast", "flodl", ["mode=nccl_sync", "cluster=local", "cluster.ranks_per_node=1", "cluster.rank_speeds=[1.0]"]),
    ("solo_slow", "flodl", ["mode=nccl_sync", "cluster=local", "cluster.ranks_per_node=1", "cluster.rank_speeds=[0.33]"]),
    ("ddp", "ddp", []),
    ("nccl_sync", "flodl", ["mode=nccl_sync", "cluster=local_hetero"]),
    ("nccl_sync+lockstep", "flodl", ["mode=nccl_sync", "mode.lockstep_ahead=8", "cluster=local_hetero"]),
    ("nccl_cadence", "flodl", ["mode=nccl_cadence", "cluster=local_hetero"]),
    ("cpu_sync", "flodl", ["mode=cpu_sync", "cluster=local_hetero"]),
    ("cpu_cadence", "flodl", ["mode=cpu_cadence", "cluster=local_hetero"]),
    ("cpu_async", "flodl", ["mode=cpu_async", "cluster=local_hetero"]),
    # overlapped averaging (issue 51): the rank trains its next window while the replicas are averaged
    ("nccl_sync+overlap", "flodl", ["mode=nccl_sync", "mode.overlap=true", "cluster=local_hetero"]),
    ("nccl_cadence+overlap", "flodl", ["mode=nccl_cadence", "mode.overlap=true", "cluster=local_hetero"]),
    ("cpu_cadence+overlap", "flodl", ["mode=cpu_cadence", "mode.overlap=true", "cluster=local_hetero"]),
    ("cpu_async+overlap", "flodl", ["mode=cpu_async", "mode.overlap=true", "cluster=local_hetero"]),
    # outer optimizers (their defaults, nothing tuned per run) on the two low-communication modes
    ("nccl_cadence+slowmo", "flodl", ["mode=nccl_cadence", "outer=slowmo", "cluster=local_hetero"]),
    ("nccl_cadence+diloco", "flodl", ["mode=nccl_cadence", "outer=diloco", "cluster=local_hetero"]),
    ("cpu_async+slowmo", "flodl", ["mode=cpu_async", "outer=slowmo", "cluster=local_hetero"]),
    ("cpu_async+diloco", "flodl", ["mode=cpu_async", "outer=diloco", "cluster=local_hetero"]),
]
_HOMOGENEOUS = ["cluster=local_hetero", "cluster.rank_speeds=[1.0,1.0]"]
RUNS_1TO1: list[tuple[str, str, list[str]]] = [
    ("solo_fast", "flodl", ["mode=nccl_sync", "cluster=local", "cluster.ranks_per_node=1", "cluster.rank_speeds=[1.0]"]),
    ("ddp", "ddp", []),
    *[(m, "flodl", [f"mode={m}", *_HOMOGENEOUS]) for m in ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")],
    ("nccl_sync+lockstep", "flodl", ["mode=nccl_sync", "mode.lockstep_ahead=8", *_HOMOGENEOUS]),
    *[(f"{m}+overlap", "flodl", [f"mode={m}", "mode.overlap=true", *_HOMOGENEOUS]) for m in ("nccl_sync", "nccl_cadence", "cpu_cadence", "cpu_async")],
]
# (modes, x DDP samples/s, eval points vs the reference run, that run) per rig
TARGETS: dict[str, list[tuple[tuple[str, ...], float, float, str]]] = {
    "3:1": [(("nccl_cadence", "cpu_cadence"), 1.6, 1.0, "solo_fast")],
    "1:1": [(("nccl_sync",), 1.0, 0.5, "ddp"), (("nccl_cadence", "cpu_cadence"), 1.4, 0.5, "ddp")],
}
TARGET_FIRST_EPOCHS = 0.75
"""Cold start: nccl_cadence and cpu_cadence efficiency over the first 3 epochs on the 3:1 rig."""


def runs_for(rig: str) -> list[tuple[str, str, list[str]]]:
    return RUNS if rig == "3:1" else RUNS_1TO1


def solo_sum(by: dict[str, dict], speeds: tuple[float, ...], key: str = "samples_per_s") -> float:
    """Ideal samples/s: the solo runs' added up (one solo run counted once per rank on a homogeneous rig)."""
    fast = by.get("solo_fast", {}).get(key) or float("nan")
    if "solo_slow" in by:
        return fast + (by["solo_slow"].get(key) or float("nan"))
    return fast * len(speeds) if len(set(speeds)) == 1 else float("nan")


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return env


def _run_subprocess(cmd: list[str], log_path: str, timeout_s: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout_s)
            out, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
        log.write(out)
    return rc, out, time.monotonic() - t0


def run_flodl(name: str, overrides: list[str], a: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "flodl_exp", *_flodl_overrides(name, overrides, a),
           f"hydra.run.dir={os.path.join(a.out, 'runs', name, 'hydra')}"]
    rc, out, launch_s = _run_subprocess(cmd, os.path.join(a.out, "logs", f"{name}.log"), a.run_timeout_s)
    m = re.search(r"MLflow run (\w+)\s+job \S+\s+folder (\S+)", out)
    if not m:
        raise RuntimeError(f"{name}: no job folder in the output (rc={rc}); see {a.out}/logs/{name}.log\n{out[-2000:]}")
    run_id, job_dir = m.group(1), m.group(2)
    events, result = _read_jsonl(os.path.join(job_dir, "events.jsonl")), _read_json(os.path.join(job_dir, "result.json"))
    return {"name": name, "kind": "flodl", "rc": rc, "run_id": run_id, "dir": job_dir, "events": events,
            "result": result, "launch_s": launch_s, "cmd": cmd}


def _flodl_overrides(name: str, overrides: list[str], a: argparse.Namespace) -> list[str]:
    return [f"experiment={EXPERIMENT}", *overrides, *([f"experiment.model.channels={a.channels}"] if a.wide else []),
            f"experiment.epochs={a.epochs}", f"seed={a.seed}", "eval.every=0",
            "run.progress=plain", f"run.timeout_min={max(5, int(a.run_timeout_s // 60) + 1)}",
            f"tracking.uri={a.tracking_uri}", f"tracking.experiment_name={a.experiment_name}",
            f"tracking.artifact_location={a.artifact_location}", f"tracking.run_name=bench/{name}",
            f"run.job_root={os.path.join(a.out, 'runs', name, 'jobs')}"]


def run_flodl_inprocess(name: str, overrides: list[str], a: argparse.Namespace) -> dict:
    """The same run through ``flodl_exp.launch`` in this process (saves the launcher's start-up per run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from flodl_exp.config import register_configs
    from flodl_exp.config_rules import validate
    from flodl_exp.jobs.launcher import RunFailed, launch

    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # submitit's rank processes import experiments.*
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    register_configs()
    if not GlobalHydra.instance().is_initialized():
        initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3", job_name="bench_hetero")
    ovr = _flodl_overrides(name, overrides, a)
    t0 = time.monotonic()
    cfg = compose(config_name="config", overrides=ovr)
    validate(cfg)
    handle = launch(cfg, root=ROOT)
    rc, err = 0, ""
    try:
        handle.wait()
    except RunFailed as e:
        rc, err = 1, str(e)
    launch_s = time.monotonic() - t0
    with open(os.path.join(a.out, "logs", f"{name}.log"), "w") as log:
        log.write(f"# in-process flodl_exp.launch, overrides: {' '.join(ovr)}\n")
        log.write(f"MLflow run {handle.run_id}  job {handle.job_id}  folder {handle.job_dir}\n")
        log.write(OmegaConf.to_yaml(cfg, resolve=True))
        if err:
            log.write(f"\nrun failed:\n{err}\n")
    return {"name": name, "kind": "flodl", "rc": rc, "run_id": handle.run_id, "dir": handle.job_dir,
            "events": _read_jsonl(os.path.join(handle.job_dir, "events.jsonl")),
            "result": _read_json(os.path.join(handle.job_dir, "result.json")), "launch_s": launch_s, "cmd": ovr}


def run_ddp_inprocess(name: str, a: argparse.Namespace) -> dict:
    """experiments/ddp_baseline.run_ddp from this process (its W workers are still fresh spawned processes)."""
    from experiments.ddp_baseline import run_ddp as ddp

    out_dir = os.path.join(a.out, "runs", name)
    t0 = time.monotonic()
    res = ddp(experiment=EXPERIMENT, epochs=a.epochs, rank_speeds=a.speeds, seed=a.seed, sleep_basis=a.ddp_sleep_basis,
              out=out_dir, tracking_uri=a.tracking_uri, experiment_name=a.experiment_name,
              artifact_location=a.artifact_location, run_name=f"bench/{name}")
    launch_s = time.monotonic() - t0
    events = res.pop("events")
    with open(os.path.join(a.out, "logs", f"{name}.log"), "w") as log:
        log.write("# in-process experiments.ddp_baseline.run_ddp\n" + json.dumps(res, indent=1) + "\n")
    return {"name": name, "kind": "ddp", "rc": 0 if res.get("status") == "FINISHED" else 1, "run_id": res.get("run_id"),
            "dir": out_dir, "events": events, "result": res, "launch_s": launch_s, "cmd": []}


def run_ddp(name: str, a: argparse.Namespace) -> dict:
    out_dir = os.path.join(a.out, "runs", name)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "ddp_baseline.py"), "--experiment", EXPERIMENT,
           "--epochs", str(a.epochs), "--seed", str(a.seed), "--rank-speeds", *map(str, a.speeds),
           "--out", out_dir, "--tracking-uri", a.tracking_uri, "--experiment-name", a.experiment_name,
           "--artifact-location", a.artifact_location, "--run-name", f"bench/{name}",
           "--sleep-basis", a.ddp_sleep_basis]
    rc, out, launch_s = _run_subprocess(cmd, os.path.join(a.out, "logs", f"{name}.log"), a.run_timeout_s)
    result = _read_json(os.path.join(out_dir, "result.json"))
    return {"name": name, "kind": "ddp", "rc": rc, "run_id": result.get("run_id"), "dir": out_dir,
            "events": _read_jsonl(os.path.join(out_dir, "events.jsonl")), "result": result, "launch_s": launch_s,
            "cmd": cmd}


def _history(client: Any, run_id: str, key: str) -> dict[int, float]:
    try:
        return {int(m.step): float(m.value) for m in client.get_metric_history(run_id, key)}
    except Exception:
        return {}


def summarize(rec: dict, client: Any) -> dict:
    """Per-run numbers, defined the same way for flodl_exp and DDP (see the module docstring)."""
    ev = rec["events"]
    started = next((e for e in ev if e.get("event") == "started"), None)
    epochs = [e for e in ev if e.get("event") == "epoch"]
    final = next((e for e in ev if e.get("event") == "eval" and e.get("final")), None)
    s: dict[str, Any] = {"name": rec["name"], "kind": rec["kind"], "run_id": rec.get("run_id"), "rc": rec["rc"],
                         "launch_s": rec["launch_s"], "epochs_done": len(epochs)}
    status = (rec.get("result") or {}).get("status")
    s["status"] = status or ("FAILED" if rec["rc"] else "?")
    if started is None or not epochs:
        s.update(wall_s=float("nan"), samples_per_s=float("nan"), curve=[])
        return s
    t0 = float(started["t"])
    wall = float(epochs[-1]["t"]) - t0
    samples = sum(float(e["samples"]) for e in epochs)
    s["wall_s"] = wall
    s["samples"] = samples
    s["samples_per_s"] = samples / wall if wall > 0 else float("nan")
    s["syncs"] = int(round(sum(float(e.get("syncs", 0)) for e in epochs)))
    w = [(float(e.get("syncs", 0)), float(e.get("sync_ms_avg", 0))) for e in epochs]
    s["sync_ms"] = sum(n * ms for n, ms in w) / sum(n for n, _ in w) if sum(n for n, _ in w) else 0.0
    s["fast_share"] = sum(float(e.get("rank0/batch_share", 1.0)) * float(e["samples"]) for e in epochs) / samples
    s["final_loss"] = float(epochs[-1]["loss"])
    s["accuracy"] = float(final["eval/accuracy"]) if final and "eval/accuracy" in final else float("nan")
    s["curve"] = [(float(e["t"]) - t0, float(e["loss"])) for e in epochs]
    if len(epochs) >= FIRST_EPOCHS:
        head = epochs[:FIRST_EPOCHS]
        s["first_samples_per_s"] = sum(float(e["samples"]) for e in head) / max(float(head[-1]["t"]) - t0, 1e-9)
    s["anchor_last"] = epochs[-1].get("anchor")
    # Diagnostics from MLflow (flodl_exp logs per-rank timing there; DDP has it in its events).
    if rec["kind"] == "flodl" and client is not None and rec.get("run_id"):
        for r in range(2):
            comp = _history(client, rec["run_id"], f"rank{r}/compute_only_ms")
            nb = _history(client, rec["run_id"], f"rank{r}/batches")
            idle = _history(client, rec["run_id"], f"rank{r}/idle_frac")
            data = _history(client, rec["run_id"], f"rank{r}/data_starve_ms")
            if nb and sum(nb.values()) > 0:
                s[f"rank{r}_step_ms"] = sum(comp.values()) / sum(nb.values())
                s[f"rank{r}_data_ms"] = sum(data.values()) / sum(nb.values()) if data else float("nan")
            if idle:
                s[f"rank{r}_idle"] = statistics.mean(idle.values())
    elif rec["kind"] == "ddp":
        for r in range(2):
            vals = [float(e.get(f"rank{r}/idle_frac", float("nan"))) for e in epochs]
            s[f"rank{r}_idle"] = statistics.mean(vals)
            s[f"rank{r}_step_ms"] = statistics.mean(float(e.get(f"rank{r}/step_ms", float("nan"))) for e in epochs)
            n_b = sum(float(e.get(f"rank{r}/batch_share", 0.5)) * float(e["samples"]) for e in epochs) / int((rec.get("result") or {}).get("batch_size") or 16)
            s[f"rank{r}_data_ms"] = sum(float(e.get(f"rank{r}/data_starve_ms", float("nan"))) for e in epochs) / max(n_b, 1.0)
            s[f"rank{r}_allreduce_ms"] = statistics.mean(float(e.get(f"rank{r}/allreduce_ms_avg", 0)) for e in epochs)
    return s


def fmt(x: Any, spec: str) -> str:
    try:
        if x is None or (isinstance(x, float) and x != x):
            return "-"
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def render(rows: list[dict], a: argparse.Namespace, step_ms: Optional[float], bench_wall: float, load: tuple,
           rounds: Optional[list[list[dict]]] = None) -> str:
    by = {r["name"]: r for r in rows}
    ideal = solo_sum(by, a.speeds)
    ideal_first = solo_sum(by, a.speeds, "first_samples_per_s")
    ddp_sps = by.get("ddp", {}).get("samples_per_s") or float("nan")
    speeds = ", ".join(f"{x:g}" for x in a.speeds)
    lines = [
        f"# ElChe heterogeneity benchmark vs PyTorch DDP ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        f"Experiment `{EXPERIMENT}` (WideCNN {a.channels}/{2 * a.channels}/{4 * a.channels} channels, batch {a.batch_size}, Adam lr {a.lr} "
        f"(x2 linear scaling on 2 ranks{', warm-up + cosine schedule' if a.scheduled else ''}), {a.epochs} epochs of {a.train_samples} digits), rank_speeds "
        f"[{speeds}] on {os.cpu_count()} CPU cores, one torch thread per rank. "
        f"**Fast-rank train step: {fmt(step_ms, '.1f')} ms** (solo_fast, measured this session: "
        "rank 0 compute_only_ms / batches).",
        "",
        f"## {a.rig} rig, {a.epochs} epochs, fast-rank train step {fmt(step_ms, '.1f')} ms (measured, solo_fast)"
        + (f"; {len(rounds)} rounds: per run the round with the median samples/s, efficiency and vs DDP = median "
           "of the per-round ratios (each round against its own solo and DDP runs)" if rounds and len(rounds) > 1 else ""),
        "",
        f"| run | wall s | samples/s | efficiency | first {FIRST_EPOCHS} epochs | vs DDP | syncs | mean sync ms | fast-rank batch share | final eval accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rows):
        if rounds and len(rounds) > 1:  # paired: each round against its own solo/DDP runs, then the median
            eff = statistics.median(rd[i].get("round_efficiency", float("nan")) for rd in rounds)
            eff3 = statistics.median(rd[i].get("round_first_efficiency", float("nan")) for rd in rounds)
            vs = statistics.median(rd[i].get("round_vs_ddp", float("nan")) for rd in rounds)
        else:
            eff = r.get("samples_per_s", float("nan")) / ideal
            eff3 = r.get("first_samples_per_s", float("nan")) / ideal_first
            vs = r.get("samples_per_s", float("nan")) / ddp_sps
        name = r["name"] + ("" if r.get("status") == "FINISHED" else f" ({r.get('status')})")
        lines.append(f"| {name} | {fmt(r.get('wall_s'), '.2f')} | {fmt(r.get('samples_per_s'), '.0f')} | {fmt(eff, '.2f')} | "
                     f"{fmt(eff3, '.2f')} | {fmt(vs, '.2f')}x | {fmt(r.get('syncs'), 'd')} | {fmt(r.get('sync_ms'), '.1f')} | "
                     f"{fmt(r.get('fast_share'), '.2f')} | {fmt(r.get('accuracy'), '.4f')} |")
        r["efficiency"], r["first_efficiency"], r["vs_ddp"] = eff, eff3, vs
    lines += ["",
              "wall s = training wall from all-ranks-up to the last epoch's end (process start, data load, model build, "
              "final eval and checkpoint excluded; same definition for DDP and flodl_exp); samples/s = training samples / "
              "wall s; efficiency = samples/s / (solo_fast + solo_slow samples/s; on a homogeneous rig the one solo run's "
              f"x {len(a.speeds)}); first {FIRST_EPOCHS} epochs = the same over epochs 0-{FIRST_EPOCHS - 1} (each run's "
              "own, the solo runs' too); vs DDP = samples/s / DDP samples/s; "
              "syncs = parameter averages (flodl_exp) or gradient all_reduces (DDP, one per step); mean sync ms = "
              "coordinator reduce-cycle wall (flodl_exp) or all_reduce wall on the last-arriving rank (DDP).",
              ""]
    # Target check.
    for modes, speedup, points, ref_name in TARGETS.get(a.rig, []):
        ref_acc = by.get(ref_name, {}).get("accuracy", float("nan"))
        lines.append(f"Target: {', '.join(modes)} >= {speedup:g}x DDP samples/s, eval accuracy within {points:g} "
                     f"point of {ref_name} ({fmt(ref_acc, '.4f')}).")
        lines.append("")
        for m in modes:
            got = by.get(m)
            if not got:
                continue
            ok_speed = got.get("vs_ddp", 0) >= speedup
            ok_acc = abs(got.get("accuracy", float("nan")) - ref_acc) * 100 <= points
            lines.append(f"- {m}: {fmt(got.get('vs_ddp'), '.2f')}x DDP ({'met' if ok_speed else 'NOT met'}), accuracy "
                         f"{fmt((got.get('accuracy', float('nan')) - ref_acc) * 100, '+.2f')} points vs {ref_name} "
                         f"({'met' if ok_acc else 'NOT met'})")
        lines.append("")
    if a.rig == "3:1":
        lines.append(f"Target (cold start): nccl_cadence, cpu_cadence >= {TARGET_FIRST_EPOCHS:g} efficiency over the first "
                     f"{FIRST_EPOCHS} epochs.")
        lines.append("")
        for m in ("nccl_cadence", "cpu_cadence"):
            got = by.get(m)
            if got:
                ok = got.get("first_efficiency", 0) >= TARGET_FIRST_EPOCHS
                lines.append(f"- {m}: {fmt(got.get('first_efficiency'), '.2f')} ({'met' if ok else 'NOT met'})")
        lines.append("")
    lines += ["", "Diagnostics (per run): fast/slow-rank mean train-step ms (compute incl. simulated slowdown, no "
              "communication), fast-rank batch fetch ms per batch, and mean idle fraction of the epoch wall; final ElChe anchor; subprocess wall (incl. "
              "start-up and teardown); 1-minute load average when the run started.", "",
              "| run | rank0 step ms | rank1 step ms | rank0 data ms/batch | rank0 idle | rank1 idle | anchor | final loss | process wall s | load avg |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {fmt(r.get('rank0_step_ms'), '.1f')} | {fmt(r.get('rank1_step_ms'), '.1f')} | "
                     f"{fmt(r.get('rank0_data_ms'), '.2f')} | "
                     f"{fmt(r.get('rank0_idle'), '.2f')} | {fmt(r.get('rank1_idle'), '.2f')} | "
                     f"{fmt(r.get('anchor_last'), '.0f')} | {fmt(r.get('final_loss'), '.4f')} | {fmt(r.get('launch_s'), '.1f')} | "
                     f"{fmt(r.get('load_before'), '.2f')} |")
    if "ddp" in by:
        d = by["ddp"]
        lines += ["", f"DDP all_reduce wall per step: rank0 {fmt(d.get('rank0_allreduce_ms'), '.1f')} ms (includes "
                  f"waiting for the slow rank), rank1 {fmt(d.get('rank1_allreduce_ms'), '.1f')} ms; slow-rank sleep "
                  f"basis: {a.ddp_sleep_basis}."]
    if rounds and len(rounds) > 1:
        lines += ["", "Every round (samples/s, and x DDP of the same round):", "",
                  "| run | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " |",
                  "|---|" + "---:|" * len(rounds)]
        for i, r in enumerate(rows):
            cells = [f"{fmt(rd[i].get('samples_per_s'), '.0f')} ({fmt(rd[i].get('round_vs_ddp'), '.2f')}x)" for rd in rounds]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    lines += ["", f"Benchmark wall time: {bench_wall:.0f} s. Load average before/after: "
              f"{load[0]:.2f} / {load[1]:.2f} (other processes on this machine perturb the timings).",
              f"MLflow: `mlflow ui --backend-store-uri {a.tracking_uri}` (experiment `{a.experiment_name}`).", ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        if not r.get("curve"):
            continue
        xs, ys = zip(*r["curve"])
        style = "--" if r["name"].startswith("solo") else (":" if r["kind"] == "ddp" else "-")
        ax.plot(xs, ys, style, marker="o", ms=3, lw=1.5, label=r["name"])
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("training loss (epoch mean)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ElChe heterogeneity benchmark vs PyTorch DDP (3:1 simulated rig)")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs per run (default {DEFAULT_EPOCHS}; --quick: {QUICK_EPOCHS})")
    p.add_argument("--rig", choices=tuple(RIGS), default="3:1",
                   help="3:1 (rank_speeds [1.0, 0.33], default) or 1:1 (homogeneous, [1.0, 1.0])")
    p.add_argument("--out", default=None, help="output folder (default outputs/bench, outputs/bench-1to1 for --rig 1:1)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default sqlite:///<out>/mlflow.db)")
    p.add_argument("--experiment-name", default=MLFLOW_EXPERIMENT)
    p.add_argument("--quick", action="store_true", help=f"smoke check: {QUICK_EPOCHS} epochs")
    p.add_argument("--runs", default=None, help="comma-separated subset of: " + ",".join(n for n, _, _ in RUNS)
                   + " (--rig 1:1: " + ",".join(n for n, _, _ in RUNS_1TO1) + ")")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--channels", type=int, default=None,
                   help="WideCNN's first channels for the flodl_exp runs (the preset's 48; 152 is about ten times the "
                        "parameters and compute); not with the ddp run")
    p.add_argument("--ddp-sleep-basis", choices=("compute", "step"), default="compute",
                   help="DDP slow rank sleeps (1/s-1) x compute wall (default; like flodl_exp) or x step wall incl. all_reduce")
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    p.add_argument("--launcher", choices=("subprocess", "inprocess"), default=None,
                   help="runs as subprocesses (`python -m flodl_exp`, `python experiments/ddp_baseline.py`; default, "
                        "isolated) or from this process (flodl_exp.launch, ddp_baseline.run_ddp; ranks/workers are "
                        "still fresh processes; saves ~5 s of start-up per run; --quick's default)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole sequence N times; the table shows, per run, the round with the median samples/s")
    p.add_argument("--rerender", action="store_true",
                   help="no runs: rebuild hetero.md / hetero_loss.png from <out>/hetero.json of an earlier session")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    a.out = a.out or os.path.join(ROOT, "outputs", "bench" if a.rig == "3:1" else "bench-1to1")
    if a.rerender:
        with open(os.path.join(os.path.abspath(a.out), "hetero.json")) as fh:
            saved = json.load(fh)
        a.epochs, a.repeat = saved["epochs"], saved.get("repeat", len(saved["rounds"]))
        a.rig = saved.get("rig", "3:1")
    a.speeds = RIGS[a.rig]
    a.epochs = a.epochs or (QUICK_EPOCHS if a.quick else DEFAULT_EPOCHS)
    a.launcher = a.launcher or ("inprocess" if a.quick else "subprocess")
    a.out = os.path.abspath(a.out)
    for sub in ("logs", "runs"):
        os.makedirs(os.path.join(a.out, sub), exist_ok=True)
    a.tracking_uri = a.tracking_uri or f"sqlite:///{os.path.join(a.out, 'mlflow.db')}"
    a.artifact_location = os.path.join(a.out, "mlartifacts")
    from experiments.ddp_baseline import load_experiment

    exp = load_experiment(EXPERIMENT)
    a.batch_size, a.lr = exp["batch_size"], exp["optimizer"]["lr"]
    a.wide = a.channels is not None
    a.channels = a.channels if a.wide else int(exp["model"].get("channels", 48))
    a.scheduled = bool(exp.get("scheduler"))
    from flodl_exp.zoo.digits import DigitsDataset

    a.train_samples = len(DigitsDataset("train"))
    runs = runs_for(a.rig)
    wanted = [n.strip() for n in a.runs.split(",")] if a.runs else [n for n, _, _ in runs]
    unknown = set(wanted) - {n for n, _, _ in runs}
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}")
    if a.wide and "ddp" in wanted:
        p.error("--channels: the ddp baseline trains the preset's model; leave ddp out of --runs")

    if a.rerender:
        report(saved["rounds"], a, float(saved.get("bench_wall_s", float("nan"))), tuple(saved.get("load", (float("nan"),) * 2)),
               saved["session"])
        return 0
    session = time.strftime("%Y%m%d-%H%M%S")
    t_bench = time.monotonic()
    load0 = os.getloadavg()[0]
    print(f"bench_hetero: {a.rig} rig, {len(wanted)} runs x {a.epochs} epochs of {EXPERIMENT}; out {a.out}; MLflow {a.tracking_uri}",
          flush=True)
    from flodl_exp.tracking import client as mlflow_client

    client = mlflow_client(a.tracking_uri)
    rounds: list[list[dict]] = []
    for rnd in range(max(1, a.repeat)):
        if a.repeat > 1:
            print(f" round {rnd + 1}/{a.repeat}", flush=True)
        got: list[dict] = []
        for name, kind, overrides in runs:
            if name not in wanted:
                continue
            la = os.getloadavg()[0]
            if kind == "ddp":
                rec = run_ddp_inprocess(name, a) if a.launcher == "inprocess" else run_ddp(name, a)
            elif a.launcher == "inprocess":
                rec = run_flodl_inprocess(name, overrides, a)
            else:
                rec = run_flodl(name, overrides, a)
            s = summarize(rec, client)
            s["load_before"], s["round"] = la, rnd
            got.append(s)
            print(f"  {name:20s} {s['status']:8s} wall {fmt(s.get('wall_s'), '6.2f')} s  {fmt(s.get('samples_per_s'), '6.0f')} samples/s  "
                  f"syncs {fmt(s.get('syncs'), '4d')}  share {fmt(s.get('fast_share'), '.2f')}  acc {fmt(s.get('accuracy'), '.4f')}  "
                  f"(process {s['launch_s']:.1f} s, load {la:.2f})", flush=True)
            if s["status"] != "FINISHED":
                print(f"    run failed (rc={rec['rc']}); log: {a.out}/logs/{name}.log", flush=True)
        rounds.append(got)
    bench_wall = time.monotonic() - t_bench
    rows, md_path, png_path = report(rounds, a, bench_wall, (load0, os.getloadavg()[0]), session)
    _tag_runs(client, rounds, session, (md_path, png_path))
    print(f"wrote {md_path} and {png_path}")
    failed = [r["name"] for r in rows if r.get("status") != "FINISHED"]
    return 1 if failed else 0


def _tag_runs(client: Any, rounds: list[list[dict]], session: str, files: tuple[str, ...]) -> None:
    """Bench-level numbers (and the report's files) onto every run, so the MLflow UI compares them side by side."""
    for r in (x for rd in rounds for x in rd):
        if not r.get("run_id"):
            continue
        try:
            for k in ("wall_s", "samples_per_s", "round_efficiency", "round_vs_ddp", "accuracy"):
                v = r.get(k)
                if isinstance(v, (int, float)) and v == v:
                    client.log_metric(r["run_id"], f"bench/{k.replace('round_', '')}", float(v))
            client.set_tag(r["run_id"], "bench.session", session)
            client.set_tag(r["run_id"], "bench.run", r["name"])
            client.set_tag(r["run_id"], "bench.round", str(r.get("round", 0)))
            for path in files:
                client.log_artifact(r["run_id"], path, "bench")
        except Exception as e:  # the store must not lose the table
            print(f"warning: MLflow bench metrics for {r['name']}: {e}", file=sys.stderr)


def report(rounds: list[list[dict]], a: argparse.Namespace, bench_wall: float, load: tuple, session: str):
    """Pick the per-run representative round, compute paired ratios, write hetero.md/.png/.json, print the table."""
    rows = []
    for i in range(len(rounds[0])):
        cands = sorted((rd[i] for rd in rounds), key=lambda r: (r.get("samples_per_s") or 0.0))
        rows.append(cands[(len(cands) - 1) // 2])  # the (lower) median round by samples/s
    by = {r["name"]: r for r in rows}
    step_ms = by.get("solo_fast", {}).get("rank0_step_ms")
    for rd in rounds:  # per-round efficiency / vs DDP against that round's own references
        rb = {r["name"]: r for r in rd}
        solo = solo_sum(rb, a.speeds)
        solo_first = solo_sum(rb, a.speeds, "first_samples_per_s")
        ddp = rb.get("ddp", {}).get("samples_per_s") or float("nan")
        for r in rd:
            r["round_efficiency"] = (r.get("samples_per_s") or float("nan")) / solo
            r["round_first_efficiency"] = (r.get("first_samples_per_s") or float("nan")) / solo_first
            r["round_vs_ddp"] = (r.get("samples_per_s") or float("nan")) / ddp
    md = render(rows, a, step_ms, bench_wall, load, rounds)
    md_path, png_path = os.path.join(a.out, "hetero.md"), os.path.join(a.out, "hetero_loss.png")
    with open(md_path, "w") as fh:
        fh.write(md)
    plot(rows, png_path, f"{EXPERIMENT}, rank_speeds [{', '.join(f'{x:g}' for x in a.speeds)}], {a.epochs} epochs: "
         "training loss vs wall time")
    with open(os.path.join(a.out, "hetero.json"), "w") as fh:
        json.dump({"session": session, "epochs": a.epochs, "rig": a.rig, "repeat": len(rounds), "bench_wall_s": bench_wall,
                   "load": list(load), "rows": rows, "rounds": rounds}, fh, indent=1, default=str)
    print()
    print(md)
    return rows, md_path, png_path


if __name__ == "__main__":
    sys.exit(main())
