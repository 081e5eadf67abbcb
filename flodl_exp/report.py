"""Benchmark report from an MLflow experiment (algorithms.md 12.2, adapted to MLflow runs).

``python -m flodl_exp.report --experiment NAME [--parent-run ID] [--tracking-uri URI] [--out DIR]``

Why a separate module that only reads the store: the runs already hold every
per-epoch number (tags say which mode/cluster/world size, metric histories
carry the epochs), so a report is a pure function of them and can be redone at
any time, for a sweep (its parent run) or for a whole experiment. The MLflow
reading lives in :func:`load_runs` and :func:`generate_report`; everything
between (summaries, markdown, plots) takes plain data so it is testable
without a store.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from flodl_exp.fsio import atomic_text
from flodl_exp.reporting import EVAL_TOLERANCE, MISSING, best_and_fastest, fmt, fmt_delta, fmt_eval, sampled, secs, table

MODE_ORDER = ["nccl_sync", "nccl_cadence", "nccl_async", "cpu_sync", "cpu_cadence", "cpu_async"]
NEEDED = ("loss", "epoch_time_s", "syncs", "sync_ms_avg", "eval/accuracy", "eval/loss", "anchor",
          "divergence_max", "guard_action", "alive_ranks")
RANK_KEY = re.compile(r"^rank(\d+)/(batch_share|idle_frac)$")
PLOTS = ("loss_vs_time.png", "batch_share.png")


class ReportError(Exception):
    """A user-facing problem (unknown experiment, no runs): one line, exit status 2."""


@dataclass
class RunData:
    """One MLflow run as plain data: tags and per-epoch histories ``key -> [(step, value)]``."""

    run_id: str
    tags: dict[str, str]
    status: str = "FINISHED"
    start_time: int = 0
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass
class RunSummary:
    """The numbers one report row needs, derived from a :class:`RunData`."""

    run: RunData
    label: str
    experiment: str
    mode: str
    world_size: int
    epochs: int
    final_loss: float
    eval_value: Optional[float]
    total_s: float
    syncs: float
    sync_ms_avg: float
    util: list[float]
    idle_s: list[float]
    alive_final: Optional[int]

    @property
    def is_solo(self) -> bool:
        return self.world_size == 1


# -- pure: summaries -------------------------------------------------------
def _values(run: RunData, key: str) -> list[float]:
    return [v for _, v in run.history.get(key, [])]


def _last(run: RunData, key: str) -> Optional[float]:
    vals = _values(run, key)
    return vals[-1] if vals else None


def _ranks(run: RunData) -> list[int]:
    return sorted({int(m.group(1)) for k in run.history if (m := RANK_KEY.match(k))})


def eval_key(runs: Sequence[RunData]) -> Optional[str]:
    """Accuracy when any run has it (higher is better), else eval loss (lower is better)."""
    for key in ("eval/accuracy", "eval/loss"):
        if any(run.history.get(key) for run in runs):
            return key
    return None


def summarize(run: RunData, ekey: Optional[str]) -> RunSummary:
    """Totals and per-rank means of one run (idle s = Σ idle_frac · epoch_time_s)."""
    times = dict(run.history.get("epoch_time_s", []))
    util, idle = [], []
    for r in _ranks(run):
        fr = run.history.get(f"rank{r}/idle_frac", [])
        util.append(sum(1.0 - v for _, v in fr) / len(fr) if fr else math.nan)
        idle.append(sum(v * times.get(s, 0.0) for s, v in fr))
    syncs = _values(run, "syncs")
    sync_ms = _values(run, "sync_ms_avg")
    weighted = sum(n * ms for n, ms in zip(syncs, sync_ms))
    alive = _last(run, "alive_ranks")
    loss = _last(run, "loss")
    return RunSummary(
        run=run, label=run.tags.get("mode", "?"), experiment=run.tags.get("experiment", "?"),
        mode=run.tags.get("mode", "?"), world_size=int(run.tags.get("world_size") or len(_ranks(run)) or 1),
        epochs=len(run.history.get("loss", [])), final_loss=math.nan if loss is None else loss,
        eval_value=_last(run, ekey) if ekey else None, total_s=sum(times.values()), syncs=sum(syncs),
        sync_ms_avg=weighted / sum(syncs) if sum(syncs) else 0.0, util=util, idle_s=idle,
        alive_final=None if alive is None else int(alive))


def select_runs(runs: Sequence[RunData]) -> tuple[list[RunSummary], int]:
    """One summary per (experiment, mode, outer optimizer, world size, cluster): the latest finished run.

    Why not every run: repeated launches of the same configuration would make
    the per-mode table ambiguous; the count of superseded runs is reported.
    Runs without a loss history (sweep parents, jobs that died at start) are skipped.
    """
    usable = [r for r in runs if r.history.get("loss") and "mode" in r.tags]
    groups: dict[tuple, list[RunData]] = {}
    for r in usable:
        key = (r.tags.get("experiment", "?"), r.tags["mode"], r.tags.get("outer", "avg"), r.tags.get("world_size", "?"),
               r.tags.get("cluster", "?"))
        groups.setdefault(key, []).append(r)
    clusters: dict[str, set[str]] = {}
    for exp, _, _, _, cl in groups:
        clusters.setdefault(exp, set()).add(cl)
    out = []
    for (exp, mode, outer, _, cl), rs in groups.items():
        best = max(rs, key=lambda r: (r.status == "FINISHED", r.start_time))
        ekey = eval_key([r for r in usable if r.tags.get("experiment", "?") == exp])
        s = summarize(best, ekey)
        s.label = ((f"solo ({mode})" if s.is_solo else mode) + ("" if outer == "avg" else f" + {outer.split('(')[0]}")
                   + (f" @{cl}" if len(clusters[exp]) > 1 else ""))
        if best.status != "FINISHED":
            s.label += f" [{best.status}]"
        out.append(s)
    out.sort(key=lambda s: (s.experiment, not s.is_solo, MODE_ORDER.index(s.mode) if s.mode in MODE_ORDER else 99,
                            s.mode, s.label))
    return out, len(usable) - len(out)


def best_modes(rows: Sequence[RunSummary], higher_better: bool) -> Optional[tuple[RunSummary, RunSummary]]:
    """(best eval row, fastest row whose eval is within 2 % of the best): :func:`flodl_exp.reporting.best_and_fastest`."""
    bm = best_and_fastest(rows, lambda s: s.eval_value, lambda s: s.total_s, higher_better)
    if bm is None:
        return None
    best, fast = bm
    assert fast is not None  # the bar is the best eval: the best row itself qualifies
    return best, fast


# -- pure: markdown -----------------------------------------------------------
def _delta(v: Optional[float], ref: Optional[float], acc: bool) -> str:
    return fmt_delta(None if v is None or ref is None else v - ref, acc)


def _per_rank_cells(vals: list[float], n: int, spec: str, joined: bool) -> list[str]:
    cells = [fmt(vals[i], spec) if i < len(vals) else MISSING for i in range(n)]
    return [" / ".join(cells)] if joined else cells


def experiment_section(exp: str, rows: Sequence[RunSummary], ekey: Optional[str]) -> list[str]:
    """Main table, vs-solo table and loss trajectory for one experiment tag."""
    acc = ekey == "eval/accuracy"
    solo = next((s for s in rows if s.is_solo), None)
    n_ranks = max(len(s.util) for s in rows)
    joined = n_ranks > 4
    rank_hdr = (["Util " + "/".join(f"r{r}" for r in range(n_ranks)), "Idle s " + "/".join(f"r{r}" for r in range(n_ranks))]
                if joined else [f"R{r} util" for r in range(n_ranks)] + [f"R{r} idle s" for r in range(n_ranks)])
    header = ["Mode", "Ranks", "Final loss", "Eval acc" if acc else "Eval loss"] + (["Δ vs solo"] if solo else []) + \
        ["Total s", "Syncs", "Avg sync ms"] + rank_hdr
    body = []
    for s in rows:
        ranks = str(s.world_size) + (f" ({s.alive_final} alive)" if s.alive_final is not None and s.alive_final < s.world_size else "")
        delta = (["—" if s is solo else _delta(s.eval_value, solo.eval_value, acc)] if solo else [])
        body.append([s.label, ranks, fmt(s.final_loss), fmt_eval(s.eval_value, acc)] + delta +
                    [secs(s.total_s), f"{s.syncs:.0f}", fmt(s.sync_ms_avg, "{:.1f}")] +
                    _per_rank_cells(s.util, n_ranks, "{:.0%}", joined) + _per_rank_cells(s.idle_s, n_ranks, "{:.2f}", joined))
    lines = [f"## Experiment `{exp}`", "", *table(header, body), ""]
    if solo is not None and len(rows) > 1:
        lines += ["### Speedup and convergence vs solo", "",
                  "Speedup = solo total / mode total (equal epoch counts only); loss ratio = final loss / solo final loss.", ""]
        vs = [[s.label, fmt(solo.total_s / s.total_s, "{:.2f}×") if s.epochs == solo.epochs and s.total_s > 0 else "—",
               fmt(s.final_loss / solo.final_loss, "{:.2f}") if solo.final_loss else "—"] for s in rows if s is not solo]
        lines += [*table(["Mode", "Speedup", "Loss ratio"], vs), ""]
    n_ep = max(s.epochs for s in rows)
    traj = []
    for e in sampled(n_ep):
        traj.append([str(e + 1)] + [fmt(dict(s.run.history["loss"]).get(e)) for s in rows])  # step e is epoch e+1
    lines += ["### Per-epoch loss trajectory", "", *table(["Epoch"] + [s.label for s in rows], traj), ""]
    return lines


def build_markdown(title: str, rows: Sequence[RunSummary], superseded: int = 0, source: str = "",
                   plots: Sequence[str] = PLOTS) -> str:
    """The whole report.md for already summarised rows (grouped by experiment tag)."""
    exps: dict[str, list[RunSummary]] = {}
    for s in rows:
        exps.setdefault(s.experiment, []).append(s)
    commits = sorted({s.run.tags["git_commit"][:10] for s in rows if s.run.tags.get("git_commit")})
    clusters = sorted({s.run.tags.get("cluster", "?") for s in rows})
    lines = [f"# flodl_exp report: {title}", ""]
    if source:
        lines.append(f"- Source: {source}")
    lines += [f"- Runs: {len(rows)} in {len(exps)} experiment(s)" + (f" ({superseded} older duplicate run(s) not shown)" if superseded else ""),
              f"- Clusters: {', '.join(clusters)}", f"- Commits: {', '.join(commits) or 'unknown'}",
              "- Util = 1 − idle_frac (mean over epochs); idle s = Σ idle_frac · epoch_time_s; "
              "Avg sync ms is weighted by syncs per epoch.",
              "- Epochs count from 1, as the console does (MLflow's step is the 0-based index: epoch 1 is step 0).", ""]
    best_rows = []
    for exp, rs in exps.items():
        ekey = eval_key([s.run for s in rs])
        lines += experiment_section(exp, rs, ekey)
        acc = ekey == "eval/accuracy"
        bm = best_modes(rs, higher_better=acc)
        if bm:
            best_rows.append([exp, fmt_eval(bm[0].eval_value, acc), bm[0].label,
                              f"{secs(bm[1].total_s)} s ({fmt_eval(bm[1].eval_value, acc)})", bm[1].label])
    lines += ["## Best mode per experiment", ""]
    if best_rows:
        lines += table(["Experiment", "Best eval", "Mode", f"Fastest (within {EVAL_TOLERANCE:.0%} of best eval)", "Mode"], best_rows)
    else:
        lines.append("No run logged an eval metric.")
    lines += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    return "\n".join(lines)


# -- plots (matplotlib object API: no pyplot global state, no GUI backend) ----
def _figure(n: int, per_row: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    cols = min(n, per_row)
    nrows = max(1, math.ceil(n / cols))
    fig = Figure(figsize=(size[0] * cols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def plot_loss_vs_time(rows: Sequence[RunSummary], path: str) -> None:
    """Training loss against cumulative wall time, one line per run, one panel per experiment."""
    exps = sorted({s.experiment for s in rows})
    fig, axes = _figure(len(exps), 2, (6.5, 4.2))
    for ax, exp in zip(axes, exps):
        for s in (s for s in rows if s.experiment == exp):
            times = dict(s.run.history.get("epoch_time_s", []))
            pts = s.run.history["loss"]
            xs, t = [], 0.0
            for step, _ in pts:
                t += times.get(step, 0.0)
                xs.append(t)
            ax.plot(xs, [v for _, v in pts], marker="o", ms=3, lw=1.6, ls="--" if s.is_solo else "-", label=s.label)
        ax.set(title=f"{exp}: loss vs wall time", xlabel="cumulative epoch wall time (s)", ylabel="training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_batch_share(rows: Sequence[RunSummary], path: str) -> Any:
    """Per-rank batch share per epoch (epochs from 1), one panel per run (the balancer's view of the ranks); returns
    the figure."""
    multi = [s for s in rows if len(_ranks(s.run)) > 1] or list(rows)
    exps = {s.experiment for s in multi}
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(len(multi), 3, (4.6, 3.4))
    for ax, s in zip(axes, multi):
        for r in _ranks(s.run):
            pts = s.run.history.get(f"rank{r}/batch_share", [])
            ax.plot([p + 1 for p, _ in pts], [v for _, v in pts], marker="os^Dv"[r % 5], ms=4, ls=("-", "--", "-.", ":")[r % 4],
                    label=f"rank {r}")  # distinct styles: equal shares would otherwise hide one line
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.axhline(1 / max(1, s.world_size), color="grey", lw=0.8, ls=":")
        ax.set(title=(f"{s.experiment}: " if len(exps) > 1 else "") + s.label, xlabel="epoch", ylabel="batch share", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return fig


# -- MLflow edge ----------------------------------------------------------------
# -- pure: an Optuna study's trials, ranked by the objective ------------------------------------------------
TRIAL_TAG = "sweep.trial"
"""Tag of a study's trial run: its trial number (``hydra.job.num``)."""
TRIAL_OVERRIDES_TAG = "sweep.overrides"
"""Tag of a study's trial run: the trial's Hydra overrides, space-separated (a tracking URI redacted)."""
TRIAL_ERROR_TAG = "sweep.error"
"""Tag of a finished trial run the sweeper got no objective from (the metric missing): the one-line error."""
OBJECTIVE_METRIC = "objective"
"""Metric of a study's trial run: the objective value returned to the sweeper."""


@dataclass
class TrialRow:
    """One trial of a study as a ranking row: COMPLETE (a finite objective) or FAIL (``note`` says why)."""

    trial: Optional[int]
    params: dict[str, str]
    objective: Optional[float]
    status: str
    note: str = ""
    run_id: str = ""


def _override_values(overrides: str) -> dict[str, str]:
    """``key=value`` pairs of a space-separated override list (``+``/``~``/``++`` prefixes dropped)."""
    out = {}
    for item in overrides.split():
        key, sep, value = item.partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def trial_row(tags: dict[str, str], metrics: dict[str, float], status: str, run_id: str,
              swept: Sequence[str]) -> TrialRow:
    """A trial run's row: its number, the values of the swept keys, the objective it returned and its outcome."""
    try:
        number: Optional[int] = int(tags[TRIAL_TAG])
    except (KeyError, ValueError):
        number = None
    values = _override_values(tags.get(TRIAL_OVERRIDES_TAG, ""))
    params = {k: values.get(k, MISSING) for k in swept}
    value = metrics.get(OBJECTIVE_METRIC)
    note = ""
    if status != "FINISHED":
        err = (tags.get("error") or "").strip().splitlines()
        note = f"run {status}" + (f": {err[0]}" if err else "")
    elif tags.get(TRIAL_ERROR_TAG):
        note = tags[TRIAL_ERROR_TAG].strip().splitlines()[0]
    elif value is None:
        note = "no objective logged"
    elif not math.isfinite(value):
        note = f"objective is {value}"
    ok = not note
    return TrialRow(trial=number, params=params, objective=value if ok else None, status="COMPLETE" if ok else "FAIL",
                    note=note, run_id=run_id)


def rank_trials(rows: Sequence[TrialRow], direction: str) -> list[TrialRow]:
    """COMPLETE trials best first (``direction`` maximize: highest objective), ties by trial number; then the
    failed ones by trial number."""
    sign = -1.0 if direction == "maximize" else 1.0
    done = sorted((r for r in rows if r.status == "COMPLETE" and r.objective is not None),
                  key=lambda r: (sign * float(r.objective or 0.0), r.trial if r.trial is not None else math.inf))
    ranked = {id(r) for r in done}
    rest = sorted((r for r in rows if id(r) not in ranked), key=lambda r: r.trial if r.trial is not None else math.inf)
    return [*done, *rest]


def trials_markdown(title: str, ranked: Sequence[TrialRow], objective: str, direction: str,
                    swept: Sequence[str], source: str = "") -> str:
    """The study's ranking as markdown: a one-line account, then Rank | Trial | each swept key | objective |
    Status | Run (failed trials last, unranked, with their reason)."""
    done = [r for r in ranked if r.status == "COMPLETE"]
    lines = [f"# Study `{title}`: trials ranked by `{objective}` ({direction})", ""]
    if source:
        lines += [f"Source: {source}", ""]
    account = f"{len(ranked)} trials: {len(done)} complete, {len(ranked) - len(done)} failed."
    if done:
        best = done[0]
        params = ", ".join(f"{k}={v}" for k, v in best.params.items())
        account += f" Best: trial {best.trial}, {objective} {fmt(best.objective, '{:.6g}')}" + (f" ({params})" if params else "") + "."
    lines += [account, ""]
    body = []
    for i, r in enumerate(ranked):
        status = r.status if not r.note else f"{r.status}: {r.note if len(r.note) <= 160 else r.note[:157] + '...'}"
        body.append([str(i + 1) if r.status == "COMPLETE" else MISSING, MISSING if r.trial is None else str(r.trial),
                     *[r.params.get(k, MISSING) for k in swept], fmt(r.objective, "{:.6g}"), status, r.run_id[:8]])
    lines += [*table(["Rank", "Trial", *swept, objective, "Status", "Run"], body), ""]
    return "\n".join(lines)


def generate_trials_report(client: Any, parent_run_id: str, children: Sequence[Any], out: str, title: str,
                           objective: str, direction: str, swept: Sequence[str]) -> tuple[str, list[TrialRow]]:
    """``out``/trials.md from a study's child runs (MLflow ``Run`` objects), logged to the parent under
    ``report/``; returns (its path, the ranked rows)."""
    rows = [trial_row(dict(r.data.tags), dict(r.data.metrics), r.info.status, r.info.run_id, swept) for r in children]
    ranked = rank_trials(rows, direction)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "trials.md")
    atomic_text(trials_markdown(title, ranked, objective, direction, swept, f"children of run `{parent_run_id}`"),
                path, mode=None)
    client.log_artifact(parent_run_id, path, "report")
    return os.path.abspath(path), ranked


