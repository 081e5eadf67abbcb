"""What a new user meets first (issue 49's smaller items): ``make test SLURM=0``, the run's MLflow experiment named
after the experiment, no empty log file or run folder per run, ``simulate --help``, integer rank ticks."""
from __future__ import annotations

import logging.config
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


# -- make test SLURM=0 -------------------------------------------------------------------------------------------
def _make_n(*args: str) -> list[str]:
    r = subprocess.run(["make", "-n", "test", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return [ln for ln in r.stdout.splitlines() if "pytest" in ln]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test_slurm_0_deselects_the_slurm_tests_and_the_default_runs_them():
    default, no_slurm = _make_n(), _make_n("SLURM=0")
    assert len(default) == len(no_slurm) == 2
    assert default[0] == no_slurm[0]  # the unit tests: slurm never was in them
    assert "slurm" not in default[1].replace("not slurm and", "")  # FAST names slurm; nothing else does
    assert no_slurm[1] == default[1].replace(')"', ') and not slurm"'), no_slurm[1]
    assert _make_n("SLURM=1") == default


def test_ci_runs_make_test_with_slurm():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test " in ci and "SLURM=0" not in ci


def test_readme_says_what_make_test_does():
    readme = (ROOT / "README.md").read_text()
    for needle in ("make test SLURM=0", "16-22 minutes", "apt-get install", "slurm-wlm", "munge", "mariadb-server",
                   "single-node SLURM"):
        assert needle in readme, needle
    # install, first run and own project come before the measurements
    first = [readme.index(h) for h in ("## Install", "## A first run", "## Your own project", "## Everyday commands",
                                      "## What it does", "## The bench suite")]
    assert first == sorted(first)
    for placeholder in ("<repository URL>", "example.com", "git URL>"):
        assert placeholder not in readme
        for page in (ROOT / "docs").rglob("*.md"):
            assert placeholder not in page.read_text(), (placeholder, page)


# -- the composed config ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def make():
    from hydra import compose, initialize_config_dir

    from flodl_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda *o, hydra=False: compose("config", overrides=list(o), return_hydra_config=hydra)


def test_tracking_experiment_name_defaults_to_the_experiments_name(make):
    from flodl_exp.config import load_config
    from flodl_exp.config_rules import validate

    assert make().tracking.experiment_name == "digits_mlp"
    cfg = make("experiment=char_rnn")
    assert cfg.tracking.experiment_name == "char_rnn" and validate(cfg) == []
    assert make("experiment.name=my_task").tracking.experiment_name == "my_task"
    assert make("experiment=char_rnn", "tracking.experiment_name=mine").tracking.experiment_name == "mine"
    resolved = OmegaConf.to_container(make("experiment=conv_ae"), resolve=True)  # what the job spec carries
    assert isinstance(resolved, dict) and load_config(resolved).tracking.experiment_name == "conv_ae"


def _sweep_config(task: list[str], params: dict | None = None):
    cfg = OmegaConf.create({"hydra": {"overrides": {"task": task}, "sweeper": {"params": params or {}}},
                            "experiment": {"name": "digits_mlp"}, "tracking": {"experiment_name": "${experiment.name}"}})
    OmegaConf.set_readonly(cfg, True)
    OmegaConf.set_struct(cfg, True)
    return cfg


@pytest.mark.parametrize("task,params,pinned", [
    (["mode=nccl_sync,cpu_async"], None, None),                                     # one experiment: its own name
    (["experiment=digits_mlp,char_rnn"], None, "flodl_exp"),                        # parent and children together
    (["mode=cpu_async"], {"experiment": "choice(digits_mlp,char_rnn)"}, "flodl_exp"),  # an Optuna study over it
    (["experiment=digits_mlp,char_rnn", "tracking.experiment_name=mine"], None, None),  # set by the command
])
def test_a_sweep_over_experiment_keeps_parent_and_children_in_one_experiment(task, params, pinned):
    from flodl_exp.sweep import pin_sweep_experiment

    cfg = _sweep_config(task, params)
    added = pin_sweep_experiment(cfg)
    if pinned is None:
        assert added is None and list(cfg.hydra.overrides.task) == task
    else:
        assert added == f"tracking.experiment_name={pinned}" and list(cfg.hydra.overrides.task) == [*task, added]
        assert cfg.tracking.experiment_name == pinned


def test_a_run_writes_no_log_file_and_makes_no_run_folder(make, tmp_path, monkeypatch):
    """Hydra's job logging: the console only (no FileHandler: its <run dir>/flodl_exp.log stayed empty); the run
    folder Hydra makes is the working directory, not an empty outputs/hydra/<date>/<time>/ per run."""
    hc = make(hydra=True).hydra
    assert hc.run.dir == "."
    assert str(hc.sweep.dir).startswith("outputs/multirun/") and hc.sweep.subdir == "."  # no empty folder per job
    logging_cfg = OmegaConf.to_container(hc.job_logging, resolve=False)
    assert isinstance(logging_cfg, dict)
    assert [h["class"] for h in logging_cfg["handlers"].values()] == ["logging.StreamHandler"]
    assert logging_cfg["root"]["handlers"] == ["console"]
    assert "asctime" in logging_cfg["formatters"]["simple"]["format"]  # Hydra's default console format kept
    monkeypatch.chdir(tmp_path)
    saved = logging.root.handlers[:]
    try:
        logging.config.dictConfig({str(k): v for k, v in logging_cfg.items()})  # what Hydra does with it
    finally:
        logging.root.handlers[:] = saved
    assert list(tmp_path.iterdir()) == []


# -- simulate --help -------------------------------------------------------------------------------------------
def test_simulate_help_describes_the_tool_and_lists_every_rig_preset(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "flodl_exp.simulate", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "powered by Hydra" not in out
    assert out.startswith("python -m flodl_exp.simulate: the what-if simulator.")
    assert "--from-run RUN_ID" in out and "--config-name" in out
    presets = sorted(p.stem for p in (CONF / "simulate").glob("rig_*.yaml"))
    assert presets and all(f"\n  {p} " in out for p in presets), presets
    assert "rig: 3to1" in out  # the config's keys follow
    assert list(tmp_path.iterdir()) == []


# -- integer rank ticks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 40])
def test_the_what_if_plot_has_integer_rank_ticks(world):
    from flodl_exp.simulate.report import figure
    from flodl_exp.simulate.topology import SimulateConfig

    rows = [{"name": m, "curve": [(1.0, 100.0), (2.0, 200.0)], "shares": [1 / world] * world}
            for m in ("nccl_sync", "nccl_cadence", "cpu_async")]
    fig = figure(SimulateConfig(), rows)
    rank_ax = next(ax for ax in fig.axes if ax.get_xlabel() == "rank")
    fig.canvas.draw()
    ticks = [float(t) for t in rank_ax.get_xticks()]
    assert ticks and all(t.is_integer() for t in ticks), ticks
    if world <= 16:  # a tick per rank, under the middle of its group of bars (one bar per mode)
        assert ticks == [float(q) for q in range(world)]
        bars = rank_ax.patches
        assert len(bars) == world * len(rows)
        for q in range(world):
            group = [bars[i * world + q] for i in range(len(rows))]
            assert sum(b.get_x() + b.get_width() / 2 for b in group) / len(group) == pytest.approx(q)
