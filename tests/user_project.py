"""A user's own small project outside the checkout, and the CLI run from it as the user runs it: the pieces the
tests that meet flodl_exp as a user share (the pre-flight's, Hydra's and run-time errors, the installed wheel)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

TINY_NET = '''\
import torch
from torch import nn


class TinyNet(nn.Module):
    """The user's own model: 8x8 digits through one hidden layer."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
'''
"""``my_model.py``'s model; a test appends classes of its own."""

DIGITS = "flodl_exp.zoo.digits.DigitsDataset"

EXPERIMENT = '''\
# @package experiment
name: {name}
model: {{_target_: my_model.{model}, hidden: {hidden}}}
optimizer: {{_target_: torch.optim.Adam, _partial_: true, lr: 0.003}}
scheduler: null
train_data: {{_target_: {data}, split: train}}
eval_data: {{_target_: flodl_exp.zoo.digits.DigitsDataset, split: test}}
train_step: flodl_exp.zoo.digits.train_step
eval_fn: flodl_exp.zoo.digits.evaluate
batch_size: 32
epochs: 1
'''


def preset(name: str, model: str = "TinyNet", data: str = DIGITS, hidden: int = 16) -> str:
    """``conf/experiment/<name>.yaml`` naming ``my_model.<model>`` and the training data set ``data``."""
    return EXPERIMENT.format(name=name, model=model, data=data, hidden=hidden)


def write_project(root: Path, model_source: str, presets: Mapping[str, str]) -> Path:
    """``root`` holding ``my_model.py`` and ``conf/experiment/<name>.yaml`` for each preset."""
    (root / "conf" / "experiment").mkdir(parents=True, exist_ok=True)
    (root / "my_model.py").write_text(model_source)
    for name, text in presets.items():
        (root / "conf" / "experiment" / f"{name}.yaml").write_text(text)
    return root


def user_env(**extra: str) -> dict[str, str]:
    """This environment as a user's shell has it: no PYTHONPATH, no MLflow or flodl_exp settings of the suite's."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR") and not k.startswith(("MLFLOW_", "FLODL_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_cli(cwd: Path, *args: str, timeout: float = 120, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """``python -m flodl_exp ARGS`` from ``cwd``, its output captured."""
    return subprocess.run([sys.executable, "-m", "flodl_exp", *args], cwd=cwd, env=env or user_env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_refused_before_anything(out: subprocess.CompletedProcess[str], line: str, folder: Path) -> None:
    """Exit 2, ``line`` alone on stderr, nothing on stdout, no traceback, and no job folder or MLflow store made."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert out.stdout.strip() == ""
    for stream in (out.stdout, out.stderr):
        assert "Traceback" not in stream and 'File "' not in stream
    for made in ("jobs", "mlflow.db", "mlartifacts"):
        assert not (folder / "outputs" / made).exists(), made
