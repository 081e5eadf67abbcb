"""UI check: a real sweep, seen through a real ``mlflow server`` — its REST API and its web UI in headless Chromium.

The module fixture runs a 2-mode sweep (``-m mode=cpu_sync,cpu_cadence``, 2 epochs) through the CLI into a
fresh SQLite store, then serves that store with ``mlflow server --workers 1``. The browser test drives
Debian's Chromium over the DevTools protocol on a pipe (tests/ui/cdp.py, stdlib only): the experiment's
runs table lists the parent run, expanding it shows the 2 children, and the compare view of the 2 children
shows ``loss`` for both. Screenshots go to ``outputs/test-artifacts/ui/`` and to pytest's tmp dir.

Chromium is installed by tests/ui/install_chromium.sh when missing (apt, as root); the browser test skips,
with the reason printed, only where that cannot be done.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from ui.cdp import CHROMIUM, Browser, CDPError, group_alive, kill_group
from ui.mlflow_server import MlflowServer, tags_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXPERIMENT = "ui_check"
MODES = ("cpu_sync", "cpu_cadence")
EPOCHS = 2
ARTIFACTS = ROOT / "outputs" / "test-artifacts" / "ui"
INSTALL = Path(__file__).parent / "ui" / "install_chromium.sh"
INSTALL_TIMEOUT_S = 240


def announce(config: pytest.Config, msg: str) -> None:
    """Print ``msg`` and also show it on the terminal past pytest's output capture."""
    print(msg, flush=True)
    capman = config.pluginmanager.getplugin("capturemanager")
    tr = config.pluginmanager.getplugin("terminalreporter")
    if capman is not None and tr is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line(f"[ui-check] {msg}")


