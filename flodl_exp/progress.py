"""Terminal UX: a live bar on a TTY (rich), plain lines otherwise, then a one-screen summary."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from flodl_exp.jobs.launcher import RunHandle


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
    if kind == "auto_mode":  # as training starts, not only in the summary: the user sees what is running
        mode, reason = str(ev.get("mode")), str(ev.get("reason") or "")
        return f"mode=auto chose {mode}: {reason.removeprefix(mode + ': ')}"
    return None


def follow(handle: RunHandle, mode: str = "auto", out: Any = None) -> None:
    """Show progress until the job is done (returns on completion; Ctrl-C propagates)."""
    out = out or sys.stdout
    epochs = int(handle.cfg.experiment.epochs)
    if mode == "off":
        while not handle.done():
            time.sleep(0.2)
        return
    queue = _QueueWatch(handle)
    if mode == "bar" or (mode == "auto" and out.isatty()):
        _follow_bar(handle, queue, epochs)
    else:
        _follow_plain(handle, queue, epochs, out)


def _note_start(queue: _QueueWatch, kind: Any) -> None:
    """The scheduler's queue is watched until the ranks start, and again after a preemption requeues the job."""
    if kind in ("joined", "started", "resumed"):
        queue.started = True
    elif kind == "preempted":
        queue.started, queue.last_state = False, ""


def _plain_lines(ev: dict, epochs: int, t0: float) -> list[str]:
    """The lines one event prints in plain mode."""
    kind = ev.get("event")
    lines = [other] if (other := _fmt_other(ev)) else []
    if kind == "epoch":
        lines.append(_fmt_epoch(ev, epochs))
    elif kind == "eval":
        accs = "  ".join(f"{k}={v:.4f}" for k, v in ev.items() if k.startswith("eval/"))
        lines.append(f"{'final ' if ev.get('final') else ''}eval (epoch {ev['epoch'] + 1}): {accs}")
    elif kind == "rank_dead":
        lines.append(f"rank {ev['rank']} died: {ev.get('reason')}")
    elif kind == "started":
        lines.append(f"started: {ev['world_size']} rank(s) after {time.monotonic() - t0:.1f}s")
    return lines


def _follow_plain(handle: RunHandle, queue: _QueueWatch, epochs: int, out: Any) -> None:
    t0 = time.monotonic()
    while True:
        done = handle.done()
        line = queue.poll()
        if line:
            print(line, file=out, flush=True)
        for ev in handle.poll_events():
            _note_start(queue, ev.get("event"))
            for text in _plain_lines(ev, epochs, t0):
                print(text, file=out, flush=True)
        if done:
            return
        time.sleep(0.2)


def _bar_update(bar: Any, task: Any, ev: dict) -> None:
    """What one event changes on the bar (its other lines print above it)."""
    kind = ev.get("event")
    other = _fmt_other(ev)
    if other:
        bar.console.print(other)
    if kind == "preempted":
        bar.update(task, description="requeued")
    if kind == "started":
        bar.update(task, description="training")
    elif kind == "epoch":
        shares = " ".join(f"{ev[k]:.2f}" for k in sorted(ev) if k.endswith("/batch_share"))
        bar.update(task, completed=ev["epoch"] + 1,
                   info=f"loss {ev.get('loss', 0):.4f} | {ev.get('samples_per_s', 0):.0f}/s | syncs {int(ev.get('syncs', 0))} | share {shares}")


def _follow_bar(handle: RunHandle, queue: _QueueWatch, epochs: int) -> None:
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
                _note_start(queue, ev.get("event"))
                _bar_update(bar, task, ev)
            if done:
                return
            time.sleep(0.2)


