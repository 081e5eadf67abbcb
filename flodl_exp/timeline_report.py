"""Timeline artifacts of one run: ``timeline.json``, ``timeline.csv`` and a self-contained ``timeline.html``.

The recorder (``coordinator/timeline.py``) holds the spans; this module turns them into files. The HTML is
one document with the data inline, a canvas per rank lane drawn by a little inline script (wheel to
zoom around the cursor, drag to pan, double-click to reset, hover for a span's details), a legend, the
epoch table and the idle analysis. Like the dashboard, it must open years later from a cluster share or
an MLflow artifact view: no server, no sibling files and no network, so the page names no URL at all.

Times are seconds from the training wall's start (the first epoch's plans going out).
``timeline_data`` is pure; ``write_timeline`` writes the three files atomically; ``read_csv`` reads
the CSV back into the JSON's rows.
"""
from __future__ import annotations

import csv
import html
import json
import math
import os
from typing import Any, Optional

from flodl_exp.coordinator.timeline import CAUSES, KINDS, TimelineRecorder
from flodl_exp.fsio import atomic_text

COLUMNS = ("rank", "kind", "start_s", "end_s", "epoch", "window", "n", "busy_ms", "data_ms", "note")
FILES = ("timeline.json", "timeline.csv", "timeline.html")
COLORS = {"compute": "#2ca02c", "data": "#ff7f0e", "sync": "#1f77b4", "cpu_avg": "#9467bd", "eval": "#d62728"}
CAUSE_COLORS = {"epoch_boundary": "#8c564b", "sync": "#9ecae1", "cpu_avg": "#c5b0d5", "eval": "#ff9896",
                "unexplained": "#7f7f7f"}


def _r(x: float) -> float:
    return round(float(x), 6)


