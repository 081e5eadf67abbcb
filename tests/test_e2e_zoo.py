"""The zoo end to end from the CLI: tiny char_rnn (cpu_async) and resnet20 (nccl_cadence) runs on two local ranks
finish, evaluate on the callback rank and log the task's metrics (the LM's unigram baseline beside its loss).

Sizes are cut to a few steps so both runs fit ~60 s on two cores; the measured CPU-preset numbers are in the
README (flodl_exp/zoo/README_section.md).
"""
from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from conftest import base_overrides, run_cli, run_id_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _finished(store: dict, *args: str) -> dict:
    r = run_cli([*base_overrides(store, "zoo"), "cluster=local", *args], timeout=150)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    run = MlflowClient(store["uri"]).get_run(run_id_of(r.stdout))
    assert run.info.status == "FINISHED"
    return run.data.metrics


def test_char_rnn_and_resnet20_train_from_the_cli(store):
    lm = _finished(store, "experiment=char_rnn", "mode=cpu_async", "experiment.epochs=1",
                   "experiment.train_data.windows=320", "experiment.eval_data.windows=16")
    assert lm["eval/unigram_loss"] == pytest.approx(3.02, abs=0.01)  # the KJV's, in nats per character
    assert math.isfinite(lm["eval/loss"]) and lm["eval/loss"] < math.log(65)  # below a uniform guess after 20 steps
    img = _finished(store, "experiment=resnet20", "mode=nccl_cadence", "experiment.epochs=1",
                    "experiment.train_data.limit=256", "experiment.eval_data.limit=100")
    assert 0.0 <= img["eval/accuracy"] <= 1.0 and math.isfinite(img["eval/loss"])
