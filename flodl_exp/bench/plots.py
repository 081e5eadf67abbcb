"""The suite's plots (matplotlib's object API on Agg: no pyplot state, no display): loss against wall time per
model, speedup vs solo_fast per model and run, and idle seconds by cause per run."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from flodl_exp.bench.report import CAUSES, PLOTS, BenchRow, _run_columns, group, idle_rows, reference, speedup
from flodl_exp.report import _figure


def plot_loss_vs_time(by_model: dict[str, list[BenchRow]], path: str) -> None:
    fig, axes = _figure(max(1, len(by_model)), 3, (5.2, 3.6))
    for ax, (m, rs) in zip(axes, by_model.items()):
        for r in rs:
            times = dict(r.epoch_times)
            xs, t = [], 0.0
            for e, _ in r.losses:
                t += times.get(e, 0.0)
                xs.append(t)
            ax.plot(xs, [v for _, v in r.losses], marker="o", ms=3, lw=1.4, ls="--" if r.run.startswith("solo") else "-",
                    label=r.run)
        ax.set(title=f"{m}: loss vs time", xlabel="cumulative epoch wall (s)", ylabel="training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def plot_speedup(by_model: dict[str, list[BenchRow]], path: str) -> None:
    cols = _run_columns(by_model)
    fig, axes = _figure(1, 1, (max(6.0, 1.1 * len(by_model) * max(1, len(cols)) / 3), 4.0))
    ax = axes[0]
    width = 0.8 / max(1, len(cols))
    for i, c in enumerate(cols):
        ys = []
        for rs in by_model.values():
            by = {r.run: r for r in rs}
            s = speedup(by[c], reference(rs)) if c in by else None
            ys.append(s if s is not None else 0.0)
        ax.bar([j + i * width for j in range(len(by_model))], ys, width, label=c)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(by_model))], list(by_model))
    ax.set(title="speedup vs solo_fast (solo_fast total / run total)", ylabel="×")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=100)


def plot_idle(by_model: dict[str, list[BenchRow]], path: str) -> None:
    """Idle seconds (all ranks) per run, stacked by cause where a timeline classified them."""
    labels, stacks = [], []
    for m, rs in by_model.items():
        for r in rs:
            if r.world_size < 2:
                continue
            acc = {c: 0.0 for c in (*CAUSES, "idle_frac")}
            for _, tot, by_cause, _src in idle_rows(r):
                for c, v in (by_cause.items() if by_cause else [("idle_frac", tot)]):
                    acc[c] = acc.get(c, 0.0) + v
            labels.append(f"{m}/{r.run}")
            stacks.append(acc)
    fig, axes = _figure(1, 1, (max(6.0, 0.35 * len(labels)), 4.2))
    ax = axes[0]
    bottom = [0.0] * len(labels)
    for c in (*CAUSES, "idle_frac"):
        ys = [s.get(c, 0.0) for s in stacks]
        if any(ys):
            ax.bar(range(len(labels)), ys, 0.7, bottom=bottom, label=c if c != "idle_frac" else "no timeline (idle_frac)")
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(range(len(labels)), labels, rotation=75, fontsize=6)
    ax.set(title="idle seconds by cause (all ranks)", ylabel="s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=100)


def write_plots(rows: Sequence[BenchRow], out: str, models: Optional[Sequence[str]] = None) -> list[str]:
    by_model = group(rows, models)
    paths = [os.path.join(out, p) for p in PLOTS]
    for fn, p in zip((plot_loss_vs_time, plot_speedup, plot_idle), paths):
        fn(by_model, p)
    return paths
