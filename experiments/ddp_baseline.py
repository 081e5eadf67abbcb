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
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def load_experiment(name: str, epochs: Optional[int] = None, batch_size: Optional[int] = None) -> dict:
    """The experiment preset as a plain dict (``conf/experiment/<name>.yaml``)."""
    from omegaconf import OmegaConf

    path = os.path.join(ROOT, "conf", "experiment", f"{name}.yaml")
    exp = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(exp, dict):
        raise ValueError(f"{path}: an experiment preset is a mapping, not a {type(exp).__name__}")
    if epochs is not None:
        exp["epochs"] = int(epochs)
    if batch_size is not None:
        exp["batch_size"] = int(batch_size)
    return exp


def run_ddp(*, experiment: str = "digits_wide", epochs: Optional[int] = None, batch_size: Optional[int] = None,
            rank_speeds: tuple[float, ...] = (1.0, 0.33), seed: int = 42, lr_scale_ratio: float = 1.0,
            sleep_basis: str = "compute", out: str = "outputs/bench/ddp", tracking_uri: Optional[str] = None,
            experiment_name: str = "bench_hetero", artifact_location: Optional[str] = None,
            run_name: Optional[str] = None) -> dict:
    """Run the DDP baseline on a preset (blocking); returns result.json (+ run_id, events). The training itself
    is the package's (``flodl_exp.bench.ddp.run_torch``, which the benchmark suite runs too)."""
    from flodl_exp.bench.ddp import run_torch

    exp = load_experiment(experiment, epochs, batch_size)
    return run_torch(exp=exp, rank_speeds=tuple(rank_speeds), seed=seed, lr_scale_ratio=lr_scale_ratio,
                     sleep_basis=sleep_basis, out=out, tracking_uri=tracking_uri, experiment_name=experiment_name,
                     artifact_location=artifact_location, run_name=run_name or f"{exp['name']}/ddp",
                     start_method="spawn")


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
