"""One conformance suite for the balancing modes on the simulated 3:1 rig (cluster=local_hetero), and the outer
optimizers on the two low-communication modes (nccl_cadence and cpu_async run with outer=slowmo and
outer=diloco here; plain averaging on them is the default run of the other end-to-end tests)."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import assert_exact_coverage, base_overrides, compose, read_events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CASES = [("cpu_cadence", "avg"), ("nccl_cadence", "slowmo"), ("nccl_cadence", "diloco"), ("cpu_async", "slowmo"),
         ("cpu_async", "diloco")]
"""The sync modes run end to end in test_e2e_runs.test_sync_modes_average_replicas (accuracy, coverage, identical
replicas, telemetry); on this rig they would add nothing of their own (no share to balance) for ~50 s of CI."""
EPOCHS = 6


@pytest.mark.parametrize(("mode", "outer"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_mode_on_heterogeneous_ranks(store, mode, outer):
    from flodl_exp.jobs.launcher import launch

    hook = ["experiment.epoch_fn=experiments.digits.epoch_probe"] if mode == "cpu_cadence" else []
    h = launch(compose([*base_overrides(store, "modes"), f"mode={mode}", f"outer={outer}", "cluster=local_hetero",
                        "experiment=digits_mlp", f"experiment.epochs={EPOCHS}", *hook]))
    res = h.wait()
    assert res["status"] == "FINISHED"
    assert res["final_eval"]["eval/accuracy"] >= 0.90
    assert_exact_coverage(res, 32)
    assert len({f["hash"] for f in res["finals"].values()}) == 1, "replicas differ after the final consensus"
    c = MlflowClient(store["uri"])
    share = [m.value for m in c.get_metric_history(h.run_id, "rank0/batch_share")]
    assert len(share) == EPOCHS
    if mode.endswith("cadence"):
        late = share[EPOCHS // 2:]
        assert sum(late) / len(late) >= 0.65, f"fast rank share over the last half: {late}"
    run = c.get_run(h.run_id)
    for key in ("anchor", "syncs", "sync_ms_avg", "divergence_max", "guard_action"):
        assert key in run.data.metrics
    assert run.data.tags["policy"] == mode.split("_")[1] and run.data.tags["backend"] == mode.split("_")[0]
    assert run.data.tags["outer"].split("(")[0] == outer
    if hook:  # the epoch hook ran once per epoch, on one rank, before the epoch, and saw the last aggregate
        norms = c.get_metric_history(h.run_id, "epoch_fn/weight_norm")
        assert sorted(m.step for m in norms) == list(range(EPOCHS)) and all(m.value > 0 for m in norms)
        assert c.get_metric_history(h.run_id, "epoch_fn/last_loss"), "EpochAggregated reached the epoch-role rank"
    if not mode.endswith("sync"):  # progressive: the eval after each epoch gets callback slack once measured
        slack = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "callback_slack"]
        assert slack and all(e["ms"] > 0 for e in slack), slack
    if outer != "avg":  # per epoch with a reduce: the mean outer step and the momentum at its last reduce
        steps = c.get_metric_history(h.run_id, "outer/step_norm")
        momentum = [m.value for m in c.get_metric_history(h.run_id, "outer/momentum_norm")]
        # an epoch with no reduce (async's long windows) records none
        assert 0 < len(steps) <= EPOCHS and all(m.value >= 0 for m in steps) and momentum[-1] > 0
        assert run.data.params["outer.kind"] == outer
