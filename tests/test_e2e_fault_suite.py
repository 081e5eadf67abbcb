"""The fault suite: every mode (the five, nccl_sync in lockstep, and one outer optimizer) against every fault a rank
can suffer.

Faults (3 ranks at speeds 1.0/0.5/0.5, equal for nccl_sync in lockstep, ``experiment=digits_mlp``, 5 epochs; 4 ranks
for the double kill):

* ``kill``: rank 2 is SIGKILLed at the start of its first averaging after its 20th batch (mid-epoch, and
  during a reduce: the coordinator waits for its answer, its peers may be inside the collective with it);
* ``kill2``: that, and rank 3 SIGKILLed 0.2 s after rank 2's process is gone (a node loss: two deaths a
  little apart, the second while the first's regroup is under way);
* ``stop``: rank 1 SIGSTOPs itself after its 20th batch; once the coordinator has declared it dead (no
  heartbeat for ``cluster.heartbeat_timeout_s``) the test SIGCONTs it;
* ``save_kill``: with ``checkpoint.every=2``, rank 1 is SIGKILLed on the first bundle ``save`` it receives.

Each run must FINISH within :data:`FAULT_TO_END_S` of the death, every pick of every epoch trained exactly once
(the coverage) and in exactly one reduce (the global step is the epochs' batch count but in cpu_async, where EASGD
counts a batch trained after its rank's snapshot in no window; with ``mode.overlap`` that batch is kept and counted in
the next; ``lost_picks`` 0), with no
process of the run left. ``make test`` runs a diagonal (every mode and every fault once); ``make conformance``
the rest of the matrix. With ``FLODL_FAULT_TABLE=<file>`` each
case appends its row (mode, fault, status, seconds from fault to end, picks trained vs expected) to that file.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import alive, assert_exact_coverage, launch_run, pids_of, read_events, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

EPOCHS = 5
BATCH = 32
HEARTBEAT_S = 4
FAULT_TO_END_S = 60.0
"""The bound from a death (as the coordinator declared it) to the run's end."""

MODES = {
    "nccl_sync": ["mode=nccl_sync"],
    "nccl_sync+lockstep": ["mode=nccl_sync", "mode.lockstep_ahead=8"],
    "nccl_cadence": ["mode=nccl_cadence"],
    "cpu_sync": ["mode=cpu_sync"],
    "cpu_cadence": ["mode=cpu_cadence"],
    "cpu_async": ["mode=cpu_async"],
    "cpu_cadence+overlap": ["mode=cpu_cadence", "mode.overlap=true", "reports_per_epoch=2"],
    "cpu_async+overlap": ["mode=cpu_async", "mode.overlap=true", "reports_per_epoch=2"],
    "nccl_cadence+overlap": ["mode=nccl_cadence", "mode.overlap=true", "reports_per_epoch=2"],
    "nccl_sync+overlap": ["mode=nccl_sync", "mode.overlap=true", "reports_per_epoch=2"],
    "nccl_cadence+diloco": ["mode=nccl_cadence", "outer=diloco"],
}
FAULTS = ("kill", "kill2", "stop", "save_kill")
IN_MAKE_TEST = {("nccl_sync", "stop"), ("nccl_sync+lockstep", "kill"), ("nccl_cadence", "kill2"), ("cpu_sync", "save_kill"), ("cpu_cadence", "kill"),
                ("cpu_async", "kill"), ("nccl_cadence+diloco", "save_kill"), ("cpu_cadence+overlap", "stop"),
                ("cpu_async+overlap", "kill"), ("nccl_cadence+overlap", "kill"),
                ("nccl_sync+overlap", "kill2")}
"""The diagonal ``make test`` runs: every mode and every fault once (the Gloo hang behind ``nccl_sync``'s lost
rank also has its own two-process test in ``make test``: tests/test_collective_regroup.py)."""


def _cases():
    for mode in MODES:
        for fault in FAULTS:
            marks = () if (mode, fault) in IN_MAKE_TEST else (pytest.mark.conformance,)
            yield pytest.param(mode, fault, id=f"{mode}-{fault}", marks=marks)


def _overrides(mode: str, fault: str) -> tuple[list[str], str, list[int]]:
    """Config overrides, the FLODL_FAULT_INJECT spec and the ranks expected to die."""
    ranks, speeds = (4, "[1.0,0.5,0.5,0.5]") if fault == "kill2" else (3, "[1.0,0.5,0.5]")
    if mode.endswith("+lockstep"):  # equal speeds: a faster rank ends its equal share first, and no license is sized
        speeds = "[" + ",".join(["1.0"] * ranks) + "]"
    ov = [*MODES[mode], "experiment=digits_mlp", f"experiment.epochs={EPOCHS}", f"cluster.ranks_per_node={ranks}",
          f"cluster.rank_speeds={speeds}", f"cluster.heartbeat_timeout_s={HEARTBEAT_S}", "seed=3"]
    if fault == "kill":
        return ov, "2:20:killsync", [2]
    if fault == "kill2":  # rank 2 dies early (its 8th batch), rank 3 at its 20th: both mid-run on any machine (the
        return ov, "2:8:killsync,3:20:kill", [2, 3]  # test killed rank 3 0.2 s after rank 2; a fast run had ended)
    if fault == "stop":
        return ov, "1:20:hang", [1]
    return [*ov, "checkpoint.every=2"], "1:1:killsave", [1]