def _client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:  # a re-logged step: latest wins
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def known_experiments(client: Any) -> str:
    """The store's experiments, for an error line: ``the store has a, b`` (sorted; deleted ones left out)."""
    try:
        names = sorted({e.name for e in client.search_experiments(max_results=1000)})
    except Exception as e:  # the line names the unknown experiment either way
        return f"the store's experiments could not be listed ({type(e).__name__})"
    if not names:
        return "the store has no experiments"
    shown = ", ".join(names[:50]) + (f", ... ({len(names) - 50} more)" if len(names) > 50 else "")
    return f"the store has {shown}"


def load_runs(client: Any, experiment_name: str, parent_run_id: Optional[str] = None) -> list[RunData]:
    """Runs of the experiment (children of ``parent_run_id`` only, when given) with their histories."""
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        raise ReportError(f"unknown experiment {experiment_name!r}: {known_experiments(client)}")
    if parent_run_id:
        try:
            client.get_run(parent_run_id)
        except Exception:
            raise ReportError(f"unknown parent run {parent_run_id!r}") from None
    filt = f"tags.mlflow.parentRunId = '{parent_run_id}'" if parent_run_id else ""
    found, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], filter_string=filt, max_results=1000, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            break
    runs = []
    for r in found:
        keys = [k for k in r.data.metrics if k in NEEDED or RANK_KEY.match(k)]
        runs.append(RunData(run_id=r.info.run_id, tags=dict(r.data.tags), status=r.info.status,
                            start_time=r.info.start_time or 0, history={k: _history(client, r.info.run_id, k) for k in keys}))
    return runs


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"


