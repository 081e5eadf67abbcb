"""cluster=slurm end to end on a real one-node SLURM cluster (slurmctld + slurmd + slurmdbd).

The module fixture runs tests/slurm/up.sh (installs the Debian packages when missing; needs
root) and tests/slurm/down.sh at teardown (FLODL_SLURM_KEEP=1 leaves it up). The cluster has
4 CPUs on this 2-core box, so two 2-rank jobs run at once and a third queues. Order matters
(pytest runs a module top to bottom): the detached runs are submitted first, on an idle
cluster (the CLI's return time is measured), and keep it busy (the sweep's jobs held at a gate)
until the foreground run has been seen queued behind them; the time-limit test runs once they are done (its timing is tight); the last
test checks that the detached runs ended on their own.

The first tests need no cluster: they check how the config maps onto sbatch.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import CliProcess, base_overrides, compose, job_dir_of, read_events, read_result, run_cli, run_id_of, slurm_cluster_up

slurm = pytest.mark.slurm


# -- no cluster needed: the sbatch script ------------------------------------
def _sbatch_text(*overrides: str) -> str:
    from submitit.slurm.slurm import _make_sbatch_string

    from flodl_exp.jobs.executor import slurm_parameters

    cfg = compose(["cluster=slurm", *overrides])
    return _make_sbatch_string(command="python -m submitit.core._submit /x", folder="/tmp/x",
                               **slurm_parameters(cfg.cluster, "digits_mlp/nccl_cadence/trend"))


def test_sbatch_script_maps_the_cluster_config():
    text = _sbatch_text("cluster.nodes=4", "cluster.ranks_per_node=8", "cluster.slurm.gpus_per_node=8",
                        "cluster.slurm.cpus_per_task=6", "cluster.slurm.mem_gb=480", "cluster.slurm.time_min=240",
                        "cluster.slurm.partition=gpu", "cluster.slurm.account=proj", "cluster.slurm.qos=high",
                        "cluster.slurm.constraint=h100", "cluster.slurm.exclude=node13",
                        "cluster.slurm.setup=[module load cuda]", "+cluster.slurm.additional_parameters.mail-type=END",
                        "tracking.uri=sqlite:////shared/m.db")
    for flag in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=6", "--mem=480GB",
                 "--time=240", "--partition=gpu", "--account=proj", "--qos=high", "--constraint=h100",
                 "--exclude=node13", "--signal=USR2@90", "--mail-type=END"):
        assert f"#SBATCH {flag}" in text, flag
    assert "module load cuda" in text
    assert "srun --unbuffered" in text and "--kill-on-bad-exit" not in text  # a dead rank is the fault rules'
    killing = _sbatch_text("cluster.slurm.srun_args=['--kill-on-bad-exit=1']")
    assert "--kill-on-bad-exit=1" in killing


def test_no_kill_goes_to_sbatch_and_srun_by_default():
    """A failed node leaves the job running (tests/test_e2e_slurm_multinode.py shows why both need it)."""
    text = _sbatch_text()
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    assert "#SBATCH --no-kill" in text and " --no-kill " in srun
    off = _sbatch_text("cluster.slurm.no_kill=false")
    assert "--no-kill" not in off
    mine = _sbatch_text("cluster.slurm.srun_args=['-k','--kill-on-bad-exit=1']")
    srun = next(x for x in mine.splitlines() if x.startswith("srun "))
    assert "--no-kill" not in srun and " -k " in srun and "#SBATCH --no-kill" in mine  # the user's spelling, once


def test_sbatch_script_small_limits_and_no_gpus():
    text = _sbatch_text("cluster.slurm.time_min=1")
    assert "#SBATCH --signal=USR2@15" in text  # the 90 s default would fire at once under a 1-minute limit
    assert "--gpus-per-node" not in text  # not asked for: sites without GRES refuse the flag
    assert "#SBATCH --time=1" in text
    from flodl_exp.jobs.executor import signal_delay_s

    assert [signal_delay_s(m) for m in (1, 2, 6, 60)] == [15, 30, 90, 90]
    text = _sbatch_text("+cluster.slurm.additional_parameters.signal=USR2@300")
    assert "#SBATCH --signal=USR2@300" in text and "USR2@90" not in text


def test_coordinator_address_and_stale_rendezvous(tmp_path, monkeypatch):
    import socket

    from flodl_exp.config import load_cluster
    from flodl_exp.jobs.job import coordinator_host
    from flodl_exp.rendezvous import RendezvousTimeout, incarnation, wait_rendezvous, write_rendezvous

    assert coordinator_host(load_cluster({"executor": "slurm", "nodes": 1, "host": None})) == socket.gethostname()
    assert coordinator_host(load_cluster({"executor": "slurm", "nodes": 1, "host": "10.1.2.3"})) == "10.1.2.3"
    assert coordinator_host(load_cluster({"executor": "local", "nodes": 1, "host": None})) == "127.0.0.1"
    # A requeued job must not dial the port an earlier incarnation's coordinator wrote.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_rendezvous(str(tmp_path), {"port": 1, "incarnation": "0.0"})
    with pytest.raises(RendezvousTimeout):
        wait_rendezvous(str(tmp_path), 0.3, attempt=1)
    write_rendezvous(str(tmp_path), {"port": 2, "incarnation": incarnation(1)})
    assert wait_rendezvous(str(tmp_path), 1, attempt=1)["port"] == 2


# -- the cluster --------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster_up("test_e2e_slurm"):
        yield {"detached": []}


def _overrides(store: dict, *extra: str) -> list[str]:
    return [*base_overrides(store, "slurm"), "cluster=slurm", "cluster.slurm.partition=debug", *extra]


def _squeue() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20).stdout
    return {x.strip() for x in out.split() if x.strip()}


def _wait_for(pred, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _job_id(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("MLflow run ") and "  job " in line:
            return line.split("  job ", 1)[1].split()[0]
    raise AssertionError(f"no job id in output:\n{out}")


def _sweep_gate(store: dict) -> Path:
    """The gate the detached sweep's jobs wait at (rank 0, first batch) until the foreground run has queued."""
    return Path(store["dir"]) / "detached_sweep.gate"


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"