def sync_count(epochs: list[dict], total: Any) -> str:
    """The summary's syncs as the console and the report count them (the sum of the epochs' ``syncs``), and the
    averaging rounds no epoch counts (the final consensus; under async, a round that lands while no epoch is open)
    said as such: the run's ``syncs`` tag, ``total``, counts those too, and a summary that said 4 where every other
    view said 3 read as a bug."""
    in_epochs = int(sum(float(e.get("syncs", 0) or 0) for e in epochs))
    if not isinstance(total, (int, float)) or int(total) <= in_epochs:
        return str(in_epochs)
    extra = int(total) - in_epochs
    if extra == 1:
        return f"{in_epochs} during the epochs, +1 after the last (the final consensus)"
    return f"{in_epochs} during the epochs, +{extra} between or after them (the final consensus included)"


PREDICTION_MIN_WALL_S = 5.0
"""The summary compares the simulator's prediction with the run only over at least this much training wall (the
first epoch's start to the last one's end). Shorter runs are dominated by what the simulator does not model (the
first batches' warm-up, the first chunk's hand-out): ``digits_mlp``'s 0.1-1.6 s of training were off by +3 % to
+88 % (``digits_wide`` over 3.8 s and 11.6 s: +3.0 % and -8.9 %), a line that taught users to distrust the
simulator behind ``mode=auto``. MLflow gets both figures on every run (``predicted/*``,
``measured/*``)."""


def prediction_line(pred: Optional[dict[str, float]]) -> Optional[str]:
    """The summary's ``predicted`` line, or None where the measurement means little (a short training wall, or a
    prediction without the measured wall it is compared over)."""
    if not pred:
        return None
    wall = pred.get("measured/wall_s")
    if wall is None or not wall >= PREDICTION_MIN_WALL_S:
        return None
    return (f"  predicted   {pred['predicted/samples_per_s']:.0f} samples/s on the measured rig; measured "
            f"{pred['measured/samples_per_s']:.0f} over {wall:.1f}s of training ({pred['predicted/error_pct']:+.1f}%)")


def summary(handle: RunHandle, result: Optional[dict], wall_s: float, error: Optional[str] = None) -> str:
    uri = handle.tracking_uri
    lines = ["", "flodl_exp run summary", f"  run id      {handle.run_id}", f"  job folder  {handle.job_dir}"]
    if result:
        ev = [e for e in handle.events if e.get("event") == "epoch"]
        if ev:
            lines.append(f"  final loss  {ev[-1].get('loss', float('nan')):.4f}")
        for k, v in (result.get("final_eval") or {}).items():
            lines.append(f"  {k:<11} {v:.4f}")
        lines.append(f"  syncs       {sync_count(ev, result.get('syncs'))}   global step {result.get('global_step')}")
        auto = result.get("auto")
        if isinstance(auto, dict) and auto.get("mode"):  # mode=auto: what it chose and why
            lines.append(f"  mode=auto   {auto['mode']} ({auto.get('reason', '')})")
        if result.get("deaths"):
            dead = ", ".join(f"rank {d.get('rank')}" for d in result["deaths"])
            lines.append(f"  deaths      {dead}   retrained picks {result.get('retrained_picks', 0)}")
        if result.get("lost_picks"):
            lines.append(f"  LOST PICKS  {result['lost_picks']} trained picks of dead ranks are in no consensus and were not "
                         "retrained (no survivor)")
        bundle = f"{result.get('stem')}.pt"
        if result.get("stem") and os.path.exists(bundle):  # named only when one was written
            lines.append(f"  bundle      {bundle}")
        else:
            lines.append("  bundle      none written")
    export = getattr(handle, "model_export", None)
    if export is not None:
        lines.append(f"  model       exporting to MLflow in the background (pid {export.pid}; tag model_export; "
                     f"log {os.path.join(handle.job_dir, 'model_export.log')})")
    line = prediction_line(getattr(handle, "prediction", None))
    if line:
        lines.append(line)
    lines.append(f"  wall time   {wall_s:.1f}s")
    lines.append(f"  status      {'FAILED: ' + error.splitlines()[0] if error else 'FINISHED'}")
    lines.append(f"  MLflow UI   mlflow ui --host 127.0.0.1 --backend-store-uri {uri}")
    return "\n".join(lines)
