"""Self-contained HTML dashboard of one training job (algorithms.md 9.5, ``dashboard_html``).

Why one file with inline SVG and no scripts: the dashboard is written at
teardown next to the job's other outputs and must open years later from a
cluster share, an e-mail attachment or an MLflow artifact view, with no server,
no sibling files and no network (CDNs are often blocked on clusters). Charts
are therefore plain SVG generated here (no matplotlib import on the teardown
path), colours come from CSS variables so one document serves light, dark or
the viewer's preference (``auto`` = ``prefers-color-scheme``).

``render_dashboard`` is pure (data in, HTML string out); ``write_dashboard``
writes it atomically; ``load_events`` and ``python -m flodl_exp.dashboard``
rebuild a dashboard from a job folder's ``events.jsonl``.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
from typing import Any, Iterable, Optional, Sequence

from flodl_exp.fsio import atomic_text

THEMES = ("light", "dark", "auto")
_LIGHT = ("--bg:#ffffff;--fg:#1f2328;--muted:#656d76;--grid:#d8dee4;--panel:#f6f8fa;"
          "--c0:#1f77b4;--c1:#d62728;--c2:#2ca02c;--c3:#9467bd;--c4:#ff7f0e;--c5:#17becf;--c6:#8c564b;--c7:#e377c2;")
_DARK = ("--bg:#0d1117;--fg:#e6edf3;--muted:#8d96a0;--grid:#30363d;--panel:#161b22;"
         "--c0:#58a6ff;--c1:#ff7b72;--c2:#3fb950;--c3:#d2a8ff;--c4:#ffa657;--c5:#39c5cf;--c6:#e3b341;--c7:#f778ba;")
_CSS = """
body{background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .5em;border-bottom:1px solid var(--grid)}
.meta{color:var(--muted)}.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
figure{margin:0;background:var(--panel);border:1px solid var(--grid);border-radius:6px;padding:6px}
svg{width:100%;height:auto;display:block}svg text{fill:var(--fg);font-size:11px}svg .muted{fill:var(--muted)}
svg .grid{stroke:var(--grid);stroke-width:1}svg .axis{stroke:var(--muted);stroke-width:1}
.scroll{max-height:420px;overflow:auto;border:1px solid var(--grid);border-radius:6px}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;width:100%}
th,td{padding:3px 8px;text-align:right;border-bottom:1px solid var(--grid);white-space:nowrap}
th{position:sticky;top:0;background:var(--panel)}td:first-child,th:first-child{text-align:left}
.empty{color:var(--muted);font-style:italic}
"""
W, H = 560, 270
PAD_L, PAD_R, PAD_B = 58, 14, 36
Series = tuple[str, list[tuple[float, float]]]


def theme_css(theme: str) -> str:
    """CSS variables for ``theme``; ``auto`` follows the viewer's colour-scheme preference."""
    if theme not in THEMES:
        raise ValueError(f"theme must be one of {THEMES}, got {theme!r}")
    if theme == "light":
        return f":root{{{_LIGHT}color-scheme:light}}"
    if theme == "dark":
        return f":root{{{_DARK}color-scheme:dark}}"
    return f":root{{{_LIGHT}color-scheme:light dark}}@media (prefers-color-scheme: dark){{:root{{{_DARK}}}}}"