@slurm
@pytest.mark.timeout(120)
def test_detached_submission_returns_at_once(cluster, store):
    """run.wait=false: job id, run id and log paths, then exit; a sweep submits every job."""
    from flodl_exp.tracking import get_or_create_experiment

    # The session's first MLflow call creates the SQLite store (~4 s of migrations): not the launcher's cost.
    get_or_create_experiment(MlflowClient(store["uri"]), "slurm", None)
    args = _overrides(store, "mode=cpu_cadence", "experiment=digits_mlp", "experiment.epochs=3", "run.wait=false")
    # Rank 0 waits at its first batch until the gate file exists (sbatch exports the environment): the job
    # cannot end before the test releases it, so "the CLI returned while the run was RUNNING" is a fact,
    # not a race against the machine's speed.
    gate = Path(store["dir"]) / "detached.gate"
    t0 = time.monotonic()
    try:
        r = run_cli(args, timeout=60, env={"FLODL_FAULT_INJECT": f"0:1:gate:{gate}"})
        dt = time.monotonic() - t0
        _ok(r)
        print(f"\n[test_e2e_slurm] run.wait=false: the CLI returned after {dt:.1f}s", file=sys.stderr)
        assert MlflowClient(store["uri"]).get_run(run_id_of(r.stdout)).info.status == "RUNNING", \
            f"run.wait=false waited for the job:\n{r.stdout}"
    finally:
        gate.touch()
    assert "not waiting (run.wait=false)" in r.stdout
    for word in ("coordinator", "task0 stdout", "task0 stderr", "scancel"):
        assert word in r.stdout
    job_id = _job_id(r.stdout)
    cluster["detached"].append((run_id_of(r.stdout), job_id))

    sweep = _overrides(store, "mode=cpu_cadence", "experiment=digits_mlp", "experiment.epochs=3", "run.wait=false")
    sweep = [a for a in sweep if not a.startswith("hydra.run.dir")]
    # The sweep's jobs hold their CPUs at a gate of their own until the foreground run has been seen queued
    # behind them (test_cluster_slurm_run_finishes_with_the_job_id_in_mlflow opens it): on a fast machine they
    # would otherwise end before that run is submitted, and it would never queue.
    t0 = time.monotonic()
    r = run_cli(["-m", *sweep, f"hydra.sweep.dir={store['dir']}/sweep", "seed=1,2"], timeout=90,
                env={"FLODL_FAULT_INJECT": f"0:1:gate:{_sweep_gate(store)}"})
    dt = time.monotonic() - t0
    _ok(r)
    ids = [(line.split()[2], line.split("  job ", 1)[1].split()[0]) for line in r.stdout.splitlines() if line.startswith("MLflow run ")]
    assert len(ids) == 2, r.stdout
    print(f"[test_e2e_slurm] sweep of 2 with run.wait=false: returned after {dt:.1f}s", file=sys.stderr)
    queued = _squeue()
    assert all(j in queued for _, j in ids), "the sweep waited for a job"
    cluster["detached"].extend(ids)


