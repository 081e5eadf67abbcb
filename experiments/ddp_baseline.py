"""PyTorch DistributedDataParallel baseline for the heterogeneity benchmark.

    python experiments/ddp_baseline.py [--experiment digits_wide] [--epochs N]
        [--rank-speeds 1.0 0.33] [--out DIR] [--tracking-uri URI]
        [--experiment-name bench_hetero] [--run-name NAME]

W processes (``torch.multiprocessing``), Gloo on 127.0.0.1, one torch thread
each, trained with plain ``DistributedDataParallel`` on the SAME experiment
preset flodl_exp uses (``conf/experiment/<name>.yaml``, built by
``flodl_exp.experiment.build_experiment``: same model, same initial weights
(``torch.manual_seed(seed)``), same optimizer, same batch size, same epochs).

* Data: ``torch.utils.data.DistributedSampler`` (shuffle, seed, drop_last) over
  the training set: each rank trains an equal 1/W of every epoch.
* LR: flodl_exp's linear scaling, ``lr x (1 + (W - 1) x lr_scale_ratio)`` (x2
  for two ranks, default ratio 1.0), which is also the usual rule for DDP's
  W-times larger global batch. A scheduler, when the preset has one, is driven
  by the global batch count like flodl_exp's ranks.
* Heterogeneity: rank r with ``speed < 1`` sleeps ``(1/speed - 1) x`` its step's
  compute wall after each optimizer step, the same simulated slowdown as
  ``flodl_exp/rank/trainer.py``. The gradient all_reduce inside ``backward``
  then makes the fast rank wait for the slow one every step, as DDP does on a
  mixed rig. ``--sleep-basis compute`` (default) subtracts this rank's own
  all_reduce wall (timed by a comm hook) from the step wall, so the sleep
  scales compute only, exactly like flodl_exp whose train step holds no
  communication; ``--sleep-basis step`` sleeps on the raw step wall.
* Timing: training wall starts at a barrier once every process is built and
  ends at the all_reduce of the last epoch's counters (which waits for the
  slow rank's last sleep); per-epoch walls are measured on rank 0 between
  those epoch-end collectives. Process start, model build, eval are outside.

Outputs in ``--out``: ``events.jsonl`` (the same event schema as a flodl_exp
job folder: started / epoch / eval / end, ``t`` in seconds) and
``result.json``; the run is logged to MLflow (``--tracking-uri``) under
``--experiment-name`` with flodl_exp's metric names (loss, epoch_time_s,
samples_per_s, samples, syncs, sync_ms_avg, rank<r>/batch_share,
rank<r>/samples_per_s, eval/accuracy, eval/loss).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def load_experiment(name: str, epochs: Optional[int] = None, batch_size: Optional[int] = None) -> dict:
    """The experiment preset as a plain dict (``conf/experiment/<name>.yaml``)."""
    from omegaconf import OmegaConf

    path = os.path.join(ROOT, "conf", "experiment", f"{name}.yaml")
    exp = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if epochs is not None:
        exp["epochs"] = int(epochs)
    if batch_size is not None:
        exp["batch_size"] = int(batch_size)
    return exp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, a: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    from flodl_exp.experiment import build_experiment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    device = torch.device("cpu")
    exp_cfg = a["exp"]
    exp = build_experiment(exp_cfg, world_size=world, device=device, seed=int(a["seed"]))
    bs, epochs = int(exp_cfg["batch_size"]), int(exp_cfg["epochs"])
    speed = float(a["speeds"][rank])
    ratio = float(a["lr_scale_ratio"])
    lr_scale = 1.0 + (world - 1) * ratio if (world > 1 and ratio > 0) else 1.0
    base_lrs = [g["lr"] for g in exp.optimizer.param_groups]
    if exp.lr_factor is None:
        for g, base in zip(exp.optimizer.param_groups, base_lrs):
            g["lr"] = base * lr_scale
    model = DDP(exp.model)  # replicas already equal (same seed); DDP broadcasts rank 0's anyway

    comm = {"launch": 0.0, "done": 0.0, "calls": 0}

    def timed_allreduce(state, bucket):  # no annotations: DDP checks them literally
        # DDP's default allreduce hook (mean over ranks), plus wall timing of the collective.
        t_launch = time.perf_counter()
        buf = bucket.buffer().div_(world)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            comm["launch"], comm["done"] = t_launch, time.perf_counter()
            comm["calls"] += 1
            return f.value()[0]

        return fut.then(done)

    model.register_comm_hook(None, timed_allreduce)
    optimizer = exp.optimizer
    n_train = len(exp.train_data)
    sampler = DistributedSampler(range(n_train), num_replicas=world, rank=rank, shuffle=True,
                                 seed=int(a["seed"]), drop_last=True)
    events_path = a["events_path"]
    t_origin = a["t_origin"]  # the parent's time.time() at start, so `t` is comparable across runs

    def emit(ev: dict) -> None:
        if rank == 0:
            with open(events_path, "a") as fh:
                now = time.time()
                fh.write(json.dumps(dict(ev, t=round(now - t_origin, 3), wall=round(now, 3))) + "\n")

    global_step = 0
    dist.barrier()
    t_start = time.perf_counter()
    emit({"event": "started", "world_size": world, "epochs": epochs})
    t_prev = t_start
    for e in range(epochs):
        sampler.set_epoch(e)
        ids = np.fromiter(iter(sampler), dtype=np.int64)
        n_batches = len(ids) // bs
        loss_sum = compute_ms = comm_ms = sleep_ms = data_ms = 0.0
        for b in range(n_batches):
            t_d = time.perf_counter()
            batch = exp.train_data.get_batch(ids[b * bs:(b + 1) * bs])
            data_ms += (time.perf_counter() - t_d) * 1e3
            t0 = time.perf_counter()
            if exp.lr_factor is not None:
                f = exp.lr_factor(global_step) * lr_scale
                for g, base in zip(optimizer.param_groups, base_lrs):
                    g["lr"] = base * f
            optimizer.zero_grad(set_to_none=True)
            loss = exp.train_step(model, batch)
            loss.backward()  # the gradient all_reduce runs in here (fast rank waits for the slow one)
            optimizer.step()
            loss_v = float(loss.detach())
            step_ms = (time.perf_counter() - t0) * 1e3
            c_ms = max(0.0, (comm["done"] - comm["launch"]) * 1e3) if comm["done"] >= t0 else 0.0
            comm_ms += c_ms
            basis = step_ms - c_ms if a["sleep_basis"] == "compute" else step_ms
            compute_ms += step_ms - c_ms
            if speed < 1.0:
                nap = (1.0 / speed - 1.0) * basis
                time.sleep(nap / 1e3)
                sleep_ms += nap
            loss_sum += loss_v
            global_step += world
        # Epoch-end counters: [loss_sum, batches, samples, compute, comm, sleep, data] per rank.
        mine = torch.tensor([loss_sum, n_batches, n_batches * bs, compute_ms, comm_ms, sleep_ms, data_ms],
                            dtype=torch.float64)
        allr = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(allr, mine)  # also the epoch barrier: waits for the slow rank's last sleep
        now = time.perf_counter()
        wall = now - t_prev
        t_prev = now
        if rank == 0:
            tot_b = sum(float(x[1]) for x in allr)
            tot_s = sum(float(x[2]) for x in allr)
            ev = {"event": "epoch", "epoch": e, "loss": sum(float(x[0]) for x in allr) / tot_b,
                  "epoch_time_s": wall, "samples_per_s": tot_s / wall, "samples": tot_s,
                  # every step is one gradient all_reduce: syncs = steps per rank
                  "syncs": float(n_batches),
                  # the all_reduce wall on the rank that arrives last (pure transfer; the others include waiting)
                  "sync_ms_avg": min(float(x[4]) / max(float(x[1]), 1.0) for x in allr),
                  "global_step": float(global_step), "train_wall_s": now - t_start}
            for r, x in enumerate(allr):
                busy_s = (float(x[3]) + float(x[5]) + float(x[6])) / 1e3  # compute + simulated slowdown + data
                ev[f"rank{r}/batch_share"] = float(x[1]) / tot_b
                ev[f"rank{r}/samples_per_s"] = float(x[2]) / busy_s if busy_s > 0 else 0.0
                ev[f"rank{r}/allreduce_ms_avg"] = float(x[4]) / max(float(x[1]), 1.0)
                # train-step wall without the all_reduce, incl. the simulated slowdown (flodl_exp's compute_only_ms / batches)
                ev[f"rank{r}/step_ms"] = (float(x[3]) + float(x[5])) / max(float(x[1]), 1.0)
                ev[f"rank{r}/data_starve_ms"] = float(x[6])  # batch fetch wall, summed over the epoch
                ev[f"rank{r}/idle_frac"] = max(0.0, 1.0 - busy_s / wall)
            emit(ev)
    t_end = time.perf_counter()
    if rank == 0:
        metrics = exp.eval_fn(model.module, exp.eval_data, device) if exp.eval_fn and exp.eval_data is not None else {}
        emit({"event": "eval", "epoch": epochs - 1, "final": True, **{f"eval/{k}": float(v) for k, v in metrics.items()}})
        with open(a["result_path"], "w") as fh:
            json.dump({"status": "FINISHED", "world_size": world, "epochs": epochs, "batch_size": bs, "train_wall_s": t_end - t_start,
                       "global_step": global_step, "final_eval": {f"eval/{k}": float(v) for k, v in metrics.items()},
                       "lr_scale": lr_scale, "sleep_basis": a["sleep_basis"], "rank_speeds": a["speeds"],
                       "comm_hook_calls": comm["calls"]}, fh, indent=1)
        emit({"event": "end", "status": "FINISHED", "failure": None})
    dist.barrier()
    dist.destroy_process_group()


def _log_mlflow(uri: str, experiment_name: str, artifact_location: Optional[str], run_name: str, params: dict,
                tags: dict, events: list[dict], t_origin: float, status: str, out: str) -> str:
    from mlflow.entities import Metric

    from flodl_exp.tracking import client, create_run

    run_id = create_run(uri, experiment_name, artifact_location, run_name, params, tags)
    c = client(uri)
    pts = []
    for ev in events:
        ts = int((t_origin + float(ev.get("t", 0.0))) * 1000)
        if ev.get("event") == "epoch":
            for k, v in ev.items():
                if k not in ("event", "epoch", "t") and isinstance(v, (int, float)):
                    pts.append(Metric(k, float(v), ts, int(ev["epoch"])))
        elif ev.get("event") == "eval":
            for k, v in ev.items():
                if k.startswith("eval/"):
                    pts.append(Metric(k, float(v), ts, int(ev["epoch"])))
    for i in range(0, len(pts), 900):
        c.log_batch(run_id, metrics=pts[i:i + 900])
    for name in ("result.json", "events.jsonl"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            c.log_artifact(run_id, p, "run")
    c.set_terminated(run_id, status=status)
    return run_id


def run_ddp(*, experiment: str = "digits_wide", epochs: Optional[int] = None, batch_size: Optional[int] = None,
            rank_speeds: tuple[float, ...] = (1.0, 0.33), seed: int = 42, lr_scale_ratio: float = 1.0,
            sleep_basis: str = "compute", out: str = "outputs/bench/ddp", tracking_uri: Optional[str] = None,
            experiment_name: str = "bench_hetero", artifact_location: Optional[str] = None,
            run_name: Optional[str] = None) -> dict:
    """Run the DDP baseline (blocking); returns result.json (+ run_id, events)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    events_path, result_path = os.path.join(out, "events.jsonl"), os.path.join(out, "result.json")
    for p in (events_path, result_path):
        if os.path.exists(p):
            os.remove(p)
    exp = load_experiment(experiment, epochs, batch_size)
    world = len(rank_speeds)
    t_origin = time.time()
    args = {"exp": exp, "seed": seed, "speeds": [float(s) for s in rank_speeds], "lr_scale_ratio": lr_scale_ratio,
            "sleep_basis": sleep_basis, "events_path": events_path, "result_path": result_path, "t_origin": t_origin}
    status, failure = "FINISHED", None
    try:
        mp.spawn(_worker, args=(world, _free_port(), args), nprocs=world, join=True)
    except Exception as e:  # ProcessRaisedException carries the worker's traceback
        status, failure = "FAILED", f"{type(e).__name__}: {e}"
    events = []
    if os.path.exists(events_path):
        with open(events_path) as fh:
            events = [json.loads(line) for line in fh if line.strip()]
    result = {}
    if os.path.exists(result_path):
        with open(result_path) as fh:
            result = json.load(fh)
    if failure:
        result.update(status="FAILED", failure=failure)
    if tracking_uri:
        params = {"experiment": exp, "mode": {"name": "ddp", "policy": "sync", "backend": "gloo_ddp",
                                              "lr_scale_ratio": lr_scale_ratio, "sleep_basis": sleep_basis},
                  "cluster": {"ranks_per_node": world, "rank_speeds": list(rank_speeds)}, "seed": seed}
        tags = {"mode": "ddp", "policy": "sync", "backend": "gloo_ddp", "world_size": str(world),
                "experiment": exp["name"], "cluster": "local_hetero" if any(s < 1 for s in rank_speeds) else "local"}
        if failure:
            tags["error"] = failure[:5000]
        result["run_id"] = _log_mlflow(tracking_uri, experiment_name, artifact_location,
                                       run_name or f"{exp['name']}/ddp", params, tags, events, t_origin, status, out)
        with open(result_path, "w") as fh:
            json.dump(result, fh, indent=1)
    result["events"] = events
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="digits_wide", help="preset under conf/experiment/")
    p.add_argument("--epochs", type=int, default=None, help="override the preset's epochs")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset's batch size (per rank)")
    p.add_argument("--rank-speeds", type=float, nargs="+", default=[1.0, 0.33], help="one factor per process")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lr-scale-ratio", type=float, default=1.0, help="flodl_exp's mode.lr_scale_ratio (0 = off)")
    p.add_argument("--sleep-basis", choices=("compute", "step"), default="compute")
    p.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench", "ddp"))
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (unset: no MLflow run)")
    p.add_argument("--experiment-name", default="bench_hetero")
    p.add_argument("--artifact-location", default=None)
    p.add_argument("--run-name", default=None)
    a = p.parse_args(argv)
    res = run_ddp(experiment=a.experiment, epochs=a.epochs, batch_size=a.batch_size, rank_speeds=tuple(a.rank_speeds),
                  seed=a.seed, lr_scale_ratio=a.lr_scale_ratio, sleep_basis=a.sleep_basis, out=a.out,
                  tracking_uri=a.tracking_uri, experiment_name=a.experiment_name,
                  artifact_location=a.artifact_location, run_name=a.run_name)
    for ev in res.pop("events"):
        if ev.get("event") == "epoch":
            print(f"epoch {ev['epoch'] + 1}  loss {ev['loss']:.4f}  {ev['samples_per_s']:.0f} samples/s  "
                  f"epoch {ev['epoch_time_s']:.2f}s  allreduce {ev['sync_ms_avg']:.2f} ms", flush=True)
    print(json.dumps(res, indent=1))
    return 0 if res.get("status") == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