# -- formatting ----------------------------------------------------------------
def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def fmt_value(v: Any) -> str:
    """Table cell text: integers as integers, large numbers grouped, others 4 significant digits."""
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return html.escape(str(v))
    if not math.isfinite(v):
        return "—"
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _tick(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 or float(v).is_integer() else f"{v:.3g}"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1-2-5 steps) so axes read at a glance."""
    if hi <= lo:
        lo, hi = lo - (abs(lo) * 0.1 or 1.0), hi + (abs(hi) * 0.1 or 1.0)
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int(math.ceil((hi - start) / step - 1e-9)) + 1)]


# -- SVG charts ---------------------------------------------------------------
def svg_chart(title: str, series: Sequence[Series], xlabel: str, ylabel: str, *, integer_x: bool = False) -> str:
    """A line chart as inline SVG; one colour variable per series, hover titles on points."""
    series = [(name, [(x, y) for x, y in pts if _num(x) is not None and _num(y) is not None]) for name, pts in series]
    series = [s for s in series if s[1]]
    head = f'<figure><svg viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(title)}">'
    head += f'<text x="{PAD_L}" y="16" font-weight="600">{html.escape(title)}</text>'
    if not series:
        return head + f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="muted">no data</text></svg></figure>'
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    xt, yt = _nice_ticks(min(xs), max(xs)), _nice_ticks(min(ys), max(ys))
    if integer_x:
        xt = [t for t in xt if float(t).is_integer()] or xt
    x0, x1 = min(xt[0], min(xs)), max(xt[-1], max(xs))
    y0, y1 = min(yt[0], min(ys)), max(yt[-1], max(ys))
    legend, lx, ly = [], PAD_L, 34  # legend rows under the title, wrapping, so many ranks never overlap
    for i, (name, _) in enumerate(series):
        width = 7 * len(name) + 24
        if lx + width > W - PAD_R and lx > PAD_L:
            lx, ly = PAD_L, ly + 15
        legend.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="var(--c{i % 8})"/>'
                      f'<text x="{lx + 13}" y="{ly}">{html.escape(name)}</text>')
        lx += width
    top = ly + 10
    pw, ph = W - PAD_L - PAD_R, H - top - PAD_B
    sx = lambda x: PAD_L + (x - x0) / ((x1 - x0) or 1) * pw
    sy = lambda y: top + ph - (y - y0) / ((y1 - y0) or 1) * ph
    out = [head, *legend]
    for t in yt:
        out.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                   f'<text x="{PAD_L - 5}" y="{sy(t) + 4:.1f}" text-anchor="end" class="muted">{_tick(t)}</text>')
    for t in xt:
        out.append(f'<text x="{sx(t):.1f}" y="{H - PAD_B + 15}" text-anchor="middle" class="muted">{_tick(t)}</text>')
    out.append(f'<line class="axis" x1="{PAD_L}" x2="{W - PAD_R}" y1="{top + ph}" y2="{top + ph}"/>'
               f'<line class="axis" x1="{PAD_L}" x2="{PAD_L}" y1="{top}" y2="{top + ph}"/>'
               f'<text x="{PAD_L + pw / 2}" y="{H - 4}" text-anchor="middle" class="muted">{html.escape(xlabel)}</text>'
               f'<text transform="translate(12 {top + ph / 2}) rotate(-90)" text-anchor="middle" class="muted">{html.escape(ylabel)}</text>')
    for i, (name, pts) in enumerate(series):
        color = f"var(--c{i % 8})"
        dash = ' stroke-dasharray="6 3"' if i >= 8 else ""
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="{path}"/>')
        if len(pts) <= 200:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}">'
                       f'<title>{html.escape(name)}: {_tick(x)} → {fmt_value(y)}</title></circle>' for x, y in pts)
    return "".join(out) + "</svg></figure>"


def _series(rows: Iterable[dict], xkey: str, ykey: str) -> list[tuple[float, float]]:
    return [(float(r[xkey]), float(r[ykey])) for r in rows if _num(r.get(xkey)) is not None and _num(r.get(ykey)) is not None]


def _rank_keys(rows: Iterable[dict], suffix: str) -> list[str]:
    pat = re.compile(rf"^rank(\d+)/{re.escape(suffix)}$")
    found = {k for r in rows for k in r if pat.match(k)}
    return sorted(found, key=lambda k: int(pat.match(k).group(1)))  # type: ignore[union-attr]


def _charts(epochs: list[dict], windows: list[dict], evals: list[dict]) -> list[str]:
    loss = [("train loss", _series(epochs, "epoch", "loss"))]
    if any("eval/loss" in e for e in evals):
        loss.append(("eval loss", _series(evals, "epoch", "eval/loss")))
    charts = [svg_chart("Loss per epoch", loss, "epoch", "loss", integer_x=True)]
    eval_keys = sorted({k for e in evals for k in e if k.startswith("eval/") and k != "eval/loss"})
    if eval_keys:
        charts.append(svg_chart("Eval", [(k[5:], _series(evals, "epoch", k)) for k in eval_keys], "epoch", "value", integer_x=True))
    charts.append(svg_chart("Throughput", [("samples/s", _series(epochs, "epoch", "samples_per_s"))], "epoch", "samples/s", integer_x=True))
    shares = _rank_keys(epochs, "batch_share")
    if shares:
        charts.append(svg_chart("Batch share per rank", [(k.split("/")[0], _series(epochs, "epoch", k)) for k in shares],
                                "epoch", "share", integer_x=True))
    if windows:
        charts.append(svg_chart("Window loss", [("loss", _series(windows, "step", "loss"))], "global step", "loss"))
        if any("anchor" in w for w in windows):
            charts.append(svg_chart("Anchor", [("anchor", _series(windows, "step", "anchor"))], "global step", "batches"))
        wshares = _rank_keys(windows, "share")
        if wshares:
            charts.append(svg_chart("Window share per rank", [(k.split("/")[0], _series(windows, "step", k)) for k in wshares],
                                    "global step", "share"))
    return charts


# -- tables ---------------------------------------------------------------------
def html_table(rows: Sequence[dict], first: str) -> str:
    """All keys of ``rows`` as columns (``first`` leading, then first-seen order)."""
    if not rows:
        return '<p class="empty">no records</p>'
    cols = [first] if any(first in r for r in rows) else []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt_value(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def merge_evals(epochs: Sequence[dict], evals: Sequence[dict]) -> list[dict]:
    """Epoch feed rows with each eval's ``eval/*`` values joined on ``epoch`` (evals without an epoch row appended)."""
    by_epoch = {e.get("epoch"): dict(e) for e in epochs}
    rows = [by_epoch[e.get("epoch")] for e in epochs]
    for ev in evals:
        vals = {k: v for k, v in ev.items() if k.startswith("eval/") or k == "final"}
        target = by_epoch.get(ev.get("epoch"))
        if target is None:
            target = {"epoch": ev.get("epoch")}
            by_epoch[ev.get("epoch")] = target
            rows.append(target)
        target.update(vals)
    return rows


