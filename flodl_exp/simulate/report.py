"""The simulator's report: the bench table's columns (experiments/bench_hetero.py) where they apply, per-rank
shares and idle, and a plot; plus each mode's ``events.jsonl`` in the schema real runs write, so the tools
that read a job folder's events read a simulated one too.

Definitions, as the bench's: wall s = from the first chunks to the last epoch aggregated; samples/s =
training samples / wall s; syncs = reduces counted in the epochs (the final consensus reduce after the last
epoch is not); mean sync ms = the coordinator's reduce-cycle wall; fast-rank batch share = the fastest
declared rank's share of all batches. efficiency = samples/s / the sum of every rank's solo samples/s
(``batch x 1000 / (step_ms + data_ms + batch_message_ms)``); vs DDP = samples/s / an analytic DDP on the same rig (equal
split, one gradient all-reduce per step: ``W x batch / (slowest step + all-reduce)``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from flodl_exp.config import outer_spec
from flodl_exp.policy.controllers import guard_name
from flodl_exp.simulate.costs import Costs
from flodl_exp.simulate.engine import RunStats
from flodl_exp.simulate.topology import SimulateConfig, rank_steps


def summarize(st: RunStats, fast: int) -> dict[str, Any]:
    """The row of one simulated mode."""
    epochs = [e for e in st.epochs if e.get("event") == "epoch"]
    samples = sum(float(e["samples"]) for e in epochs)
    wall = st.wall_s
    n_sync = int(round(sum(float(e.get("syncs", 0)) for e in epochs)))
    w = [(float(e.get("syncs", 0)), float(e.get("sync_ms_avg", 0))) for e in epochs]
    sync_ms = sum(n * ms for n, ms in w) / n_sync if n_sync else 0.0
    total_b = sum(st.batches) or 1
    shares = [b / total_b for b in st.batches]
    idle = [max(0.0, 1.0 - ms / (wall * 1e3)) if wall > 0 else 0.0 for ms in st.busy_ms]
    return {"name": st.mode, "wall_s": wall, "samples": samples, "samples_per_s": samples / wall if wall > 0 else 0.0,
            "syncs": n_sync, "sync_ms": sync_ms, "fast_share": shares[fast], "shares": shares, "idle": idle,
            "anchor_last": epochs[-1].get("anchor") if epochs else None, "events": st.events,
            "curve": [(float(e["t"]), sum(float(x["samples"]) for x in epochs[: i + 1])) for i, e in enumerate(epochs)]}


def references(cfg: SimulateConfig) -> dict[str, float]:
    """Analytic reference throughputs: solo on the fastest rank, the ideal sum, and DDP."""
    steps = rank_steps(cfg)
    per = [cfg.batch_size * 1e3 / (ms + d + cfg.link.batch_message_ms) for ms, d, _ in steps]
    costs = Costs(cfg.link, cfg.model_mb * 1e6)
    slowest = max(ms + d for ms, d, _ in steps)
    ddp = len(steps) * cfg.batch_size / ((slowest + cfg.link.batch_message_ms) / 1e3 + costs.allreduce_s(len(steps)))
    return {"solo_fast": max(per), "ideal": sum(per), "ddp": ddp}


def fastest_rank(cfg: SimulateConfig) -> int:
    steps = rank_steps(cfg)
    return min(range(len(steps)), key=lambda r: (steps[r][0] + steps[r][1], r))


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, spec)


def render(cfg: SimulateConfig, rows: list[dict[str, Any]], seconds: float) -> str:
    steps = rank_steps(cfg)
    refs = references(cfg)
    w = len(steps)
    fast = fastest_rank(cfg)
    distinct = sorted({round(ms, 3) for ms, _, _ in steps})
    step_txt = ", ".join(f"{ms:g}" for ms in distinct[:8]) + (" ..." if len(distinct) > 8 else "")
    lines = [
        f"# What-if: rig `{cfg.rig}`, {w} ranks, {cfg.epochs} epochs",
        "",
        f"{cfg.samples} samples, batch {cfg.batch_size}, model {cfg.model_mb:g} MB; step ms {step_txt} (fast rank "
        f"{fast}); link {cfg.link.bandwidth_gbps:g} Gbit/s, {cfg.link.latency_ms:g} ms, collective fixed "
        f"{cfg.link.collective_fixed_ms:g} ms; guard {guard_name(cfg.guard)}, outer {outer_spec(cfg).describe()}. Simulated in "
        f"{seconds:.2f} s.",
        "",
        "| run | wall s | samples/s | efficiency | vs DDP | syncs | mean sync ms | fast-rank batch share | "
        "fast-rank idle | slowest-rank idle | anchor | events |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    slow = max(range(w), key=lambda r: (steps[r][0] + steps[r][1], -r))
    for name, sps in (("solo_fast (analytic)", refs["solo_fast"]), ("ddp (analytic)", refs["ddp"])):
        lines.append(f"| {name} | - | {sps:.0f} | {sps / refs['ideal']:.2f} | {sps / refs['ddp']:.2f}x | - | - | - | - | - | - | - |")
    for r in rows:
        sps = r["samples_per_s"]
        lines.append(f"| {r['name']} | {r['wall_s']:.2f} | {sps:.0f} | {sps / refs['ideal']:.2f} | "
                     f"{sps / refs['ddp']:.2f}x | {r['syncs']} | {r['sync_ms']:.1f} | {r['fast_share']:.2f} | "
                     f"{r['idle'][fast]:.2f} | {r['idle'][slow]:.2f} | {_fmt(r['anchor_last'], '.0f')} | {r['events']} |")
    if w <= 8:
        lines += ["", "Per-rank batch share (idle fraction):", "",
                  "| run | " + " | ".join(f"rank {q}" for q in range(w)) + " |", "|---|" + "---:|" * w]
        for r in rows:
            cells = [f"{s:.2f} ({i:.2f})" for s, i in zip(r["shares"], r["idle"])]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    else:
        lines += ["", "Per-rank batch share min / max (idle min / max):", ""]
        for r in rows:
            lines.append(f"- {r['name']}: share {min(r['shares']):.4f} / {max(r['shares']):.4f}, idle "
                         f"{min(r['idle']):.2f} / {max(r['idle']):.2f}")
    lines += ["", "wall s = first chunks to the last epoch aggregated (simulated); efficiency = samples/s / the sum of "
              "the ranks' solo samples/s; vs DDP = samples/s / an analytic DDP (one gradient all-reduce per step).", ""]
    return "\n".join(lines)


def figure(cfg: SimulateConfig, rows: list[dict[str, Any]]) -> Any:
    """The what-if figure: samples trained against the simulated wall, and each rank's batch share (integer rank
    ticks: one per rank under its group of bars)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.8))
    ax1, ax2 = fig.subplots(1, 2)
    for r in rows:
        if r["curve"]:
            xs, ys = zip(*[(0.0, 0.0), *r["curve"]])
            ax1.plot(xs, ys, marker="o", ms=3, lw=1.5, label=r["name"])
    ax1.set_xlabel("simulated training wall (s)")
    ax1.set_ylabel("samples trained (cumulative, per epoch)")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    w = len(rows[0]["shares"]) if rows else 0
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        if w <= 16:
            ax2.bar([q - 0.4 + (i + 0.5) * width for q in range(w)], r["shares"], width=width, label=r["name"])
        else:
            ax2.plot(range(w), r["shares"], lw=1, label=r["name"])
    if w <= 16:
        ax2.set_xticks(range(w))  # the bars of rank q are centred on q
    else:
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("rank")
    ax2.set_ylabel("batch share")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(f"what-if: {cfg.rig}, {w} ranks, {cfg.epochs} epochs")
    fig.tight_layout()
    return fig


def plot(cfg: SimulateConfig, rows: list[dict[str, Any]], path: str) -> None:
    figure(cfg, rows).savefig(path, dpi=110)


def write(cfg: SimulateConfig, stats: list[RunStats], rows: list[dict[str, Any]], md: str,
          out: Optional[str]) -> list[str]:
    """report.md, report.png (``plot``) and <mode>/events.jsonl under ``out``; the paths written."""
    if not out:
        return []
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "report.md")]
    with open(paths[0], "w") as fh:
        fh.write(md)
    for st in stats:
        d = os.path.join(out, st.mode)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "events.jsonl"), "w") as fh:
            for e in st.epochs:
                fh.write(json.dumps(e) + "\n")
        paths.append(os.path.join(d, "events.jsonl"))
    if cfg.plot and rows:
        paths.append(os.path.join(out, "report.png"))
        plot(cfg, rows, paths[-1])
    return paths
