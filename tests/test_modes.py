"""One conformance suite on the simulated 3:1 rig (cluster=local_hetero): every mode, the outer optimizers on the
two low-communication modes (nccl_cadence and cpu_async with outer=slowmo and outer=diloco; plain averaging
on them is the default run of the other end-to-end tests), and both tiers: the managed loop (experiment
digits_mlp) and the cooperative examples of flodl_exp/zoo/loops.py (digits_accumulate: gradient accumulation;
digits_two_optimizers: an encoder/decoder pair with two optimizers). Every case checks the same invariants.

The sync modes' end-to-end checks live here too (telemetry of every rank, the collective the coordinator
chose). ``make test`` runs the cases of CASES (each mode, each example loop at least on the modes that differ for it);
``make conformance`` runs the whole matrix, MATRIX too (each example on all five modes, the managed loop
on all five)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from conftest import assert_exact_coverage, base_overrides, compose, read_events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MANAGED, ACCUMULATE, TWO_OPTIMIZERS = "digits_mlp", "digits_accumulate", "digits_two_optimizers"
CASES = [("nccl_sync", "avg", ACCUMULATE), ("cpu_sync", "avg", TWO_OPTIMIZERS), ("cpu_cadence", "avg", MANAGED),
         ("nccl_cadence", "slowmo", TWO_OPTIMIZERS), ("cpu_async", "diloco", TWO_OPTIMIZERS)]
"""``make test``: every mode, each example loop on both backends and every policy but one (the lost-rank test of
test_e2e_faults runs digits_accumulate on cpu_cadence), the managed loop with the epoch hook and checkpoint_fn (the managed loop
on the other modes is the default run of the other end-to-end tests; on the sync modes it is in MATRIX)."""
MATRIX = [("nccl_cadence", "diloco", ACCUMULATE), ("cpu_async", "slowmo", ACCUMULATE), ("cpu_sync", "avg", ACCUMULATE), ("cpu_cadence", "avg", ACCUMULATE), ("nccl_sync", "avg", TWO_OPTIMIZERS),
          ("cpu_cadence", "avg", TWO_OPTIMIZERS), ("nccl_sync", "avg", MANAGED), ("cpu_sync", "avg", MANAGED),
          ("nccl_cadence", "avg", MANAGED), ("cpu_async", "avg", MANAGED)]
"""``make conformance`` only: the rest of the five modes x three loops."""
EPOCHS = 6


def _params(cases: list[tuple[str, str, str]], *marks: Any) -> list[Any]:
    return [pytest.param(m, o, e, id=f"{m}-{o}-{e.removeprefix('digits_')}", marks=marks) for m, o, e in cases]


@pytest.mark.parametrize(("mode", "outer", "experiment"), _params(CASES) + _params(MATRIX, pytest.mark.conformance))
def test_mode_on_heterogeneous_ranks(store, mode, outer, experiment, monkeypatch):
    from flodl_exp.jobs.launcher import launch

    hook = ["experiment.epoch_fn=flodl_exp.zoo.digits.epoch_probe"] if mode == "cpu_cadence" else []
    export = mode == "cpu_cadence" and experiment == MANAGED
    if export:  # the user's checkpoint_fn with the periodic bundles (versions 2 and 4); rank 0's fails: failover
        hook += ["experiment.checkpoint_fn=flodl_exp.zoo.digits.export_checkpoint", "checkpoint.every=2"]
        monkeypatch.setenv("FLODL_TEST_CHECKPOINT_FN_FAIL_RANK", "0")
    h = launch(compose([*base_overrides(store, "modes"), f"mode={mode}", f"outer={outer}", "cluster=local_hetero",
                        f"experiment={experiment}", f"experiment.epochs={EPOCHS}", *hook]))
    res = h.wait()
    assert res["status"] == "FINISHED"
    assert res["final_eval"]["eval/accuracy"] >= 0.90
    assert_exact_coverage(res, 32)
    assert len({f["hash"] for f in res["finals"].values()}) == 1, "replicas differ after the final consensus"
    c = MlflowClient(store["uri"])
    share = [m.value for m in c.get_metric_history(h.run_id, "rank0/batch_share")]
    assert len(share) == EPOCHS
    if mode.endswith("cadence"):
        # Equal counts (no balancing) give exactly 0.5; ElChe gives rank 0 its measured speed's share, 0.75 on
        # an idle machine, less when other work slows rank 0's compute more than rank 1's sleep (0.636 seen
        # under load). The check asserts the balancing, not the machine's speed.
        late = share[EPOCHS // 2:]
        assert sum(late) / len(late) >= 0.58, f"fast rank share over the last half: {late}"
    run = c.get_run(h.run_id)
    for key in ("anchor", "syncs", "sync_ms_avg", "divergence_max", "guard_action"):
        assert key in run.data.metrics
    for rank in range(2):  # telemetry too, though these epochs are far shorter than a report interval (the flush at exit)
        for key in ("batch_share", "samples_per_s", "data_starve_ms", "idle_frac", "cpu_pct", "rss_gb"):
            assert f"rank{rank}/{key}" in run.data.metrics, sorted(run.data.metrics)
    if mode.startswith("nccl"):  # CPU ranks: the coordinator chose Gloo for the cohort, once, from the hellos
        chosen = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "collective"]
        assert [e["backend"] for e in chosen] == ["gloo"] and run.data.tags["collective"] == "gloo"
    assert run.data.tags["policy"] == mode.split("_")[1] and run.data.tags["backend"] == mode.split("_")[0]
    assert run.data.tags["outer"].split("(")[0] == outer
    if hook:  # the epoch hook ran once per epoch, on one rank, before the epoch, and saw the last aggregate
        norms = c.get_metric_history(h.run_id, "epoch_fn/weight_norm")
        assert sorted(m.step for m in norms) == list(range(EPOCHS)) and all(m.value > 0 for m in norms)
        assert c.get_metric_history(h.run_id, "epoch_fn/last_loss"), "EpochAggregated reached the epoch-role rank"
    if export:
        _check_exports(h, c)
    if not mode.endswith("sync"):  # progressive: the eval after each epoch gets callback slack once measured
        slack = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "callback_slack"]
        assert slack and all(e["ms"] > 0 for e in slack), slack
    if experiment != MANAGED:  # the loop's own scalar rolled up per epoch, as record_scalar in a managed step
        scalar = "micro_batches" if experiment == ACCUMULATE else "recon_mse"
        values = [m.value for m in c.get_metric_history(h.run_id, scalar)]
        assert len(values) == EPOCHS and all(v > 0 for v in values), values
        assert run.data.params["experiment.loop"].startswith("flodl_exp.zoo.loops.")
    if outer != "avg":  # per epoch with a reduce: the mean outer step and the momentum at its last reduce
        steps = c.get_metric_history(h.run_id, "outer/step_norm")
        momentum = [m.value for m in c.get_metric_history(h.run_id, "outer/momentum_norm")]
        # an epoch with no reduce (async's long windows) records none
        assert 0 < len(steps) <= EPOCHS and all(m.value >= 0 for m in steps) and momentum[-1] > 0
        assert run.data.params["outer.kind"] == outer


def _check_exports(h: Any, c: MlflowClient) -> None:
    """checkpoint_fn ran for versions 2 and 4, each written by a rank other than rank 0 (whose export fails on
    purpose: the coordinator moved it on), and each file loads into the model's state_dict keys."""
    import torch

    from flodl_exp.zoo.digits import MLP

    events = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "checkpoint_fn"]
    ok = {e["version"]: e["rank"] for e in events if not e.get("error")}
    assert ok.keys() == {2, 4} and 0 not in ok.values(), events
    assert any(e["rank"] == 0 and "on purpose" in (e.get("error") or "") for e in events), "rank 0 saw the env: failover"
    assert not [e for e in events if e.get("gave_up")], events
    keys = MLP(hidden=128).state_dict().keys()
    for v in (2, 4):
        state = torch.load(Path(h.job_dir) / "checkpoint_exports" / f"model_v{v}.pt", weights_only=True)
        assert state.keys() == keys
    assert sorted(m.step for m in c.get_metric_history(h.run_id, "checkpoint_fn/elapsed_ms")) == [2, 4]


