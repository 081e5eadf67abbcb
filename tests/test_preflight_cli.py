"""The pre-flight as a user meets it: the CLI in its own process, from a small project of the user's own outside the
checkout. A wrong ``_target_`` and a launch from the wrong folder each end with one ``config error:`` line and exit
2, before any job folder, MLflow store or process exists (before the pre-flight: a job, a FAILED run and, from
the wrong folder, a second store, then the error from a rank seconds later)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

EXPERIMENT = textwrap.dedent("""\
    # @package experiment
    name: {name}
    model: {{_target_: my_model.{cls}, hidden: 16}}
    optimizer: {{_target_: torch.optim.Adam, _partial_: true, lr: 0.003}}
    scheduler: null
    train_data: {{_target_: flodl_exp.zoo.digits.DigitsDataset, split: train}}
    eval_data: {{_target_: flodl_exp.zoo.digits.DigitsDataset, split: test}}
    train_step: flodl_exp.zoo.digits.train_step
    eval_fn: flodl_exp.zoo.digits.evaluate
    batch_size: 32
    epochs: 1
    """)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The user's project: my_model.py and two presets under its conf/ (one names a class that does not exist)."""
    proj = tmp_path / "my_project"
    (proj / "conf" / "experiment").mkdir(parents=True)
    (proj / "my_model.py").write_text("import torch\n\n\nclass TinyNet(torch.nn.Module):\n    pass\n")
    (proj / "conf" / "experiment" / "my_task.yaml").write_text(EXPERIMENT.format(name="my_task", cls="TinyNet"))
    (proj / "conf" / "experiment" / "typo.yaml").write_text(EXPERIMENT.format(name="typo", cls="Nett"))
    return proj


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("MLFLOW_", "FLODL_"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "flodl_exp", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _assert_one_line_and_nothing_made(out: subprocess.CompletedProcess[str], line: str, folder: Path) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert out.stdout.strip() == ""
    assert not (folder / "outputs").exists(), sorted(str(p) for p in (folder / "outputs").rglob("*"))  # no job, store


def test_a_wrong_target_is_one_line_before_anything_exists(project: Path) -> None:
    out = _cli(project, "--config-dir", "./conf", "experiment=typo")
    _assert_one_line_and_nothing_made(out, "config error: experiment.model._target_='my_model.Nett' cannot be resolved: "
                                           "module 'my_model' has no attribute 'Nett'", project)


def test_a_launch_from_another_folder_names_where_the_module_is(project: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _cli(elsewhere, "--config-dir", str(project / "conf"), "experiment=my_task")
    _assert_one_line_and_nothing_made(
        out, f"config error: experiment.model._target_='my_model.TinyNet': my_model is not importable from {elsewhere}: "
             f"it is in {project}: launch from there, or set PYTHONPATH={project}", elsewhere)
