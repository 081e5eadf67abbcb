"""The package as a user outside this repository gets it: the wheel built from a copy of the checkout, installed into
a fresh venv outside it, and run from a temporary folder that holds a small project of the user's own (one model
module, one experiment YAML under its own ``conf/``), as the quickstart's "your own project" page says.

The fresh venv borrows the dev venv's installed dependencies through a ``.pth`` line (a venv of its own would
install ~2 GB, torch included, for ~3 min on this machine) and installs the wheel with ``--no-index``: pip must find
every dependency the wheel declares, and ``flodl_exp`` itself comes from the venv's site-packages, never from the
checkout (asserted). ``FLODL_WHEEL_FULL_INSTALL=1`` installs every dependency from the registry instead.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from user_project import TINY_NET, preset, write_project

pytestmark = [pytest.mark.package, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[1]
SKIP_COPY = {".git", ".venv", "outputs", "multirun", "mlruns", "site", "build", "dist", ".mypy_cache", ".ruff_cache",
             ".pytest_cache", "__pycache__", "flodl_exp.egg-info"}

MODEL = TINY_NET + '''


class OddNet(TinyNet):
    """Resolves (the launcher's pre-flight lets it through) but cannot be built: a rank's setup fails."""

    def __init__(self, hidden: int = 16) -> None:
        if hidden % 2:
            raise ValueError(f"hidden must be even, got {hidden}")
        super().__init__(hidden)
'''


def _copy_ignore(_dir: str, names: list[str]) -> set[str]:
    return {n for n in names if n in SKIP_COPY or n.endswith(".pyc")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the checkout with the wheel built from it installed; returns the venv's folder."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=_copy_ignore)
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, timeout=300, cwd=root)
    wheels = list(dist.glob("flodl_exp-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    if os.environ.get("FLODL_WHEEL_FULL_INSTALL") == "1":
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheels[0])], check=True, timeout=1200)
    else:
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        (Path(site) / "borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheels[0])], check=True,
                       timeout=300)
        missing = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
        flodl_lines = [ln for ln in missing.stdout.splitlines() if ln.lower().startswith("flodl")]
        assert not flodl_lines, flodl_lines  # every dependency the wheel declares is there
    return venv


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's own project: a model module and three experiment presets (two of them broken) under its conf/."""
    return write_project(tmp_path_factory.mktemp("my_project"), MODEL, {
        "my_task": preset("my_task"), "broken": preset("broken", "OddNet", hidden=15), "typo": preset("typo", "Nett")})


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith(("MLFLOW_", "FLODL_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(venv: Path, cwd: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "flodl-exp"), *args], cwd=cwd, env=_env(venv), capture_output=True,
                          text=True, timeout=timeout)


def _runs(proj: Path) -> list[tuple[str, str, str]]:
    """(run name, status, parent run id) of every run in the project's default MLflow store."""
    with sqlite3.connect(proj / "outputs" / "mlflow.db") as db:
        return db.execute("SELECT r.name, r.status, t.value FROM runs r LEFT JOIN tags t ON t.run_uuid = r.run_uuid "
                          "AND t.key = 'mlflow.parentRunId' ORDER BY r.start_time").fetchall()


def test_the_package_comes_from_the_venv_and_reports_its_version(installed: Path, project: Path) -> None:
    import flodl_exp

    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import flodl_exp; print(flodl_exp.__file__)"],
                           cwd=project, env=_env(installed), capture_output=True, text=True, timeout=60, check=True)
    assert str(installed) in where.stdout and str(REPO) not in where.stdout, where.stdout
    version = _run(installed, project, "--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith(f"flodl_exp {flodl_exp.__version__} "), version


def test_a_users_project_runs_and_sweeps_from_the_wheel(installed: Path, project: Path) -> None:
    one = _run(installed, project, "--config-dir", "./conf", "experiment=my_task", "run.progress=off")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "status      FINISHED" in one.stdout
    sweep = _run(installed, project, "-m", "--config-dir", "./conf", "experiment=my_task",
                 "mode=nccl_cadence,cpu_async", "run.progress=off")
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    runs = _runs(project)
    mine = [r for r in runs if r[0].startswith("my_task/")]
    assert len(mine) == 3 and all(status == "FINISHED" for _, status, _ in mine), runs
    parents = [r for r in runs if r[0].startswith("sweep ")]
    assert len(parents) == 1 and parents[0][1] == "FINISHED", runs
    assert sum(1 for r in mine if r[2]) == 2, runs  # the sweep's two jobs are its parent's children


def test_the_zoo_runs_from_the_wheel_in_any_folder(installed: Path, project: Path) -> None:
    # resnet20 on the synthetic CIFAR-shaped task, one epoch; fewer samples than the preset's 4000 to keep it short
    res = _run(installed, project, "experiment=resnet20", "experiment.epochs=1", "experiment.train_data.limit=512",
               "experiment.eval_data.limit=128", "run.progress=off")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "status      FINISHED" in res.stdout


def test_the_preflight_refuses_a_wrong_target_from_the_wheel(installed: Path, project: Path) -> None:
    """The pre-flight finds modules through the installed package as through the checkout: one line, exit 2, no job."""
    jobs = sorted((project / "outputs" / "jobs").glob("*")) if (project / "outputs" / "jobs").exists() else []
    res = _run(installed, project, "--config-dir", "./conf", "experiment=typo", timeout=120)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        "config error: experiment.model._target_='my_model.Nett' cannot be resolved: module 'my_model' has no attribute 'Nett'"]
    after = sorted((project / "outputs" / "jobs").glob("*")) if (project / "outputs" / "jobs").exists() else []
    assert after == jobs


def test_a_rank_that_cannot_set_up_says_why_in_one_line(installed: Path, project: Path) -> None:
    res = _run(installed, project, "--config-dir", "./conf", "experiment=broken", "run.progress=off")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert err[-2:-1] == ["run failed:"], res.stderr[-3000:]
    line = err[-1]
    assert ("could not set up: experiment.model: cannot build 'my_model.OddNet': ValueError: hidden must be even, "
            "got 15") in line, line
    assert line.startswith("rank ") and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "bundle      none written" in res.stdout
    status = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("status")]
    assert status and "could not set up" in status[0], res.stdout
    job = Path(res.stdout.split(" folder ", 1)[1].split()[0])
    kept = sorted(p.name for p in (job / "ranks").glob("setup_error.r*.txt"))
    assert kept, list((job / "ranks").iterdir())
    assert "Traceback" in (job / "ranks" / kept[0]).read_text()
    record = json.loads((job / "ranks" / kept[0].replace("setup_error", "death").replace(".txt", ".json")).read_text())
    assert record["phase"] == "setup"