@slurm
@pytest.mark.timeout(240)
def test_cluster_slurm_run_finishes_with_the_job_id_in_mlflow(cluster, store):
    """The DONE command: 2 ranks as 2 SLURM tasks, queued behind the detached jobs, then trained."""
    args = _overrides(store, "cluster.ranks_per_node=2", "mode=cpu_cadence", "experiment=digits_mlp",
                      "cluster.slurm.mem_gb=1")
    t0 = time.monotonic()
    cli = CliProcess(args)
    try:  # the gated sweep jobs hold the 4 CPUs: the run queues behind them, then they are let go
        _wait_for(lambda: any("queued (PENDING" in x for x in cli.out) or cli.proc.poll() is not None, 120,
                  "the run to be seen queued behind the held sweep jobs")
    finally:
        _sweep_gate(store).touch()
    try:
        rc = cli.proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        cli.proc.kill()
        rc = cli.proc.wait()
    stdout, stderr = cli.output()
    assert rc == 0, f"exit {rc}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    print(f"\n[test_e2e_slurm] cluster=slurm run: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    run_id, job_id, job = run_id_of(stdout), _job_id(stdout), job_dir_of(stdout)
    assert "queued (PENDING" in stdout
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/accuracy"] >= 0.90
    assert run.data.tags["job_id"] == job_id and run.data.tags["slurm_job_id"] == job_id
    assert run.data.tags["cluster"] == "slurm" and run.data.tags["world_size"] == "2"
    res = read_result(job)
    assert res["status"] == "FINISHED" and len(res["finals"]) == 2
    assert len({f["hash"] for f in res["finals"].values()}) == 1
    script = next((job / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --partition=debug" in script and "#SBATCH --mem=1GB" in script
    assert "#SBATCH --ntasks-per-node=2" in script


@slurm
@pytest.mark.timeout(240)
def test_crashed_rank_ends_the_job_failed_with_its_error(cluster, store):
    """With srun --kill-on-bad-exit=1 (opted into: the default leaves a dead rank to the fault rules) a crashed
    rank ends the job: the coordinator sees it first and saves a bundle (task_failed). FLODL_FAULT_INJECT reaches
    the SLURM tasks (sbatch exports the environment)."""
    r = run_cli(_overrides(store, "cluster.ranks_per_node=2", "mode=cpu_cadence", "experiment=digits_mlp",
                           "experiment.epochs=20", "cluster.slurm.srun_args=['--kill-on-bad-exit=1']"),
                timeout=230, env={"FLODL_FAULT_INJECT": "1:10:raise"})
    assert r.returncode == 1, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    run_id, job_id, job = run_id_of(r.stdout), _job_id(r.stdout), job_dir_of(r.stdout)
    ev = read_events(job)
    started = next(e["t"] for e in ev if e["event"] == "started")
    ended = next(e["t"] for e in ev if e["event"] == "end")
    print(f"\n[test_e2e_slurm] crashed rank: run ended {ended - started:.1f}s after the start of training",
          file=sys.stderr)
    assert ended - started < 30
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "FAILED"
    assert "injected fault" in run.data.tags["error"] and "rank 1" in run.data.tags["error"]
    assert run.data.tags["save_reason"] == "task_failed"
    assert "injected fault" in r.stderr
    _wait_for(lambda: job_id not in _squeue(), 30, f"job {job_id} to leave squeue")


TIME_LIMIT_EPOCHS = 15


@slurm
@pytest.mark.timeout(480)
def test_time_limit_requeues_and_resumes_into_the_same_run(cluster, store):
    """time_min=1: USR2 reaches task 0, the coordinator writes a bundle, the job requeues and resumes.

    slurmctld checks limits every 30 s, so the signal comes 15-45 s after the start. Both ranks wait at their
    50th batch (epoch 3 of 15) on a gate, reading control as between batches, until the requeue is seen: the
    signal always lands mid-run however fast or busy the machine. The gate is opened then, and the test raises
    the limit of the (pending) job so the resumed incarnation runs to the end instead of being preempted again
    at a random point: that is a 60-minute limit's life, compressed.
    """
    t0 = time.monotonic()
    gate = Path(store["dir"]) / "time_limit.gate"
    args = _overrides(store, "mode=cpu_cadence", "experiment=digits_mlp", f"experiment.epochs={TIME_LIMIT_EPOCHS}",
                      "cluster.slurm.time_min=1", "run.wait=false")
    try:
        r = run_cli(args, timeout=60, env={"FLODL_FAULT_INJECT": f"0:50:gate:{gate},1:50:gate:{gate}"})
        _ok(r)
        job, run_id, job_id = job_dir_of(r.stdout), run_id_of(r.stdout), _job_id(r.stdout)
        _wait_for(lambda: (job / "spec.attempt1.json").exists(), 200, "the preemption bundle and requeue")
        t_requeue = time.monotonic() - t0
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True, timeout=20)
    finally:
        gate.touch()
    c = MlflowClient(store["uri"])
    _wait_for(lambda: c.get_run(run_id).info.status != "RUNNING", 200, "the resumed run to end", every=1.0)
    dt = time.monotonic() - t0
    print(f"\n[test_e2e_slurm] time limit: requeued after {t_requeue:.0f}s, finished after {dt:.0f}s", file=sys.stderr)

    run = c.get_run(run_id)
    assert run.info.status == "FINISHED", run.data.tags.get("error")
    assert run.data.tags["slurm_job_id"] == job_id and run.data.tags["slurm_restart_count"] == "1"
    assert run.data.tags["preemptions"] == "1"
    assert [m.step for m in c.get_metric_history(run_id, "loss")] == list(range(TIME_LIMIT_EPOCHS))  # each epoch once
    assert run.data.metrics["eval/accuracy"] >= 0.90
    mark = json.loads((job / "preempted.json").read_text())
    meta = json.loads(Path(mark["stem"] + ".meta.json").read_text())
    assert meta["save_reason"] == "preempted" and Path(mark["stem"] + ".pt").exists()
    res = read_result(job)
    assert res["status"] == "FINISHED" and res["resumed_from"] == mark["stem"] and res["attempt"] == 1
    assert json.loads((job / "result.attempt0.json").read_text())["status"] == "PREEMPTED"
    kinds = [e["event"] for e in read_events(job)]
    assert kinds.count("preempted") == 1 and kinds.count("resumed") == 1 and kinds[-1] == "end"
    # Coverage-granular bundle: every pick of the interrupted epoch trained exactly once overall.
    total = (res["total_picks"] // 32) * 32
    for p in meta["coverage"]["per_epoch"]:
        hits = [1] * total
        for off, size in p["uncovered_ranges"]:
            for i in range(off, off + size):
                hits[i] -= 1
        for off, size in res["coverage"][str(p["epoch"])]:
            for i in range(off, off + size):
                hits[i] += 1
        assert all(h == 1 for h in hits), f"epoch {p['epoch']}: picks trained other than once across the requeue"
    assert res["global_step"] == TIME_LIMIT_EPOCHS * (total // 32)
    _wait_for(lambda: job_id not in _squeue(), 30, f"job {job_id} to leave squeue")


@slurm
@pytest.mark.timeout(240)
def test_detached_runs_end_finished_on_their_own(cluster, store):
    assert cluster["detached"], "test_detached_submission_returns_at_once did not submit"
    _sweep_gate(store).touch()  # already open unless the foreground run's test was deselected
    c = MlflowClient(store["uri"])
    for run_id, job_id in cluster["detached"]:
        _wait_for(lambda run_id=run_id: c.get_run(run_id).info.status != "RUNNING", 200, f"run {run_id} (job {job_id}) to end", every=1.0)
        run = c.get_run(run_id)
        assert run.info.status == "FINISHED", run.data.tags.get("error")
        assert run.data.tags["slurm_job_id"] == job_id
        assert run.data.metrics["eval/accuracy"] >= 0.85
    _wait_for(lambda: not (_squeue() & {j for _, j in cluster["detached"]}), 30, "the detached jobs to leave squeue")
