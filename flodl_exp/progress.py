"""Terminal UX: a live bar on a TTY (rich), plain lines otherwise, then a one-screen summary."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

from .jobs.launcher import RunHandle


def _fmt_epoch(ev: dict, epochs: int) -> str:
    shares = " ".join(f"r{k[4:-12]}={ev[k]:.2f}" for k in sorted(ev) if k.startswith("rank") and k.endswith("/batch_share"))
    return (f"epoch {ev['epoch'] + 1}/{epochs}  loss {ev.get('loss', float('nan')):.4f}  "
            f"{ev.get('samples_per_s', 0):.0f} samples/s  syncs {int(ev.get('syncs', 0))}  share {shares}")


QUEUE_POLL_S = 3.0
QUEUE_REPEAT_S = 30.0


class _QueueWatch:
    """Scheduler state until the ranks start: a line on each change, else every QUEUE_REPEAT_S."""

    def __init__(self, handle: RunHandle) -> None:
        self.handle = handle
        self.t0 = time.monotonic()
        self.last_poll = 0.0
        self.last_print = 0.0
        self.last_state = ""
        self.started = not handle.on_slurm

    def poll(self) -> Optional[str]:
        now = time.monotonic()
        if self.started or now - self.last_poll < QUEUE_POLL_S:
            return None
        self.last_poll = now
        state = self.handle.queue_state()
        if state != self.last_state or now - self.last_print >= QUEUE_REPEAT_S:
            self.last_state, self.last_print = state, now
            since = f"{now - self.t0:.0f}s since submission"
            if state.startswith("PENDING"):
                return f"queued ({state}) job {self.handle.job_id}, {since}"
            if state.startswith("RUNNING"):
                return f"job {self.handle.job_id} RUNNING: starting the coordinator and ranks, {since}"
            return f"job {self.handle.job_id} {state}, {since}"
        return None


def _fmt_other(ev: dict) -> Optional[str]:
    kind = ev.get("event")
    if kind == "preempt_requested":
        return f"time limit / preemption signal: saving bundle {ev.get('stem')}"
    if kind == "preempted":
        return (f"preempted at epoch {ev['epoch'] + 1} (global step {ev.get('global_step')}): bundle {ev.get('stem')}; "
                "the job is requeued and resumes into this run")
    if kind == "resumed":
        return f"resumed (attempt {ev['attempt']}) from {ev.get('stem')} at epoch {ev['epoch'] + 1}"
    if kind == "terminated":
        return f"job terminated: {ev.get('status')} ({ev.get('reason')})"
    return None


def follow(handle: RunHandle, mode: str = "auto", out: Any = None) -> None:
    """Show progress until the job is done (returns on completion; Ctrl-C propagates)."""
    out = out or sys.stdout
    epochs = int(handle.cfg.experiment.epochs)
    if mode == "off":
        while not handle.done():
            time.sleep(0.2)
        return
    use_bar = mode == "bar" or (mode == "auto" and out.isatty())
    queue = _QueueWatch(handle)
    if not use_bar:
        t0 = time.monotonic()
        while True:
            done = handle.done()
            line = queue.poll()
            if line:
                print(line, file=out, flush=True)
            for ev in handle.poll_events():
                kind = ev.get("event")
                if kind in ("joined", "started", "resumed"):
                    queue.started = True
                elif kind == "preempted":
                    queue.started, queue.last_state = False, ""
                other = _fmt_other(ev)
                if other:
                    print(other, file=out, flush=True)
                if kind == "epoch":
                    print(_fmt_epoch(ev, epochs), file=out, flush=True)
                elif kind == "eval":
                    accs = "  ".join(f"{k}={v:.4f}" for k, v in ev.items() if k.startswith("eval/"))
                    print(f"{'final ' if ev.get('final') else ''}eval (epoch {ev['epoch'] + 1}): {accs}", file=out, flush=True)
                elif kind == "rank_dead":
                    print(f"rank {ev['rank']} died: {ev.get('reason')}", file=out, flush=True)
                elif kind == "started":
                    print(f"started: {ev['world_size']} rank(s) after {time.monotonic() - t0:.1f}s", file=out, flush=True)
            if done:
                return
            time.sleep(0.2)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} epochs"),
                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False) as bar:
        task = bar.add_task("starting ranks", total=epochs, info="")
        while True:
            done = handle.done()
            line = queue.poll()
            if line:
                bar.update(task, description=line.split(",")[0])
            for ev in handle.poll_events():
                if ev.get("event") in ("joined", "started", "resumed"):
                    queue.started = True
                elif ev.get("event") == "preempted":
                    queue.started, queue.last_state = False, ""
                other = _fmt_other(ev)
                if other:
                    bar.console.print(other)
                if ev.get("event") == "preempted":
                    bar.update(task, description="requeued")
                if ev.get("event") == "started":
                    bar.update(task, description="training")
                elif ev.get("event") == "epoch":
                    shares = " ".join(f"{ev[k]:.2f}" for k in sorted(ev) if k.endswith("/batch_share"))
                    bar.update(task, completed=ev["epoch"] + 1,
                               info=f"loss {ev.get('loss', 0):.4f} | {ev.get('samples_per_s', 0):.0f}/s | syncs {int(ev.get('syncs', 0))} | share {shares}")
            if done:
                return
            time.sleep(0.2)


def summary(handle: RunHandle, result: Optional[dict], wall_s: float, error: Optional[str] = None) -> str:
    uri = handle.tracking_uri
    lines = ["", "flodl_exp run summary", f"  run id      {handle.run_id}", f"  job folder  {handle.job_dir}"]
    if result:
        ev = [e for e in handle.events if e.get("event") == "epoch"]
        if ev:
            lines.append(f"  final loss  {ev[-1].get('loss', float('nan')):.4f}")
        for k, v in (result.get("final_eval") or {}).items():
            lines.append(f"  {k:<11} {v:.4f}")
        lines.append(f"  syncs       {result.get('syncs')}   global step {result.get('global_step')}")
        if result.get("deaths"):
            dead = ", ".join(f"rank {d.get('rank')}" for d in result["deaths"])
            lines.append(f"  deaths      {dead}   retrained picks {result.get('retrained_picks', 0)}")
        if result.get("lost_picks"):
            lines.append(f"  LOST PICKS  {result['lost_picks']} trained picks of dead ranks are in no consensus and were not "
                         "retrained (no survivor)")
        lines.append(f"  bundle      {result.get('stem')}.pt")
    lines.append(f"  wall time   {wall_s:.1f}s")
    lines.append(f"  status      {'FAILED: ' + error.splitlines()[0] if error else 'FINISHED'}")
    lines.append(f"  MLflow UI   mlflow ui --host 127.0.0.1 --backend-store-uri {uri}")
    return "\n".join(lines)
