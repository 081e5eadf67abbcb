"""Self-contained HTML dashboard (flodl_exp.dashboard): pure rendering, atomic write, events.jsonl loader."""
from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest

from flodl_exp import dashboard as dash

EPOCHS = [{"epoch": e, "loss": 2.0 / (e + 1), "samples_per_s": 12000.0 + 1000 * e, "syncs": 5 + e,
           "rank0/batch_share": 0.6, "rank1/batch_share": 0.4, "anchor": 10.0} for e in range(3)]
WINDOWS = [{"step": 20 * (i + 1), "loss": 1.5 - 0.1 * i, "samples_per_s": 9000.0, "anchor": 10 + i,
            "rank0/share": 0.55, "rank1/share": 0.45} for i in range(4)]
EVALS = [{"epoch": 0, "eval/accuracy": 0.8123, "eval/loss": 0.9}, {"epoch": 2, "eval/accuracy": 0.9377, "eval/loss": 0.3}]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {t: dash.render_dashboard("job <42> & co", EPOCHS, WINDOWS, EVALS, theme=t) for t in dash.THEMES}


def _table(doc: str, heading: str) -> str:
    return doc.split(f"<h2>{heading}</h2>")[1].split("<h2>")[0]


def test_self_contained(pages):
    for doc in pages.values():
        low = doc.lower()
        assert 'src="http' not in low and "href=\"http" not in low and "<script" not in low and "<link" not in low
        assert "http://" not in low and "https://" not in low and "@import" not in low and "url(" not in low
        assert low.startswith("<!doctype html>") and low.rstrip().endswith("</html>")


def test_epoch_feed_rows_with_evals_merged(pages):
    feed = _table(pages["auto"], "Epoch feed")
    assert feed.count("<tr>") == 1 + len(EPOCHS)  # header + one row per epoch (evals joined, not extra rows)
    head = re.findall(r"<th>(.*?)</th>", feed)
    assert head[0] == "epoch" and "rank1/batch_share" in head and "eval/accuracy" in head
    assert "<td>0.9377</td>" in feed and "<td>13,000</td>" in feed and "<td>0.6667</td>" in feed


def test_window_records_rows(pages):
    win = _table(pages["auto"], "Window records")
    assert win.count("<tr>") == 1 + len(WINDOWS)
    assert re.findall(r"<th>(.*?)</th>", win)[0] == "step"
    assert all(f"<td>{20 * (i + 1)}</td>" in win for i in range(4)) and "<td>9,000</td>" in win


def test_charts_are_wellformed_inline_svg(pages):
    svgs = re.findall(r"<svg.*?</svg>", pages["auto"], re.S)
    titles = [ET.fromstring(s).get("aria-label") for s in svgs]
    assert titles == ["Loss per epoch", "Eval", "Throughput", "Batch share per rank", "Window loss", "Anchor",
                      "Window share per rank"]
    assert all("<polyline" in s for s in svgs)


def test_themes_differ(pages):
    assert len(set(pages.values())) == 3
    assert "prefers-color-scheme: dark" in pages["auto"]
    assert "prefers-color-scheme" not in pages["light"] and "prefers-color-scheme" not in pages["dark"]
    assert "--bg:#0d1117" in pages["dark"] and "--bg:#0d1117" not in pages["light"]
    with pytest.raises(ValueError):
        dash.render_dashboard("t", EPOCHS, [], [], theme="neon")


def test_escaping_and_missing_values():
    doc = dash.render_dashboard("<script>x</script>", [{"epoch": 0, "loss": math.nan, "note": "<b>&"}, {"epoch": 1, "loss": None}],
                                [], [], theme="light")
    assert "<script>" not in doc and "&lt;script&gt;" in doc and "&lt;b&gt;&amp;" in doc
    assert "<td>—</td>" in doc and "no records" in _table(doc, "Window records") and ">no data<" in doc


def test_empty_inputs_render():
    doc = dash.render_dashboard("empty", [], [], [])
    assert "0 epoch(s)" in doc and doc.count("no records") == 2


def test_many_ranks_legend_wraps_inside_the_chart():
    epochs = [{"epoch": e, "loss": 1.0, **{f"rank{r}/batch_share": 1 / 16 for r in range(16)}} for e in range(2)]
    svg = dash.svg_chart("s", [(f"rank{r}", [(0, 0.1), (1, 0.2)]) for r in range(16)], "x", "y")
    xs = [float(x) for x in re.findall(r'<rect x="([\d.]+)"', svg)]
    assert len(xs) == 16 and max(xs) < dash.W and len(set(re.findall(r'<rect x="[\d.]+" y="([\d.]+)"', svg))) > 1
    assert "rank15/batch_share" in dash.render_dashboard("m", epochs, [], [])


def test_write_dashboard_atomic(tmp_path):
    path = tmp_path / "sub" / "dashboard.html"
    out = dash.write_dashboard(str(path), "t", EPOCHS, WINDOWS, EVALS, theme="dark")
    assert out == str(path) and path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    dash.write_dashboard(str(path), "second", EPOCHS[:1], [], [], theme="light")  # overwrite in place
    assert "<title>second</title>" in path.read_text(encoding="utf-8")
    assert os.listdir(path.parent) == ["dashboard.html"]  # no temp file left behind


def test_load_events_and_cli(tmp_path, capsys):
    lines = [{"event": "started", "world_size": 2, "t": 0.1}] + [{"event": "epoch", **e, "t": 1.0} for e in EPOCHS] + \
        [{"event": "window", **w, "t": 1.0} for w in WINDOWS] + [{"event": "eval", **e, "t": 2.0} for e in EVALS]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"event": "epo')  # torn tail
    epochs, windows, evals = dash.load_events(str(tmp_path / "events.jsonl"))
    assert epochs == EPOCHS and windows == WINDOWS and evals == EVALS
    assert dash.main([str(tmp_path), "--theme", "light"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "dashboard.html")
    assert "<td>0.8123</td>" in (tmp_path / "dashboard.html").read_text(encoding="utf-8")
    assert dash.main([str(tmp_path / "nowhere")]) == 2
