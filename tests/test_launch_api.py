"""The public Python API: ``flodl_exp.launch`` stays the launch function after every submodule is imported, and
two runs launched one after the other from one process both finish."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from mlflow.tracking import MlflowClient

import flodl_exp

from conftest import base_overrides, compose

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _import_every_submodule() -> list[str]:
    """Import every module under flodl_exp; a module that cannot import is a failure (none needs CUDA to import)."""
    names, failures = [], []

    def onerror(name: str) -> None:  # a package whose __init__ failed while walking
        failures.append(f"{name}: could not walk")

    for info in pkgutil.walk_packages(flodl_exp.__path__, prefix="flodl_exp.", onerror=onerror):
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failures.append(f"{info.name}: {type(e).__name__}: {e}")
        else:
            names.append(info.name)
    assert not failures, "submodules that do not import:\n" + "\n".join(failures)
    return names


def test_launch_twice_in_one_process_after_importing_every_submodule(store):
    names = _import_every_submodule()
    assert {"flodl_exp.jobs.launcher", "flodl_exp.coordinator.coordinator", "flodl_exp.rank.worker"} <= set(names)
    # No submodule import may shadow the public function (e.g. a flodl_exp.launch module bound on the package).
    assert inspect.isfunction(flodl_exp.launch), type(flodl_exp.launch)
    cfg = compose([*base_overrides(store, "launch_api"), "experiment=digits_logistic", "cluster.ranks_per_node=1",
                   "experiment.epochs=1"])
    client = MlflowClient(store["uri"])
    run_ids = []
    for _ in range(2):
        h = flodl_exp.launch(cfg)
        state = h.join()
        assert isinstance(state, dict) and state
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        assert h.result["status"] == "FINISHED"
        assert client.get_run(h.run_id).info.status == "FINISHED"
        run_ids.append(h.run_id)
    assert len(set(run_ids)) == 2, "each launch is its own MLflow run"
