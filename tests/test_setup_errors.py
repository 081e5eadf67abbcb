"""A rank that cannot set up: the one-line error (key, target, root cause), the death record the coordinator and the
launcher read it from, and the job's one-line RankSetupFailed (no processes; the wheel test runs it end to end)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from flodl_exp.experiment import ExperimentSetupError, build_experiment, root_cause
from flodl_exp.job_spec import JobSpec
from flodl_exp.jobs.job import RankSetupFailed, _setup_failed, setup_error_path
from flodl_exp.rendezvous import death_record_path, setup_failure, write_death_record

CPU = torch.device("cpu")
LINEAR = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1}
SGD = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}


def test_a_missing_model_names_the_key_the_target_and_the_root_cause() -> None:
    with pytest.raises(ExperimentSetupError) as e:
        build_experiment({"model": {"_target_": "no_such_module_xyz.Net"}}, world_size=1, device=CPU, seed=1)
    assert str(e.value) == ("experiment.model: cannot build 'no_such_module_xyz.Net': "
                            "ModuleNotFoundError: No module named 'no_such_module_xyz'")
    assert e.value.key == "experiment.model" and "\n" not in str(e.value)


def test_a_data_set_factory_error_names_train_data() -> None:
    exp = {"model": LINEAR, "optimizer": SGD,
           "train_data": {"_target_": "flodl_exp.zoo.data_cifar.Cifar10Dataset", "split": "train", "data_dir": "/nonexistent"}}
    with pytest.raises(ExperimentSetupError, match=r"^experiment\.train_data: cannot build "
                                                   r"'flodl_exp\.zoo\.data_cifar\.Cifar10Dataset': FileNotFoundError"):
        build_experiment(exp, world_size=1, device=CPU, seed=1)


def test_a_bad_train_step_path_names_train_step() -> None:
    exp = {"model": LINEAR, "optimizer": SGD, "train_data": {"_target_": "flodl_exp.zoo.digits.DigitsDataset", "split": "train"},
           "train_step": "flodl_exp.zoo.digits.no_such_step", "batch_size": 8, "epochs": 1}
    with pytest.raises(ExperimentSetupError, match=r"^experiment\.train_step: cannot build 'flodl_exp\.zoo\.digits\.no_such_step'"):
        build_experiment(exp, world_size=1, device=CPU, seed=1)


def test_root_cause_follows_causes_but_honours_from_none() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as e:
        assert root_cause(e) == "KeyError: 'inner'"
    try:
        try:
            raise KeyError("hidden")
        except KeyError:
            raise ValueError("the helpful one") from None
    except ValueError as e:
        assert root_cause(e) == "ValueError: the helpful one"


def test_the_job_keeps_the_traceback_and_a_setup_death_record(tmp_path: Path) -> None:
    spec = cast(JobSpec, SimpleNamespace(import_paths=("/my/project",)))  # _setup_failed reads only this
    try:
        build_experiment({"model": {"_target_": "no_such_module_xyz.Net"}}, world_size=1, device=CPU, seed=1)
    except ExperimentSetupError as e:
        err = _setup_failed(spec, 1, str(tmp_path), 0, e)
    assert isinstance(err, RankSetupFailed)
    line = str(err)
    assert line.startswith("rank 1 could not set up: experiment.model: cannot build 'no_such_module_xyz.Net'")
    assert "/my/project" in line and setup_error_path(str(tmp_path), 1) in line and "\n" not in line
    assert "Traceback" in Path(setup_error_path(str(tmp_path), 1)).read_text()
    record = json.loads(Path(death_record_path(str(tmp_path), 1)).read_text())
    assert record["phase"] == "setup" and record["error"].startswith("experiment.model: cannot build")
    assert setup_failure(str(tmp_path), 1, 0) == record["error"]
    assert setup_failure(str(tmp_path), 1, 1) is None  # another incarnation's record is not this attempt's cause
    assert setup_failure(str(tmp_path), 0, 0) is None


def test_a_training_death_record_is_not_a_setup_failure(tmp_path: Path) -> None:
    write_death_record(str(tmp_path), 0, 2, "RuntimeError: boom", "tb", attempt=0)
    assert setup_failure(str(tmp_path), 0, 0) is None