def test_a_loop_stops_the_run_early_on_the_cohorts_eval(store):
    """flodl_exp/zoo/loops.py's early_stop (issue 29): every rank reads the cohort's evals (``w.poll_eval()``) and
    asks the run to stop once accuracy reaches its target (``w.request_stop()``); under async, where fast ranks
    run epochs ahead, the furthest epoch started is trained whole, then the run ends as planned runs end."""
    from flodl_exp.jobs.launcher import launch
    from flodl_exp.zoo.loops import TARGET_ACCURACY

    planned = 30
    h = launch(compose([*base_overrides(store, "modes"), "mode=cpu_async", "cluster=local_hetero",
                        "experiment=digits_early_stop", f"experiment.epochs={planned}"]))
    res = h.wait()
    assert res["status"] == "FINISHED"
    stops = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "stop"]
    assert len(stops) == 1, stops
    last = stops[0]["last_epoch"]
    assert res["epochs"] == last + 1 < planned
    assert res["final_eval"]["eval/accuracy"] >= 0.90
    assert_exact_coverage(res, 32)
    assert len({f["hash"] for f in res["finals"].values()}) == 1, "replicas differ after the final consensus"
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.data.tags["stopped_early"].startswith(f"after epoch {last} ")
    accs = [e["eval/accuracy"] for e in read_events(Path(h.job_dir)) if e.get("event") == "eval" and not e["final"]]
    assert max(accs) >= TARGET_ACCURACY or len(accs) > 3, f"it stopped on neither its target nor its patience: {accs}"


