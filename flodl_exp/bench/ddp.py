"""PyTorch baselines on any experiment preset: DistributedDataParallel over W processes, or a plain solo loop.

The port of ``experiments/ddp_baseline.py`` into the package (flodl_exp never imports ``experiments/``), made
generic: it takes the resolved ``experiment`` config (any preset, with the bench's overrides applied) instead
of a preset name, and world size 1 runs the same loop without a process group (the bench's ``solo=torch``).

* Same model, initial weights (``torch.manual_seed(seed)``), optimizer, batch size, epochs and scheduler as a
  flodl_exp run of that preset (``flodl_exp.experiment.build_experiment``).
* Data: ``DistributedSampler`` (shuffle, seed, drop_last): each rank trains an equal 1/W of every epoch.
* LR: flodl_exp's linear scaling, ``lr x (1 + (W - 1) x lr_scale_ratio)``; a scheduler follows the global
  batch count like flodl_exp's ranks.
* Heterogeneity: rank r with ``speed < 1`` sleeps ``(1/speed - 1) x`` its step's compute wall after each step
  (``sleep_basis=compute`` subtracts its own all_reduce wall, timed by a comm hook; ``step`` does not), so the
  gradient all_reduce makes the fast rank wait for the slow one every step, as DDP does on a mixed rig.
* Timing: training wall from a barrier once every process is built to the epoch-end collective of the last
  epoch; per-epoch walls on rank 0 between those collectives. Start-up and the final eval are outside.

Writes ``events.jsonl`` (flodl_exp's event schema: started / epoch / eval / end, ``t`` in seconds) and
``result.json`` into ``out``, and logs one MLflow run with flodl_exp's metric names (loss, epoch_time_s,
samples_per_s, samples, syncs, sync_ms_avg, rank<r>/batch_share, rank<r>/idle_frac, eval/*), optionally as the
child of ``parent_run_id``.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from flodl_exp import events

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp(module: Any, world: int, comm: dict[str, Any]) -> Any:
    """``module`` under DistributedDataParallel, its gradient all_reduce timed into ``comm`` (launch, done, calls)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module)  # replicas already equal (same seed); DDP broadcasts rank 0's anyway

    def timed_allreduce(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t_launch = time.perf_counter()
        buf = bucket.buffer().div_(world)
        work = dist.all_reduce(buf, async_op=True)
        assert work is not None  # async_op=True always returns its Work

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            comm["launch"], comm["done"] = t_launch, time.perf_counter()
            comm["calls"] += 1
            return f.value()[0]

        return work.get_future().then(done)

    # DDP compares a hook's annotations with its own classes, and this module's annotations are strings: it is
    # handed a bare lambda instead (no annotations, so nothing to compare)
    model.register_comm_hook(None, lambda state, bucket: timed_allreduce(bucket))
    return model


def _train_batch(exp: Any, model: Any, batch: Any, global_step: int, lr_scale: float, base_lrs: list[float]) -> float:
    """One optimizer step on ``batch`` (the scheduler's factor first, as flodl_exp's ranks apply it); its loss."""
    optimizer = exp.optimizer
    if exp.lr_factor is not None:
        f = exp.lr_factor(global_step) * lr_scale
        for g, base in zip(optimizer.param_groups, base_lrs):
            g["lr"] = base * f
    optimizer.zero_grad(set_to_none=True)
    assert exp.train_step is not None, "the baselines run the managed tier (experiment.train_step)"
    loss = exp.train_step(model, batch)
    loss.backward()  # DDP: the gradient all_reduce runs in here (the fast rank waits for the slow one)
    optimizer.step()
    return float(loss.detach())


def _worker(rank: int, world: int, port: int, a: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from flodl_exp.experiment import build_experiment

    torch.set_num_threads(1)
    if world > 1:
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
    comm = {"launch": 0.0, "done": 0.0, "calls": 0}
    model: Any = _ddp(exp.model, world, comm) if world > 1 else exp.model
    sampler: DistributedSampler = DistributedSampler(range(len(exp.train_data)), num_replicas=world,  # type: ignore[arg-type]
                                                     rank=rank, shuffle=True, seed=int(a["seed"]), drop_last=True)
    t_origin = a["t_origin"]

    def emit(record: events.EventRecord) -> None:  # the coordinator's event-log lines, so one report reads both
        if rank == 0:
            with open(a["events_path"], "a") as fh:
                now = time.time()
                fh.write(json.dumps(dict(record.record(), t=round(now - t_origin, 3), wall=round(now, 3))) + "\n")

    global_step = 0
    if world > 1:
        dist.barrier()
    t_start = time.perf_counter()
    emit(events.Started(world_size=world, epochs=epochs))
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
            loss_v = _train_batch(exp, model, batch, global_step, lr_scale, base_lrs)
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
        allr = [mine]
        if world > 1:
            allr = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(allr, mine)  # also the epoch barrier: waits for the slow rank's last sleep
        now = time.perf_counter()
        wall, t_prev = now - t_prev, now
        if rank == 0:
            emit(_epoch_event(e, allr, wall, world, global_step, now - t_start))
    t_end = time.perf_counter()
    if rank == 0:
        net = model.module if world > 1 else model
        metrics = exp.eval_fn(net, exp.eval_data, device) if exp.eval_fn and exp.eval_data is not None else {}
        final = {f"eval/{k}": float(v) for k, v in metrics.items()}
        emit(events.Eval(epoch=epochs - 1, final=True, metrics=final))
        with open(a["result_path"], "w") as fh:
            json.dump({"status": "FINISHED", "world_size": world, "epochs": epochs, "batch_size": bs,
                       "train_wall_s": t_end - t_start, "global_step": global_step, "final_eval": final,
                       "lr_scale": lr_scale, "sleep_basis": a["sleep_basis"], "rank_speeds": a["speeds"],
                       "comm_hook_calls": comm["calls"]}, fh, indent=1)
        emit(events.End(status="FINISHED", failure=None))
    if world > 1:
        dist.barrier()
        # Leave at once: every file is written and closed, and tearing the process group down can hang (a gloo
        # ProcessGroup's destructor joins a worker thread when DDP's reducer is freed, seen with forked workers).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _epoch_event(e: int, allr: list, wall: float, world: int, global_step: int, train_wall: float) -> events.Epoch:
    rows = [[float(v) for v in x] for x in allr]
    tot_b = sum(x[1] for x in rows) or 1.0
    tot_s = sum(x[2] for x in rows)
    ev: dict[str, Any] = {
        "loss": sum(x[0] for x in rows) / tot_b, "epoch_time_s": wall,
        "samples_per_s": tot_s / wall if wall > 0 else 0.0, "samples": tot_s,
        # every step is one gradient all_reduce (DDP): syncs = steps per rank; solo: none
        "syncs": rows[0][1] if world > 1 else 0.0,
        # the all_reduce wall on the rank that arrives last (pure transfer; the others include waiting)
        "sync_ms_avg": min(x[4] / max(x[1], 1.0) for x in rows) if world > 1 else 0.0,
        "global_step": float(global_step), "train_wall_s": train_wall}
    for r, x in enumerate(rows):
        busy_s = (x[3] + x[5] + x[6]) / 1e3  # compute + simulated slowdown + data
        ev[f"rank{r}/batch_share"] = x[1] / tot_b
        ev[f"rank{r}/samples_per_s"] = x[2] / busy_s if busy_s > 0 else 0.0
        ev[f"rank{r}/allreduce_ms_avg"] = x[4] / max(x[1], 1.0)
        ev[f"rank{r}/step_ms"] = (x[3] + x[5]) / max(x[1], 1.0)
        ev[f"rank{r}/data_starve_ms"] = x[6]
        ev[f"rank{r}/idle_frac"] = max(0.0, 1.0 - busy_s / wall) if wall > 0 else 0.0
    return events.Epoch(epoch=e, metrics=ev)


def _log_mlflow(uri: str, experiment_name: str, artifact_location: Optional[str], run_name: str, params: dict,
                tags: dict, events: list[dict], t_origin: float, status: str, out: str,
                parent_run_id: Optional[str]) -> str:
    from mlflow.entities import Metric

    from flodl_exp.tracking import client, create_run

    run_id = create_run(uri, experiment_name, artifact_location, run_name, params, tags, parent_run_id)
    c = client(uri)
    pts = []
    for ev in events:
        ts = int((t_origin + float(ev.get("t", 0.0))) * 1000)
        if ev.get("event") == "epoch":
            pts += [Metric(k, float(v), ts, int(ev["epoch"])) for k, v in ev.items()
                    if k not in ("event", "epoch", "t", "wall") and isinstance(v, (int, float))]
        elif ev.get("event") == "eval":
            pts += [Metric(k, float(v), ts, int(ev["epoch"])) for k, v in ev.items() if k.startswith("eval/")]
    for i in range(0, len(pts), 900):
        c.log_batch(run_id, metrics=pts[i:i + 900])
    for name in ("result.json", "events.jsonl"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            c.log_artifact(run_id, p, "run")
    c.set_terminated(run_id, status=status)
    return run_id


def run_torch(*, exp: dict, rank_speeds: tuple[float, ...] = (1.0, 0.33), seed: int = 42,
              lr_scale_ratio: float = 1.0, sleep_basis: str = "compute", out: str = "outputs/bench/ddp",
              tracking_uri: Optional[str] = None, experiment_name: str = "flodl_bench",
              artifact_location: Optional[str] = None, run_name: Optional[str] = None,
              parent_run_id: Optional[str] = None, tags: Optional[dict[str, str]] = None,
              start_method: str = "spawn", timeout_s: Optional[float] = None) -> dict:
    """Train ``exp`` (a resolved experiment config as a dict) with DDP over ``len(rank_speeds)`` processes, or in
    this process when there is one; blocking. Returns result.json plus ``run_id`` and ``events``."""
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    events_path, result_path = os.path.join(out, "events.jsonl"), os.path.join(out, "result.json")
    for p in (events_path, result_path):
        if os.path.exists(p):
            os.remove(p)
    world = len(rank_speeds)
    t_origin = time.time()
    args = {"exp": exp, "seed": seed, "speeds": [float(s) for s in rank_speeds], "lr_scale_ratio": lr_scale_ratio,
            "sleep_basis": sleep_basis, "events_path": events_path, "result_path": result_path, "t_origin": t_origin}
    status, failure = "FINISHED", None
    try:
        if world == 1:
            _worker(0, 1, 0, args)
        else:
            _spawn(world, args, start_method, timeout_s)
    except Exception as e:  # ProcessRaisedException carries the worker's traceback
        status, failure = "FAILED", f"{type(e).__name__}: {e}"
    events = []
    if os.path.exists(events_path):
        with open(events_path) as fh:
            events = [json.loads(line) for line in fh if line.strip()]
    result: dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path) as fh:
            result = json.load(fh)
    if failure:
        result.update(status="FAILED", failure=failure)
    result.setdefault("status", status)
    if tracking_uri:
        name = "ddp" if world > 1 else "solo"
        backend = "gloo_ddp" if world > 1 else "torch"
        params = {"experiment": exp, "mode": {"name": name, "policy": "sync", "backend": backend,
                                              "lr_scale_ratio": lr_scale_ratio, "sleep_basis": sleep_basis},
                  "cluster": {"ranks_per_node": world, "rank_speeds": list(rank_speeds)}, "seed": seed}
        all_tags = {"mode": name, "policy": "sync", "backend": backend, "world_size": str(world),
                    "experiment": str(exp.get("name", "?")), "outer": "avg",
                    "cluster": "local_hetero" if any(s < 1 for s in rank_speeds) else "local", **(tags or {})}
        if failure:
            all_tags["error"] = failure[:5000]
        result["run_id"] = _log_mlflow(tracking_uri, experiment_name, artifact_location,
                                       run_name or f"{exp.get('name', '?')}/{name}", params, all_tags, events, t_origin,
                                       result["status"], out, parent_run_id)
        with open(result_path, "w") as fh:
            json.dump(result, fh, indent=1)
    result["events"] = events
    return result


def _spawn(world: int, args: dict, start_method: str, timeout_s: Optional[float]) -> None:
    """W worker processes; the workers are killed (by pid) when they outlive ``timeout_s``."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_worker, args=(world, _free_port(), args), nprocs=world, join=False,
                             start_method=start_method)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"DDP workers still running after {timeout_s:.0f} s: killed")
