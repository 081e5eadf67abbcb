"""The cooperative tier's failure paths end to end (its conformance runs are in test_modes, a lost rank of
three in test_e2e_faults): a loop that holds a batch without ``w.step()`` is reported within the heartbeat
timeout, naming the call; a loop that raises loses its rank (the survivors finish), or with
cluster.loop_error=fail ends the run FAILED with the user's traceback."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import assert_exact_coverage, launch_run, read_events, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HEARTBEAT_TIMEOUT_S = 8


def test_a_held_batch_is_reported_and_a_raising_loop_fails_the_run(store, tmp_path, monkeypatch):
    from flodl_exp.jobs.launcher import RunFailed

    gate = tmp_path / "release"
    monkeypatch.setenv("FLODL_TEST_LOOP_GATE", str(gate))
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    h = launch_run(store, "cooperative", "mode=cpu_cadence", "experiment=digits_accumulate",
                   "experiment.loop=loops_under_test.hold_then_raise", "experiment.epochs=3",
                   f"cluster.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "cluster.loop_error=fail")

    def notice() -> dict | None:
        return next((e for e in read_events(Path(h.job_dir)) if e.get("event") == "loop_stalled"), None)

    wait_for(lambda: notice() is not None or h.done(), timeout=120, what="the held batch to be reported")
    stalled = notice()
    assert stalled is not None, "the run ended without reporting the held batch"
    assert stalled["rank"] == 1 and "w.step()" in stalled["message"]
    assert stalled["held_s"] < HEARTBEAT_TIMEOUT_S, "reported within the heartbeat timeout"
    gate.touch()
    with pytest.raises(RunFailed, match="deliberate bug in the user's loop"):
        h.wait()
    assert "loop_error" in h.result["failure"] and "loops_under_test.py" in h.result["failure"], h.result["failure"]
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.info.status == "FAILED"
    assert "hold_then_raise" in run.data.tags["error"] and "w.step()" in run.data.tags["loop_warning.rank1"]


def test_a_raising_loop_loses_its_rank_and_the_survivors_finish(store, tmp_path, monkeypatch):
    """cluster.loop_error=lose_rank (the default): rank 1's loop raises at its first batch; its process exits, the
    coordinator declares it dead, the two survivors retrain its picks and the run FINISHES, every pick once."""
    gate = tmp_path / "open"
    gate.touch()  # rank 1 raises at once
    monkeypatch.setenv("FLODL_TEST_LOOP_GATE", str(gate))
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    h = launch_run(store, "cooperative", "mode=cpu_cadence", "experiment=digits_accumulate",
                   "experiment.loop=loops_under_test.hold_then_raise", "experiment.epochs=2",
                   "cluster.ranks_per_node=3", f"cluster.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}")
    res = h.wait()
    assert res["status"] == "FINISHED" and [d["rank"] for d in res["deaths"]] == [1]
    assert "deliberate bug in the user's loop" in res["deaths"][0]["reason"]
    assert_exact_coverage(res, 32)
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert "hold_then_raise" in run.data.tags["loop_error.rank1"] and "error" not in run.data.tags
    # the rank's own death record (the reference's), beside the coordinator's summary
    own = json.loads((Path(h.job_dir) / "ranks" / "death.r1.json").read_text())
    assert own["schema_version"] == 1 and own["rank"] == 1 and own["world_size"] == 3
    assert "deliberate bug in the user's loop" in own["error"] and own["unix_time"] > 0