def _event_t(job: Path, name: str, **match) -> float | None:
    for e in read_events(job):
        if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
            return float(e["t"])
    return None


@pytest.mark.parametrize(("mode", "fault"), list(_cases()))
def test_a_fault_ends_in_a_finished_run_with_every_pick_trained_once(store, mode, fault, monkeypatch):
    overrides, inject, victims = _overrides(mode, fault)
    monkeypatch.setenv("FLODL_FAULT_INJECT", inject)
    h = launch_run(store, "fault_suite", *overrides)
    monkeypatch.delenv("FLODL_FAULT_INJECT")
    job = Path(h.job_dir)
    try:
        wait_for(lambda: _event_t(job, "started") is not None, timeout=300, what="the run to start")  # start-up is slow under load
        pid = {e["rank"]: e["pid"] for e in read_events(job) if e.get("event") == "joined"}
        if fault == "stop":
            wait_for(lambda: _event_t(job, "rank_dead", rank=1) is not None, timeout=180,
                     what="the stopped rank to be declared dead")
            time.sleep(2.0)
            os.kill(pid[1], signal.SIGCONT)
        res = h.wait()
    finally:
        for p in pids_of(job):  # a failed assertion above must not leave a stopped process behind
            if alive(p):
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    wait_for(lambda: not any(alive(p) for p in pids_of(job)), timeout=30, what="every process of the run to end")
    died_at = min(_event_t(job, "rank_dead", rank=r) or float("inf") for r in victims)
    end_at = _event_t(job, "end")
    expected = EPOCHS * (res["total_picks"] // BATCH)
    row = {"mode": mode, "fault": fault, "status": res["status"], "fault_to_end_s": round((end_at or 0) - died_at, 1),
           "batches": res["global_step"], "expected": expected, "lost_picks": res.get("lost_picks"),
           "retrained_picks": res.get("retrained_picks"), "deaths": [d["rank"] for d in res["deaths"]]}
    if os.environ.get("FLODL_FAULT_TABLE"):
        with open(os.environ["FLODL_FAULT_TABLE"], "a") as fh:
            fh.write(json.dumps(row) + "\n")
    assert res["status"] == "FINISHED", row
    assert sorted(row["deaths"]) == victims, row
    assert end_at is not None and end_at - died_at <= FAULT_TO_END_S, row
    assert_exact_coverage(res, BATCH)
    assert res["lost_picks"] == 0, row
    if mode == "cpu_async":  # without overlap (cpu_async+overlap keeps those batches: every one in a reduce)
        # EASGD: a batch trained after its rank's snapshot survives at weight 1 - alpha in no window's count
        # (algorithms.md 3.9), so even a run without a fault counts fewer than the epochs' batches
        assert 0.8 * expected <= res["global_step"] <= expected, row
    else:
        assert res["global_step"] == expected, row  # every batch in exactly one reduce
    assert res["final_eval"]["eval/accuracy"] >= 0.85, res["final_eval"]
    # the run ends on a consensus: every survivor holds the same replica to the last bit (an overlapped reduce's
    # correction, W + (avg - W_sent), would leave them apart by rounding where nothing was trained since)
    assert len({f["hash"] for f in res["finals"].values()}) == 1, res["finals"]
    if not mode.endswith("+lockstep"):
        assert res["lockstep_syncs"] == 0
    if mode.endswith("+overlap"):  # ElChe's overhead is what the reduces held the ranks, as they said it
        held = [e for e in read_events(job) if e.get("event") == "window" and "held_ms" in e]
        assert held, "the overlapped reduces' window records say what they held the ranks (window/held_ms)"
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.info.status == "FINISHED" and "lost_picks" not in run.data.tags
    if fault == "save_kill":
        # the bundle the dead rank was asked to help write was completed by the survivors (or recorded failed,
        # never waited for): training went on to the end either way
        stems = [e["stem"] for e in read_events(job) if e.get("event") == "checkpoint"]
        assert stems, "no periodic bundle was completed after the death"
        meta = json.loads(Path(stems[0] + ".meta.json").read_text())
        assert meta["save_reason"] == "periodic" and os.path.basename(stems[0]) + ".pt" in meta["pieces"]