def render_dashboard(title: str, epochs: list[dict], windows: list[dict], evals: list[dict], theme: str = "auto",
                     links: Sequence[tuple[str, str]] = ()) -> str:
    """One self-contained HTML document: summary, inline SVG charts, epoch feed and window tables.
    ``links``: (text, relative href) pairs shown under the summary (the run's timeline artifact)."""
    css = theme_css(theme)
    epochs, windows, evals = list(epochs or []), list(windows or []), list(evals or [])
    last = epochs[-1] if epochs else {}
    last_eval = evals[-1] if evals else {}
    facts = [f"{len(epochs)} epoch(s)", f"{len(windows)} window(s)", f"{len(evals)} eval(s)"]
    if _num(last.get("loss")) is not None:
        facts.append(f"final loss {fmt_value(last['loss'])}")
    facts += [f"{html.escape(k)} {fmt_value(v)}" for k, v in last_eval.items() if k.startswith("eval/")]
    t = html.escape(title)
    return "\n".join([
        "<!DOCTYPE html>", f'<html lang="en" data-theme="{theme}">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">', f"<title>{t}</title>",
        f"<style>{css}{_CSS}</style>", "</head>", "<body>", f"<h1>{t}</h1>", f'<p class="meta">{" · ".join(facts)}</p>',
        *([f'<p class="links">{" · ".join(_link(t, h) for t, h in links)}</p>'] if links else []),
        '<h2>Charts</h2>', '<div class="charts">', *_charts(epochs, windows, evals), "</div>",
        "<h2>Epoch feed</h2>", html_table(merge_evals(epochs, evals), "epoch"),
        "<h2>Window records</h2>", html_table(windows, "step"), "</body>", "</html>", ""])


def _link(text: str, href: str) -> str:
    if "://" in href or href.startswith("//"):
        raise ValueError(f"dashboard links are relative (the page names no URL), got {href!r}")
    return f'<a href="{html.escape(href)}">{html.escape(text)}</a>'


def write_dashboard(path: str, title: str, epochs: list[dict], windows: list[dict], evals: list[dict],
                    theme: str = "auto", links: Sequence[tuple[str, str]] = ()) -> str:
    """Render and write atomically (temp file + rename), so a reader never sees half a page."""
    doc = render_dashboard(title, epochs, windows, evals, theme, links)
    atomic_text(doc, path)
    return os.path.abspath(path)


def load_events(path: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(epochs, windows, evals) from a coordinator ``events.jsonl`` (torn last line ignored)."""
    epochs: list[dict] = []
    windows: list[dict] = []
    evals: list[dict] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.pop("event", None)
            ev.pop("t", None)
            ev.pop("wall", None)
            {"epoch": epochs, "window": windows, "eval": evals}.get(kind, []).append(ev)
    return epochs, windows, evals


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flodl_exp.dashboard", description="HTML dashboard from a job's events.jsonl.")
    p.add_argument("events", help="events.jsonl or the job folder holding it")
    p.add_argument("--out", default=None, help="default: dashboard.html next to events.jsonl")
    p.add_argument("--theme", choices=THEMES, default="auto")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    src = os.path.join(a.events, "events.jsonl") if os.path.isdir(a.events) else a.events
    if not os.path.isfile(src):
        print(f"error: no events file at {src}", file=sys.stderr)
        return 2
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(src)), "dashboard.html")
    title = a.title or os.path.basename(os.path.dirname(os.path.abspath(src)))
    print(write_dashboard(out, title, *load_events(src), theme=a.theme))
    return 0


if __name__ == "__main__":
    sys.exit(main())