def generate_report(experiment: str, tracking_uri: Optional[str] = None, out: Optional[str] = None,
                    parent_run_id: Optional[str] = None) -> str:
    """Read the store, write report.md + PNGs under ``out``, log them to the parent run; returns report.md's path."""
    uri = tracking_uri or f"sqlite:///{os.path.abspath(os.path.join('outputs', 'mlflow.db'))}"
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        raise ReportError(f"no MLflow store at {uri[len('sqlite:///'):]}")  # MlflowClient would create an empty one
    client = _client(uri)
    runs = load_runs(client, experiment, parent_run_id)
    rows, superseded = select_runs(runs)
    if not rows:
        scope = f"child runs of {parent_run_id}" if parent_run_id else "runs"
        raise ReportError(f"no {scope} with training metrics in experiment {experiment!r}")
    out = out or os.path.join("outputs", "reports", _safe(experiment))
    os.makedirs(out, exist_ok=True)
    plot_loss_vs_time(rows, os.path.join(out, PLOTS[0]))
    plot_batch_share(rows, os.path.join(out, PLOTS[1]))
    source = f"{uri}, experiment `{experiment}`" + (f", children of run `{parent_run_id}`" if parent_run_id else "")
    md_path = os.path.join(out, "report.md")
    atomic_text(build_markdown(experiment, rows, superseded, source), md_path, mode=None)
    if parent_run_id:
        for name in ("report.md", *PLOTS):
            client.log_artifact(parent_run_id, os.path.join(out, name), "report")
    return os.path.abspath(md_path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flodl_exp.report", description="Markdown + PNG benchmark report from MLflow runs.")
    p.add_argument("--experiment", required=True, help="MLflow experiment name")
    p.add_argument("--parent-run", default=None, help="only the child runs of this run; the report is logged to it")
    p.add_argument("--tracking-uri", default=None, help="default: sqlite:///<cwd>/outputs/mlflow.db")
    p.add_argument("--out", default=None, help="default: outputs/reports/<experiment>")
    a = p.parse_args(argv)
    try:
        print(generate_report(a.experiment, a.tracking_uri, a.out, a.parent_run))
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