def test_mode_auto_probes_chooses_and_trains_the_chosen_mode(store):
    """Issue 31: ``mode=auto`` on the 3:1 rig; which mode it picks is the simulator's call on the probed rig (not
    asserted: machine speed moves it), what it must do is: choose among every mode, say so, and run exactly as
    that fixed mode runs (every pick once, replicas equal, the same quality bar), its prediction logged beside."""
    from flodl_exp.jobs.launcher import launch
    from flodl_exp.policy.mode import variant_of, with_overlap
    from flodl_exp.simulate.topology import MODES

    h = launch(compose([*base_overrides(store, "modes"), "mode=auto", "cluster=local_hetero", f"experiment={MANAGED}",
                        "experiment.epochs=4", "tracking.predict=true"]))
    res = h.wait()
    assert res["status"] == "FINISHED"
    chosen = res["auto"]["mode"]
    assert chosen in with_overlap(MODES) and res["auto"]["reason"].startswith(f"{chosen}: predicted ")
    (ev,) = [e for e in read_events(Path(h.job_dir)) if e.get("event") == "auto_mode"]
    assert [c["mode"] for c in ev["candidates"]] == with_overlap(MODES), "the cohort forms a group: every mode is a candidate"
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.data.tags["auto.choice"] == chosen and run.data.tags["mode"] == variant_of(chosen)[0]
    assert {f"auto.predicted.{m.replace('+', '.')}" for m in with_overlap(MODES)} <= set(run.data.tags)
    assert run.info.run_name.split("/")[1] == "auto"
    assert res["final_eval"]["eval/accuracy"] >= 0.90
    assert_exact_coverage(res, 32)
    assert len({f["hash"] for f in res["finals"].values()}) == 1, "replicas differ after the final consensus"
    assert h.prediction is not None and h.prediction["predicted/samples_per_s"] > 0, "predicted/* for the chosen mode"
