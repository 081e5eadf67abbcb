"""Issue 51's first question, measured: how much slower is a training step while an all-reduce runs in the background?

    python experiments/overlap_probe.py [--channels 48] [--steps 150] [--rounds 3] [--timeout-s 300]

Overlapped averaging (issue 51) has a rank send its contribution and train the next window while the reduce runs
(one ``all_reduce(async_op=True)`` on Gloo, polled between steps). Whether the 3:1 rig can reach 0.90 of the solo
sum on this machine depends on what that background reduce costs the training thread. Two processes (one torch
thread each, Gloo on 127.0.0.1), the zoo's WideCNN on digits-sized batches of 16, and per round, side by side:

* ``alone``: train steps, no communication;
* ``blocking``: the parameter all-reduce, blocking, on its own (what a stopped rank waits for today);
* ``overlapped``: train steps while all-reduces of the same size run back to back in the background (a new one
  starts as soon as the last completed, polled after each step: the most a rank could overlap).

It prints a table (medians over the rounds) and one line: ``overlap slowdown <pct> %, reduce <ms> ms blocking,
<ms> ms overlapped``. No product code is involved: it is the measurement issue 51's design asks for first.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, poll: Any = None) -> list[float]:
    """``n`` train steps on random digits-shaped batches; each step's ms. ``poll`` runs after each step."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out.append((time.perf_counter() - t0) * 1e3)
        if poll is not None:
            poll()
    return out


class BackgroundReduces:
    """All-reduces of ``flat`` back to back, at most ``limit``: :meth:`poll` (after each step) starts the next once the
    last completed, as an overlapped rank would; ``done`` holds each one's ms from start to the poll that saw it."""

    def __init__(self, flat: torch.Tensor, limit: int) -> None:
        self.flat, self.limit = flat, limit
        self.work: Any = None
        self.t0 = 0.0
        self.started = 0
        self.done: list[float] = []

    def poll(self) -> None:
        if self.work is not None and not self.work.is_completed():
            return
        if self.work is not None:
            self.done.append((time.perf_counter() - self.t0) * 1e3)
            self.work = None
        if self.started < self.limit:
            self.t0 = time.perf_counter()
            self.work = dist.all_reduce(self.flat, async_op=True)
            self.started += 1

    def drain(self) -> None:
        """Finish every reduce this rank owes (its peer runs the same count)."""
        while self.work is not None:
            self.work.wait()
            self.poll()


def _worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from flodl_exp.zoo.digits_wide import WideCNN

    torch.manual_seed(0)
    model = WideCNN(args.channels)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    _steps(model, opt, 20)  # warm-up
    rows = []
    for _ in range(args.rounds):
        dist.barrier()
        alone = statistics.mean(_steps(model, opt, args.steps))
        dist.barrier()
        blocking = []
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            blocking.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        # Both ranks start and finish the same number of reduces: each starts its k-th reduce when its (k-1)-th
        # completed, so the collectives pair up in order however the steps interleave.
        bg = BackgroundReduces(flat, args.reduces)
        bg.poll()
        overlapped = statistics.mean(_steps(model, opt, args.steps, bg.poll))
        bg.drain()
        rows.append({"alone": alone, "blocking": statistics.median(blocking), "overlapped": overlapped,
                     "reduce_overlapped": statistics.median(bg.done) if bg.done else float("nan"),
                     "reduces": len(bg.done)})
    queue.put((rank, rows, flat.numel()))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="step-time cost of a background all-reduce (issue 51)")
    p.add_argument("--channels", type=int, default=48, help="WideCNN width (48: the bench's digits_wide)")
    p.add_argument("--steps", type=int, default=150, help="train steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reduces", type=int, default=None,
                   help="background reduces per overlapped measurement, at most (default: --steps, so one is in flight "
                        "during every step: each completes within about one step)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    args.reduces = args.steps if args.reduces is None else args.reduces
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + args.timeout_s
    results: dict[int, list[dict[str, float]]] = {}
    numel = 0
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                r, rows, numel = queue.get(timeout=1.0)
                results[r] = rows
            except Exception:
                if any(pr.exitcode not in (None, 0) for pr in procs):
                    break
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    if len(results) < 2:
        print("overlap probe: the workers did not finish within --timeout-s", file=sys.stderr)
        return 1
    print(f"WideCNN({args.channels}), {numel:,} parameters ({numel * 4 / 1e6:.2f} MB), batch 16, 2 ranks x 1 thread, "
          f"Gloo on 127.0.0.1; step ms: the mean of {args.steps} steps, median of {args.rounds} rounds; load "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| rank | step ms alone | step ms with a reduce in flight | slowdown | all_reduce ms blocking | "
          "all_reduce ms overlapped | reduces overlapped |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for r in (0, 1):
        rows = results[r]
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        slow = 100.0 * (med["overlapped"] / med["alone"] - 1.0)
        summary.append((slow, med))
        print(f"| {r} | {med['alone']:.2f} | {med['overlapped']:.2f} | {slow:+.1f} % | {med['blocking']:.2f} | "
              f"{med['reduce_overlapped']:.2f} | {med['reduces']:.0f} |")
    slow = statistics.mean(s for s, _ in summary)
    print(f"\noverlap slowdown {slow:.1f} %, reduce {statistics.mean(m['blocking'] for _, m in summary):.2f} ms "
          f"blocking, {statistics.mean(m['reduce_overlapped'] for _, m in summary):.2f} ms overlapped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
