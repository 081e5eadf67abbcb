"""Hydra's composition errors as a user meets them: the CLI in its own process, from a folder of the user's own
outside the checkout. A misspelt option, group or key, a value of the wrong type and a forgotten ``--config-dir``
each end with one ``config error:`` line and exit 2 (before: Hydra's multi-line report, exit 1, the always-refused
``nccl_async`` among the options and "+key" advice for a misspelt key), before any job folder or MLflow store exists.
About 2 s a test (one CLI call each)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from user_project import assert_refused_before_anything, run_cli, user_env

import flodl_exp

pytestmark = pytest.mark.e2e

EXPERIMENTS = sorted(p.stem for p in (Path(flodl_exp.__file__).parent / "conf" / "experiment").glob("*.yaml"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The user's folder, outside the checkout."""
    home = tmp_path / "my_project"
    home.mkdir()
    return home


def test_a_misspelt_option(folder: Path) -> None:
    out = run_cli(folder, "mode=nccl_cadense")
    assert_refused_before_anything(out, "config error: mode=nccl_cadense: no such option (available: auto, cpu_async, cpu_cadence, "
                          "cpu_sync, nccl_cadence, nccl_sync); did you mean nccl_cadence?", folder)
    assert "nccl_async" not in out.stderr  # refused by the validation whatever its overrides: never offered


def test_a_misspelt_group(folder: Path) -> None:
    out = run_cli(folder, "experment=cancer")
    assert_refused_before_anything(out, "config error: experment=cancer: no such key or config group; did you mean experiment?", folder)
    assert "+experment" not in out.stderr  # Hydra's advice, which would only lead to a second error


def test_a_forgotten_config_dir(folder: Path) -> None:
    (folder / "conf" / "experiment").mkdir(parents=True)
    (folder / "conf" / "experiment" / "my_task.yaml").write_text("# @package experiment\nname: my_task\n")
    out = run_cli(folder, "experiment=my_task")
    assert_refused_before_anything(out, f"config error: experiment=my_task: no such option (available: {', '.join(EXPERIMENTS)}); "
                          "./conf/experiment/my_task.yaml exists: add --config-dir ./conf", folder)


def test_a_misspelt_nested_key(folder: Path) -> None:
    out = run_cli(folder, "mode.max_overshot=3")
    assert_refused_before_anything(out, "config error: mode.max_overshot=3: no such key in mode; did you mean mode.max_overshoot?", folder)


def test_a_value_of_the_wrong_type(folder: Path) -> None:
    out = run_cli(folder, "seed=abc")
    assert_refused_before_anything(out, "config error: seed='abc' is not allowed: an integer", folder)


def test_a_sweep_whose_overrides_do_not_compose_leaves_no_parent_run(folder: Path) -> None:
    """The sweep's MLflow parent run is made as its first job starts (sweep.py, on_job_start): a misspelt option in
    a sweep is the same one line, with no store, no empty parent run and no "sweep report not written" after it."""
    out = run_cli(folder, "-m", "mode=nccl_cadense,cpu_async")
    assert_refused_before_anything(out, "config error: mode=nccl_cadense: no such option (available: auto, cpu_async, cpu_cadence, "
                          "cpu_sync, nccl_cadence, nccl_sync); did you mean nccl_cadence?", folder)


def test_the_simulator_and_the_bench_answer_in_the_same_voice(folder: Path) -> None:
    for module, arg, line in (
            ("flodl_exp.simulate", "epochz=3", "config error: epochz=3: no such key or config group; did you mean epochs?"),
            ("flodl_exp.bench", "preset=fulll",
             "config error: preset=fulll: no such option (available: full, quick); did you mean full?")):
        out = subprocess.run([sys.executable, "-m", module, arg], cwd=folder, env=user_env(), capture_output=True,
                             text=True, timeout=60)
        assert_refused_before_anything(out, line, folder)