def timeline_data(rec: TimelineRecorder, meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Everything the three files hold, as one JSON-ready dict (times relative to the training wall's start)."""
    start, end = rec.training_wall()
    rows = [[s.rank, s.kind, _r(s.t0 - start), _r(s.t1 - start), s.epoch, s.window, s.n, _r(s.busy_ms), _r(s.data_ms),
             s.note] for s in rec.spans()]
    idle = rec.idle_analysis()
    idle["start"], idle["end"] = 0.0, _r(idle["end"] - start)
    return {
        "format": "flodl_exp.timeline/1",
        "meta": dict(meta or {}),
        "world_size": rec.world_size,
        "wall_s": _r(end - start),
        "bounds": {"max_spans_per_rank": rec.max_spans, "merge_gap_s": rec.merge_gap_s, "min_gap_s": rec.min_gap_s,
                   "near_s": rec.near_s},
        "kinds": list(KINDS),
        "causes": list(CAUSES),
        "columns": list(COLUMNS),
        "spans": rows,
        "epochs": [{"epoch": w.epoch, "start_s": _r(w.start - start), "end_s": _r(w.end - start),
                    "idle_frac": {str(r): v for r, v in sorted(w.idle_frac.items())}} for w in rec.epochs],
        "idle_analysis": idle,
    }


# -- files -------------------------------------------------------------------------
def render_csv(data: dict[str, Any]) -> str:
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for row in data["spans"]:
        w.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def read_csv(path: str) -> list[list[Any]]:
    """``timeline.csv`` back into the JSON's span rows (empty cells -> None)."""
    ints, floats = {"rank", "epoch", "window", "n"}, {"start_s", "end_s", "busy_ms", "data_ms"}
    out = []
    with open(path, encoding="utf-8", newline="") as fh:
        rd = csv.reader(fh)
        head = next(rd)
        for rec in rd:
            row: list[Any] = []
            for col, v in zip(head, rec):
                if col in ints:
                    row.append(None if v == "" else int(v))
                elif col in floats:
                    row.append(float(v))
                else:
                    row.append(v)
            out.append(row)
    return out


def write_timeline(directory: str, rec: TimelineRecorder, meta: Optional[dict[str, Any]] = None) -> list[str]:
    """Write the three files into ``directory`` (created); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    data = timeline_data(rec, meta)
    texts = (json.dumps(data, separators=(",", ":"), allow_nan=False), render_csv(data),
             render_html(data))
    paths = [os.path.join(directory, f) for f in FILES]
    for p, text in zip(paths, texts):
        atomic_text(text, p)
    return paths


# -- HTML ----------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "—" if not math.isfinite(v) else f"{v:.{digits}f}"
    return html.escape(str(v))


def _idle_table(data: dict[str, Any]) -> str:
    ia = data["idle_analysis"]
    causes = data["causes"]
    head = ["rank", "compute s", "data s", "idle s", *[f"idle: {c} s" for c in causes], "sync spans", "sync span s",
            "idle frac (training wall)",
            "idle frac (epoch walls)", "idle frac (run)", "diff"]
    rows = []
    for r, v in sorted(ia["ranks"].items(), key=lambda kv: int(kv[0])):
        cells = [f"rank {r}", _fmt(v["compute_s"]), _fmt(v["data_s"]), _fmt(v["idle_s"]),
                 *[_fmt(v["idle_by_cause_s"].get(c, 0.0)) for c in causes], _fmt(v.get("sync_spans", 0)),
                 _fmt(v.get("sync_span_s", 0.0)), _fmt(v["idle_frac"]),
                 _fmt(v["idle_frac_epochs"]), _fmt(v["run_idle_frac"]), _fmt(v["diff"])]
        rows.append(f'<tr class="idle-row" data-rank="{html.escape(r)}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return (f'<div class="wide"><table id="idle-analysis"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody>'
            '</table></div>')


def _epoch_table(data: dict[str, Any]) -> str:
    """Epochs counted from 1 as the console and the report count them (the data's ``epoch`` is the 0-based index,
    MLflow's step)."""
    ranks = [str(r) for r in range(data["world_size"])]
    th = "".join(f"<th>{h}</th>" for h in ["epoch", "start s", "end s", *[f"rank {r} idle_frac" for r in ranks]])
    rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in [
        _fmt(e["epoch"] + 1), _fmt(e["start_s"]), _fmt(e["end_s"]), *[_fmt(e["idle_frac"].get(r)) for r in ranks]]) + "</tr>"
        for e in data["epochs"])
    return f'<table id="epochs"><thead><tr>{th}</tr></thead><tbody>{rows}</tbody></table>'


def _legend() -> str:
    items = [f'<span class="sw" style="background:{c}"></span>{k}' for k, c in COLORS.items()]
    items += [f'<span class="sw" style="background:{c}"></span>idle: {k}' for k, c in CAUSE_COLORS.items()]
    return '<div id="legend">' + "".join(f'<span class="item">{i}</span>' for i in items) + "</div>"


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em auto;max-width:1400px;padding:0 1em;color:#1f2328;background:#fff}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.1em;margin:1.2em 0 .4em;border-bottom:1px solid #d8dee4}
.meta,.hint{color:#656d76}#legend .item{margin-right:14px;white-space:nowrap}
.sw{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px;border-radius:2px}
#lanes{border:1px solid #d8dee4;border-radius:6px;user-select:none;cursor:grab}
.lane{display:flex;align-items:center;border-bottom:1px solid #eef1f4}.lane .label{width:70px;flex:none;padding-left:6px}
.lane canvas,#axis canvas{flex:1;height:44px;display:block;min-width:0}#axis{display:flex}#axis .label{width:70px;flex:none}
#axis canvas{height:24px}#tip{position:fixed;pointer-events:none;background:#1f2328;color:#fff;padding:4px 7px;
border-radius:4px;font-size:12px;display:none;white-space:pre}
.wide{overflow-x:auto}table{border-collapse:collapse;font-variant-numeric:tabular-nums}th,td{padding:3px 8px;text-align:right;
border-bottom:1px solid #d8dee4;white-space:nowrap}td:first-child,th:first-child{text-align:left}
"""

_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('timeline-data').textContent);
const COL = JSON.parse(document.getElementById('timeline-colors').textContent);
const C = D.columns, I = k => C.indexOf(k);
const iR=I('rank'), iK=I('kind'), iA=I('start_s'), iB=I('end_s'), iE=I('epoch'), iW=I('window'), iN=I('n'),
      iBusy=I('busy_ms'), iData=I('data_ms'), iNote=I('note');
const byRank = {};
for (const s of D.spans) (byRank[s[iR]] = byRank[s[iR]] || []).push(s);
let tmax = Math.max(D.wall_s, 1e-3);
for (const s of D.spans) tmax = Math.max(tmax, s[iB]);
const full = [0, tmax];
let view = full.slice();
const lanes = [...document.querySelectorAll('.lane')];
const BAND = {idle:[4,26], compute:[4,26], data:[4,26], sync:[30,40], cpu_avg:[30,40], eval:[30,40]};
const ORDER = ['idle','data','compute','sync','cpu_avg','eval'];
function color(s){ return s[iK]==='idle' ? (COL.causes[s[iNote]]||'#999') : (COL.kinds[s[iK]]||'#999'); }
function fit(cv){ const r = cv.getBoundingClientRect(), d = window.devicePixelRatio||1;
  cv.width = Math.max(1, Math.round(r.width*d)); cv.height = Math.max(1, Math.round(r.height*d));
  const g = cv.getContext('2d'); g.setTransform(d,0,0,d,0,0); return [g, r.width, r.height]; }
function draw(){
  const span = view[1]-view[0];
  for (const lane of lanes){
    const cv = lane.querySelector('canvas'), [g, w] = fit(cv), rows = byRank[lane.dataset.rank] || [];
    g.clearRect(0,0,w,44); let n = 0;
    for (const e of D.epochs){ const x = (e.end_s-view[0])/span*w; if (x>=0 && x<=w){ g.fillStyle='#bbb'; g.fillRect(x,0,1,44);} }
    for (const kind of ORDER){
      const [y0,y1] = BAND[kind];
      for (const s of rows){
        if (s[iK]!==kind || s[iB]<view[0] || s[iA]>view[1]) continue;
        const x0 = (s[iA]-view[0])/span*w, x1 = (s[iB]-view[0])/span*w;
        g.fillStyle = color(s); g.fillRect(x0, y0, Math.max(1, x1-x0), y1-y0); n++;
      }
    }
    lane.dataset.drawn = String(n);
  }
  const ax = document.querySelector('#axis canvas'), [g, w] = fit(ax);
  g.clearRect(0,0,w,24); g.fillStyle='#656d76'; g.font='11px system-ui,sans-serif';
  const raw = span/8, mag = Math.pow(10, Math.floor(Math.log10(raw))), step = [1,2,5,10].map(m=>m*mag).find(v=>v>=raw);
  for (let t = Math.ceil(view[0]/step)*step; t <= view[1]; t += step){
    const x = (t-view[0])/span*w; g.fillRect(x,0,1,5); g.fillText(+t.toPrecision(6)+' s', x+2, 16); }
  for (const e of D.epochs){ const x = (e.end_s-view[0])/span*w; if (x>=0 && x<=w) g.fillText('e'+(e.epoch+1)+'|', x-22, 24); }
  document.body.dataset.view = view[0].toFixed(6) + ',' + view[1].toFixed(6);
  document.body.dataset.ready = '1';
}
function tAt(ev, el){ const r = el.getBoundingClientRect(); return view[0] + (ev.clientX-r.left)/r.width*(view[1]-view[0]); }
const box = document.getElementById('lanes'), tip = document.getElementById('tip');
box.addEventListener('wheel', ev => { ev.preventDefault(); const cv = lanes[0].querySelector('canvas');
  const t = tAt(ev, cv), f = Math.exp(ev.deltaY*0.0015), a = t-(t-view[0])*f, b = t+(view[1]-t)*f;
  if (b-a > 1e-6) view = [Math.max(full[0]-(full[1]-full[0]), a), Math.min(full[1]*2, b)]; draw(); }, {passive:false});
let drag = null;
box.addEventListener('mousedown', ev => { drag = {x: ev.clientX, v: view.slice()}; box.style.cursor='grabbing'; });
window.addEventListener('mouseup', () => { drag = null; box.style.cursor=''; });
window.addEventListener('mousemove', ev => {
  if (drag){ const w = lanes[0].querySelector('canvas').getBoundingClientRect().width, dt = (ev.clientX-drag.x)/w*(drag.v[1]-drag.v[0]);
    view = [drag.v[0]-dt, drag.v[1]-dt]; draw(); return; }
  const lane = ev.target.closest && ev.target.closest('.lane');
  if (!lane || ev.target.tagName!=='CANVAS'){ tip.style.display='none'; return; }
  const t = tAt(ev, ev.target), y = ev.clientY - ev.target.getBoundingClientRect().top, lower = y > 28;
  const hit = (byRank[lane.dataset.rank]||[]).filter(s => s[iA]<=t && t<=s[iB] && (BAND[s[iK]][0]>=30)===lower)
    .sort((p,q) => ORDER.indexOf(q[iK])-ORDER.indexOf(p[iK]))[0];
  if (!hit){ tip.style.display='none'; return; }
  tip.textContent = hit[iK] + (hit[iNote] ? ' ('+hit[iNote]+')' : '') + '  rank ' + hit[iR] +
    '\n' + hit[iA].toFixed(4) + ' -> ' + hit[iB].toFixed(4) + ' s  (' + ((hit[iB]-hit[iA])*1e3).toFixed(1) + ' ms)' +
    '\nepoch ' + (hit[iE]===null ? '-' : hit[iE]+1) + '  window ' + hit[iW] + '  n ' + hit[iN] +
    (hit[iK]==='compute' ? '\ncompute ' + hit[iBusy].toFixed(1) + ' ms  data ' + hit[iData].toFixed(1) + ' ms' : '');
  tip.style.left = (ev.clientX+12)+'px'; tip.style.top = (ev.clientY+12)+'px'; tip.style.display='block';
});
box.addEventListener('dblclick', () => { view = full.slice(); draw(); });
document.getElementById('reset').addEventListener('click', () => { view = full.slice(); draw(); });
window.addEventListener('resize', draw);
draw();
})();
"""


def _script_json(v: Any) -> str:
    """JSON safe inside a <script> element (no '</' can close it)."""
    return json.dumps(v, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def render_html(data: dict[str, Any]) -> str:
    """The self-contained page: one lane per rank, zoomable, legend, epochs and the idle analysis."""
    meta = data.get("meta") or {}
    title = html.escape(str(meta.get("title") or "flodl_exp timeline"))
    ia = data["idle_analysis"]
    facts = [f"{data['world_size']} rank(s)", f"training wall {data['wall_s']:.3f} s",
             f"{len(data['epochs'])} epoch(s)", f"{len(data['spans'])} span(s)",
             f"every idle gap classified (drawn from {ia['min_gap_s']:g} s)"]
    facts += [f"{html.escape(str(k))} {html.escape(str(v))}" for k, v in meta.items() if k != "title"]
    lanes = "".join(f'<div class="lane" data-rank="{r}"><div class="label">rank {r}</div><canvas></canvas></div>'
                    for r in range(data["world_size"]))
    colors = {"kinds": COLORS, "causes": CAUSE_COLORS}
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">', f"<title>{title}</title>",
        f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{title}</h1>", f'<p class="meta">{" · ".join(facts)}</p>',
        _legend(),
        '<p class="hint">Wheel: zoom around the cursor · drag: pan · double-click or '
        '<button id="reset" type="button">reset</button> · upper band: compute, data wait and classified idle '
        'gaps; lower band: sync, cpu averaging, eval · grey lines: epoch aggregations.</p>',
        f'<div id="lanes">{lanes}</div>', '<div id="axis"><div class="label"></div><canvas></canvas></div>',
        '<div id="tip"></div>',
        "<h2>Idle analysis</h2>",
        f'<p class="hint">Idle = neither compute nor data wait (sync and eval time included, as in idle_frac), over '
        f'the training wall ({ia["wall_s"]:.3f} s). The run\'s idle_frac is per epoch; its wall-weighted mean '
        f'(idle frac (run)) is over the epochs\' walls ({ia["epoch_walls_s"]:.3f} s: they overlap by '
        f'{ia["epoch_overlap_s"]:.3f} s where a rank streams into the next epoch), and so is idle frac (epoch walls), '
        'the timeline\'s busy time on that wall. Idle gaps of at least '
        f'{ia["min_gap_s"]:g} s or more are drawn as idle spans; every gap, whatever its length, is classified by '
        f'the events around it (shorter ones against the newest events). Sync spans: the reduces the rank took part '
        f'in and their seconds (idle or not).</p>',
        _idle_table(data), "<h2>Epochs</h2>", _epoch_table(data),
        f'<script type="application/json" id="timeline-data">{_script_json(data)}</script>',
        f'<script type="application/json" id="timeline-colors">{_script_json(colors)}</script>',
        f"<script>{_JS}</script>", "</body>", "</html>", ""])
