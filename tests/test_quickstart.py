"""The quickstart's commands, run literally (make test-package).

docs/quickstart.md marks each ```bash block with an HTML comment on the line before it: ``<!-- quickstart: run -->``
(run here, line by line, in a fresh folder as the working directory, with this venv's bin/ first on PATH, as a
user who followed the install step would) or ``<!-- quickstart: skip -->`` (installs, a UI server, a cluster).
A block without a marker fails the test, so a command added to the page is either run or knowingly skipped.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
MARKER = re.compile(r"^<!--\s*quickstart:\s*(run|skip)\s*-->$")
FENCE = re.compile(r"^```(\S*)")
DEADLINE_S = 240  # one command; the page's runs take ~15-40 s each on a quiet 2-core machine


def shell_blocks(markdown: str) -> list[tuple[str | None, str, int]]:
    """(marker or None, body, line number) of every ```bash / ```sh / ```shell block."""
    lines = markdown.splitlines()
    out: list[tuple[str | None, str, int]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in ("bash", "sh", "shell", "console"):
            prev = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
            mark = MARKER.match(prev)
            out.append((mark.group(1) if mark else None, "\n".join(body), start + 1))
    return out


def commands(body: str) -> list[str]:
    """One string per command: continuation lines joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", body)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def is_app(cmd: str) -> bool:
    """The app itself (not flodl_exp.bench, .simulate, .report)."""
    return cmd.startswith(("python -m flodl_exp ", "flodl-exp "))


def is_sweep(cmd: str) -> bool:
    """A Hydra multirun of the app: ``-m`` / ``--multirun`` among the app's own arguments."""
    args = shlex.split(cmd)
    args = args[3:] if args[:3] == ["python", "-m", "flodl_exp"] else args[1:]
    return is_app(cmd) and bool({"-m", "--multirun"} & set(args))


def _run_blocks() -> list[str]:
    return [cmd for mark, body, _ in shell_blocks(QUICKSTART.read_text(encoding="utf-8")) if mark == "run"
            for cmd in commands(body)]


@pytest.mark.package
@pytest.mark.e2e
def test_every_shell_block_of_the_quickstart_is_marked() -> None:
    blocks = shell_blocks(QUICKSTART.read_text(encoding="utf-8"))
    unmarked = [line for mark, _, line in blocks if mark is None]
    assert not unmarked, f"docs/quickstart.md: ```bash blocks at lines {unmarked} need <!-- quickstart: run|skip -->"
    runs = _run_blocks()
    assert any(is_app(c) and not is_sweep(c) for c in runs), runs  # a first run
    assert any(is_sweep(c) for c in runs), runs  # a sweep


@pytest.mark.package
@pytest.mark.e2e
def test_the_parser_reads_markers_and_continuations() -> None:
    md = ("<!-- quickstart: run -->\n```bash\nls \\\n  -l   # long\n# a comment\n\necho hi\n```\n\n"
          "```bash\nmake run\n```\n<!-- quickstart: skip -->\n\n```text\nnot shell\n```\n")
    blocks = shell_blocks(md)
    assert [(m, line) for m, _, line in blocks] == [("run", 2), (None, 10)]
    assert commands(blocks[0][1]) == ["ls -l   # long", "echo hi"]
    assert is_sweep("python -m flodl_exp -m mode=a,b") and is_sweep("flodl-exp --multirun x=1,2")
    assert not is_sweep("python -m flodl_exp mode=a") and is_app("python -m flodl_exp mode=a")
    assert not is_app("python -m flodl_exp.bench --quick")


@pytest.mark.package
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    runs = _run_blocks()
    bin_dir = Path(sys.executable).parent  # the repository's .venv/bin (make venv), first on PATH
    # a user's shell: none of this session's flodl/MLflow settings, no PYTHONPATH into the checkout
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLODL_", "MLFLOW_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    for cmd in runs:
        try:
            proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=DEADLINE_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"`{cmd}` ran past {DEADLINE_S} s:\n{(e.stdout or b'')[-3000:]!r}")
        assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    db = tmp_path / "outputs" / "mlflow.db"
    assert db.is_file(), f"no MLflow store at {db}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("digits_mlp")  # tracking.experiment_name: the experiment's name
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id])
    assert found, "the quickstart's commands logged no run"
    unfinished = [(r.info.run_name, r.info.status) for r in found if r.info.status != "FINISHED"]
    assert not unfinished, unfinished
    # what the page's commands promise: one MLflow run per single run; per sweep a parent with a child per value
    singles = [c for c in runs if is_app(c) and not is_sweep(c) and "--version" not in c.split()]
    sweeps = [c for c in runs if is_sweep(c)]
    children: dict[str, set[str | None]] = {}
    for r in found:
        parent = r.data.tags.get("mlflow.parentRunId")
        if parent is not None:
            children.setdefault(parent, set()).add(r.data.tags.get("mode"))
    alone = [r for r in found if "mlflow.parentRunId" not in r.data.tags and r.info.run_id not in children]
    assert len(alone) == len(singles), [r.info.run_name for r in alone]
    assert len(children) == len(sweeps), children
    for sweep in sweeps:
        swept = re.search(r"\bmode=([\w,]+)", sweep)
        if swept:
            assert set(swept.group(1).split(",")) in children.values(), (sweep, children)