@pytest.fixture(scope="module")
def ui_store(tmp_path_factory, request) -> Iterator[dict]:
    """A fresh store holding one sweep (parent + one child per mode), served by a real mlflow server."""
    d = tmp_path_factory.mktemp("ui_store")
    uri = f"sqlite:///{d}/mlflow.db"
    t0 = time.monotonic()
    r = run_cli(["-m", f"mode={','.join(MODES)}", "experiment=digits_mlp", f"experiment.epochs={EPOCHS}",
                 "run.progress=off", "run.timeout_min=10", "tracking.predict=false", f"tracking.uri={uri}",
                 f"tracking.experiment_name={EXPERIMENT}", f"tracking.artifact_location={d}/artifacts",
                 f"run.job_root={d}/jobs", f"hydra.sweep.dir={d}/sweep"], timeout=240)
    sweep_s = time.monotonic() - t0
    assert r.returncode == 0, f"sweep exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    parents = [ln.split()[-1] for ln in r.stdout.splitlines() if ln.startswith("MLflow sweep parent run ")]
    assert len(parents) == 1, f"no sweep parent run id in the output:\n{r.stdout[-3000:]}"

    server = MlflowServer(uri, d / "server", health_timeout=90)
    try:
        exp = server.get("/api/2.0/mlflow/experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
        announce(request.config, f"sweep {sweep_s:.0f} s; mlflow server healthy in {server.startup_s:.1f} s at "
                                 f"{server.url} (log {server.log_path})")
        yield {"dir": d, "uri": uri, "server": server, "url": server.url, "experiment_id": exp["experiment_id"],
               "parent_id": parents[0]}
    finally:
        server.stop()
    assert not server.alive(), "mlflow server (or a worker of its process group) outlived teardown"


def sweep_runs(ui_store: dict) -> tuple[dict, list[dict]]:
    """(parent run, children sorted by name) as the REST API lists them."""
    runs = ui_store["server"].search_runs(ui_store["experiment_id"])
    parent = next(r for r in runs if r["info"]["run_id"] == ui_store["parent_id"])
    children = sorted((r for r in runs if tags_of(r).get("mlflow.parentRunId") == ui_store["parent_id"]),
                      key=lambda r: r["info"]["run_name"])
    return parent, children


def test_rest_api_lists_sweep_parent_and_children(ui_store):
    srv = ui_store["server"]
    runs = srv.search_runs(ui_store["experiment_id"])
    assert len(runs) == 1 + len(MODES), [r["info"]["run_name"] for r in runs]
    parent, children = sweep_runs(ui_store)
    assert tags_of(parent).get("flodl.sweep") == "parent"
    assert "mlflow.parentRunId" not in tags_of(parent)
    assert parent["info"]["status"] == "FINISHED"
    assert len(children) == len(MODES)
    assert sorted(tags_of(c)["mode"] for c in children) == sorted(MODES)
    for c in children:
        assert c["info"]["status"] == "FINISHED", c["info"]
        hist = srv.metric_history(c["info"]["run_id"], "loss")
        assert sorted(m["step"] for m in hist) == list(range(EPOCHS)), hist
        metrics = {m["key"] for m in c["data"].get("metrics", [])}
        assert {"loss", "eval/accuracy"} <= metrics


def test_the_sweep_writes_a_report_and_names_its_children(ui_store):
    """The sweep's report (markdown and plot, on disk and as the parent's artifacts) and the children's run names
    (the sweep these UI checks serve: one sweep run for both)."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(ui_store["uri"])
    pid = ui_store["parent_id"]
    children = c.search_runs([ui_store["experiment_id"]], f"tags.mlflow.parentRunId = '{pid}'")
    assert sorted(x.info.run_name for x in children) == sorted(f"digits_mlp/{m}/trend" for m in MODES)
    report = Path(ui_store["dir"]) / "sweep" / "report"
    assert "cpu_cadence" in (report / "report.md").read_text() and (report / "loss_vs_time.png").exists()
    assert {a.path for a in c.list_artifacts(pid, "report")} >= {"report/report.md", "report/loss_vs_time.png"}


@pytest.fixture(scope="module")
def chromium(request) -> str:
    """/usr/bin/chromium, installed by tests/ui/install_chromium.sh if missing; skip (printed) where it can't be."""
    def works() -> bool:
        try:
            return subprocess.run([CHROMIUM, "--version"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    if works():
        return CHROMIUM
    announce(request.config, f"chromium missing: running {INSTALL} (apt, up to {INSTALL_TIMEOUT_S} s)")
    t0 = time.monotonic()
    # Own session: on timeout the whole group (bash, apt-get, dpkg) is ended, not just bash.
    proc = subprocess.Popen(["bash", str(INSTALL)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=INSTALL_TIMEOUT_S)
        why = f"exit {proc.returncode}: {out.strip()[-1500:]}"
        ok = proc.returncode == 0 and works()
    except subprocess.TimeoutExpired:
        kill_group(proc)
        why, ok = f"timed out after {INSTALL_TIMEOUT_S} s", False
    if not ok:
        reason = f"Chromium cannot be installed on this machine ({why}); browser UI check skipped"
        announce(request.config, reason)
        pytest.skip(reason)
    announce(request.config, f"chromium installed in {time.monotonic() - t0:.0f} s")
    return CHROMIUM


def _links_js(run_ids: list[str]) -> str:
    """JS: the run ids among ``run_ids`` that the runs table shows as row links."""
    return ("(() => { const hrefs = [...document.querySelectorAll('[role=row] a[href*=\"/runs/\"]')]"
            ".map(a => a.getAttribute('href')); return " + json.dumps(run_ids)
            + ".filter(id => hrefs.some(h => h.endsWith('/runs/' + id))); })()")


LOSS_CELLS_JS = """(() => {
  // The compare view's Metrics table is two react-virtualized grids side by side: the keys ('Plot chart'
  // links) and the values, one column per run, in cells placed at the same style.top as their key.
  const key = [...document.querySelectorAll('a[title="Plot chart"]')].find(a => a.textContent.trim() === 'loss');
  const keyCell = key && key.parentElement, keyGrid = key && key.closest('.ReactVirtualized__Grid');
  if (!keyCell || !keyGrid) return null;
  let box = keyGrid.parentElement, valueGrid = null;
  for (; box && !valueGrid; box = box.parentElement)
    valueGrid = [...box.querySelectorAll('.ReactVirtualized__Grid')].find(g => g !== keyGrid) || null;
  if (!valueGrid) return null;
  // No scrolling: in MLflow 3.17 the key grid does not follow when the value grid scrolls, so a scrolled
  // table shows keys and values out of line. The grid renders ~17 rows, and loss is about the 9th.
  const cells = [...valueGrid.querySelectorAll('[style]')].filter(d => d.style.position === 'absolute' && d.style.top === keyCell.style.top);
  cells.sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left));
  return cells.length ? cells.map(c => c.textContent.trim()) : null;
})()"""

RUN_ID_ROW_JS = """(() => {
  // 'Run ID:' row of the compare view: the run ids in column order.
  const label = [...document.querySelectorAll('th, td, div')].find(e => e.children.length === 0 && e.textContent.trim() === 'Run ID:');
  const row = label && label.closest('tr');
  return row ? [...row.querySelectorAll('a')].map(a => a.textContent.trim()) : null;
})()"""


def close_assistant(page) -> None:
    """Close MLflow's assistant side panel, when it is open: it only hides part of the page."""
    try:
        page.click('document.querySelector(\'[data-component-id="mlflow.assistant.chat_panel.close"]\')', timeout=3)
        page.wait_for('!document.querySelector(\'[data-component-id="mlflow.assistant.chat_panel.close"]\')',
                      timeout=5)
    except CDPError:
        pass


def test_ui_lists_sweep_and_compares_children(chromium, ui_store, tmp_path, request):
    # (chromium before ui_store: where the browser test skips, it skips before any sweep)
    srv = ui_store["server"]
    parent, children = sweep_runs(ui_store)
    assert len(children) == len(MODES)
    pid, exp_id = parent["info"]["run_id"], ui_store["experiment_id"]
    kids = [c["info"]["run_id"] for c in children]
    names = {c["info"]["run_id"]: c["info"]["run_name"] for c in children}
    last_loss = {c["info"]["run_id"]: srv.metric_history(c["info"]["run_id"], "loss")[-1]["value"] for c in children}

    shots: list[Path] = []
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # only this test writes there: no stale failure.png

    def shot(page, name: str) -> None:
        p = page.screenshot(tmp_path / name)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, ARTIFACTS / name)
        shots.append(ARTIFACTS / name)

    t0 = time.monotonic()
    browser = Browser(tmp_path / "chromium-profile", tmp_path / "chromium.log", window=(1920, 1080),
                      executable=chromium)
    try:
        page = browser.page()
        try:
            # 1. The experiment's runs table: the parent, collapsed; then expanded, its 2 children.
            page.goto(f"{srv.url}/#/experiments/{exp_id}/runs")
            page.wait_for(f"{_links_js([pid])}.length === 1", timeout=90, what="the parent run in the runs table")
            page.wait_for_text([parent["info"]["run_name"][:40], f"{1 + len(MODES)} matching runs"], timeout=30)
            close_assistant(page)
            assert page.eval(_links_js(kids)) == [], "children listed before the parent was expanded"
            shot(page, "01-runs-parent.png")
            page.click(f"document.querySelector('a[href$=\"/runs/{pid}\"]').closest('[role=row]')"
                       ".querySelector('button[data-component-id*=\"runnamecellrenderer\"]')",
                       what="the parent row's expand button")
            page.wait_for(f"{_links_js(kids)}.length === {len(kids)}", timeout=30, what="both children, expanded")
            page.wait_for_text(list(names.values()), timeout=30)
            rows = page.eval("document.querySelectorAll('[role=row] a[href*=\"/runs/\"]').length")
            assert rows == 1 + len(kids), f"{rows} run rows in the table"
            time.sleep(0.5)  # let the expand animation settle for the screenshot
            shot(page, "02-runs-expanded.png")

            # 2. The compare view of the two children: loss for both, equal to the logged final values.
            q = urllib.parse.quote(json.dumps(kids)), urllib.parse.quote(json.dumps([exp_id]))
            page.goto(f"{srv.url}/#/compare-runs?runs={q[0]}&experiments={q[1]}")
            page.wait_for_text([f"Comparing {len(kids)} Runs", "loss", "eval/accuracy", *names.values()], timeout=60)
            close_assistant(page)
            column_ids = page.wait_for(RUN_ID_ROW_JS, timeout=30, what="the Run ID row")
            assert sorted(column_ids) == sorted(kids), column_ids
            values = page.wait_for(
                f"(() => {{ const v = {LOSS_CELLS_JS}; return v && v.length >= {len(kids)} ? v : null; }})()",
                timeout=30, what="loss values for both runs in the Metrics table")
            assert len(values) == len(kids), values
            for run_id, shown in zip(column_ids, values):  # the table shows 3 significant digits
                assert abs(float(shown) - last_loss[run_id]) <= 5e-3 * max(1.0, abs(last_loss[run_id])), \
                    (names[run_id], shown, last_loss[run_id])
            shot(page, "03-compare.png")

            # 3. From the compare view, loss's chart link: one curve per child and each one's latest value.
            page.eval('[...document.querySelectorAll(\'a[title="Plot chart"]\')]'
                      '.find(a => a.textContent.trim() === "loss").click()')
            text = page.wait_for_text(["Completed Runs", f"{len(kids)}/{len(kids)}",
                                       *(f"{n} (loss)" for n in names.values())], timeout=60)
            for run_id, name in names.items():
                row = next((ln for ln in text.splitlines() if ln.startswith(name + "\t")), None)
                assert row, f"no row for {name} in the loss table:\n{text[-1500:]}"
                latest = row.split("\t")[1]
                assert latest.endswith(f"(step={EPOCHS - 1})"), row
                assert float(latest.split()[0]) == pytest.approx(last_loss[run_id], rel=1e-9), row
            page.wait_for(f"document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= {len(kids)}",
                          timeout=30, what="the loss chart's curves")
            close_assistant(page)
            shot(page, "04-loss-chart.png")
        except Exception:
            try:  # keep what the page showed when it failed
                shot(page, "failure.png")
                (tmp_path / "failure.txt").write_text(page.text())
            except Exception:
                pass
            raise
    finally:
        browser.close()
        announce(request.config, f"browser check {time.monotonic() - t0:.1f} s; screenshots: "
                                 + ", ".join(str(s) for s in shots) + f" (and {tmp_path})")
    assert not group_alive(browser.proc.pid), "a chromium process outlived the browser's close()"
