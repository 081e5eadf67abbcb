"""The pre-flight as a user meets it: the CLI in its own process, from a small project of the user's own outside the
checkout. A wrong ``_target_`` and a launch from the wrong folder each end with one ``config error:`` line and exit
2, before any job folder, MLflow store or process exists (before the pre-flight: a job, a FAILED run and, from
the wrong folder, a second store, then the error from a rank seconds later)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from user_project import TINY_NET, assert_refused_before_anything, preset, run_cli, write_project

pytestmark = pytest.mark.e2e


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The user's project: my_model.py and two presets under its conf/ (one names a class that does not exist)."""
    return write_project(tmp_path / "my_project", TINY_NET, {"my_task": preset("my_task"), "typo": preset("typo", "Nett")})


def _refused(out: subprocess.CompletedProcess[str], line: str, folder: Path) -> None:
    assert_refused_before_anything(out, line, folder)
    assert not (folder / "outputs").exists(), sorted(str(p) for p in (folder / "outputs").rglob("*"))


def test_a_wrong_target_is_one_line_before_anything_exists(project: Path) -> None:
    out = run_cli(project, "--config-dir", "./conf", "experiment=typo")
    _refused(out, "config error: experiment.model._target_='my_model.Nett' cannot be resolved: "
                  "module 'my_model' has no attribute 'Nett'", project)


def test_a_launch_from_another_folder_names_where_the_module_is(project: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_cli(elsewhere, "--config-dir", str(project / "conf"), "experiment=my_task")
    _refused(
        out, f"config error: experiment.model._target_='my_model.TinyNet': my_model is not importable from {elsewhere}: "
             f"it is in {project}: launch from there, or set PYTHONPATH={project}", elsewhere)
