"""cluster=slurm across two nodes: a real two-node SLURM cluster on one machine (tests/slurm/up.sh --nodes 2).

Each compute node is a network namespace with its own host name (UTS namespace), its own address on a bridge
the script creates (node i: <subnet>.(10+i), default subnet 10.213.2) and its own slurmd; slurmctld (host
flodl2-head, bound to the bridge's root-side <subnet>.1), slurmdbd, mariadbd and munged run in the root
namespace. The process ids are shared (one PID namespace), the file system too (job folders, the MLflow SQLite
store, bundles), as on a cluster with shared storage. Every run is 2 nodes x 2 ranks of digits_mlp; the
coordinator runs on node 0 next to rank 0 and ranks 2 and 3 on node 1 dial it (and, in nccl_cadence, form a
Gloo group with ranks 0 and 1) across the bridge.

The fixture skips, loudly and with the exact error, only where the container forbids network namespaces
(up.sh exit 4), or where SLURM cannot run at all (not root, packages not installable: exit 2, 3).
``FLODL_SLURM_KEEP=1`` leaves the cluster up; ``bash tests/slurm/down.sh --nodes 2`` stops it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, _skip_loudly, alive, base_overrides, job_dir_of, read_events, read_result, run_cli, run_id_of

pytestmark = [pytest.mark.e2e, pytest.mark.slurm, pytest.mark.timeout(300)]

TAG = "test_e2e_slurm_multinode"
STATE_DIR = Path(os.environ.get("FLODL_SLURM_MULTI_DIR") or "/tmp/flodl-slurm2")
UP_TIMEOUT_S = 540  # cold: apt-get install (~15-30 s) + bring-up (~4 s)
NODE0, NODE1 = "flodl2-n0", "flodl2-n1"


def _script(name: str, timeout: float, *extra: str) -> tuple[int, str, float]:
    """tests/slurm/<name> --nodes 2 <dir> [extra]; output to a file, not a pipe: the daemons must not hold it open."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            rc = subprocess.run(["bash", str(ROOT / "tests" / "slurm" / name), "--nodes", "2", str(STATE_DIR), *extra],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        return rc, out.read(), time.monotonic() - t0


def _node_addrs() -> dict[str, str]:
    """node name -> its bridge address, from the hosts file up.sh wrote for node 0."""
    addrs = {}
    for line in (STATE_DIR / "net" / f"{NODE0}.hosts").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].startswith("flodl2-"):
            addrs[parts[1]] = parts[0]
    return addrs


@pytest.fixture(scope="module")
def cluster():
    if os.name != "posix" or os.geteuid() != 0:
        _skip_loudly(TAG, "not root (up.sh creates network namespaces, starts munged/mariadbd/slurm daemons, may apt-get install)")
    rc, out, dt = _script("up.sh", UP_TIMEOUT_S)
    if rc == 4:
        _skip_loudly(TAG, f"the container forbids network namespaces/links, no two-node cluster (up.sh rc=4):\n{out[-3000:]}")
    if rc in (2, 3):
        _skip_loudly(TAG, f"up.sh could not install/find slurm (rc={rc}):\n{out[-3000:]}")
    if rc != 0:
        pytest.fail(f"tests/slurm/up.sh --nodes 2 failed (rc={rc}) after {dt:.1f}s:\n{out[-6000:]}")
    print(f"\n[{TAG}] up.sh --nodes 2: {dt:.1f}s", file=sys.stderr, flush=True)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(STATE_DIR / "slurm.conf")  # submitit's sbatch calls and run_cli's children
    try:
        yield {"addrs": _node_addrs(), "t0": time.monotonic()}
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if os.environ.get("FLODL_SLURM_KEEP") == "1":
            print(f"[{TAG}] FLODL_SLURM_KEEP=1: cluster left up", file=sys.stderr)
        else:
            rc, out, dt = _script("down.sh", 120)
            print(f"[{TAG}] down.sh: {dt:.1f}s (rc={rc})", file=sys.stderr, flush=True)
            if rc != 0:
                print(out, file=sys.stderr)


def _overrides(store: dict, *extra: str) -> list[str]:
    return [*base_overrides(store, "slurm_multinode"), "cluster=slurm", "cluster.slurm.partition=debug",
            "cluster.nodes=2", "cluster.ranks_per_node=2", "experiment=digits_mlp", *extra]


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"


def _job_id(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("MLflow run ") and "  job " in line:
            return line.split("  job ", 1)[1].split()[0]
    raise AssertionError(f"no job id in output:\n{out}")


def _wait_for(pred, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _squeue() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20).stdout
    return {x.strip() for x in out.split() if x.strip()}


def _joined(job: Path) -> dict[int, dict]:
    return {e["rank"]: e for e in read_events(job) if e.get("event") == "joined"}


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _assert_two_nodes(job: Path, cluster: dict) -> None:
    """Ranks 0, 1 joined from node 0 and 2, 3 from node 1; the coordinator bound node 0's bridge address."""
    joined = _joined(job)
    assert {r: e["host"] for r, e in joined.items()} == {0: NODE0, 1: NODE0, 2: NODE1, 3: NODE1}, joined
    host = json.loads((job / "rendezvous.json").read_text())["host"]
    assert host == cluster["addrs"][NODE0], f"coordinator advertised {host}, node 0 is {cluster['addrs'][NODE0]}"
    log = (job / "coordinator.log").read_text()
    assert f"listening on {cluster['addrs'][NODE0]}:" in log


def _assert_records(records: Path) -> None:
    """One record-log folder per node, each with its own ranks' logs (hosts named by the ranks' hellos)."""
    assert (records / "root.log").exists()
    per_node = {d.name: sorted(f.name for f in d.glob("rank*.log")) for d in records.iterdir() if d.is_dir()}
    assert per_node == {NODE0: ["rank0.log", "rank1.log"], NODE1: ["rank2.log", "rank3.log"]}, per_node
    for node, ranks in ((NODE0, (0, 1)), (NODE1, (2, 3))):
        for r in ranks:
            lines = [json.loads(x) for x in (records / node / f"rank{r}.log").read_text().splitlines() if x.strip()]
            assert lines and all(x["rank"] == r for x in lines), f"{node}/rank{r}.log"


def _assert_tags(run, job_id: str) -> None:
    tags = run.data.tags
    assert tags["cluster"] == "slurm" and tags["world_size"] == "4"
    assert tags["job_id"] == job_id and tags["slurm_job_id"] == job_id
    assert tags["slurm_nodelist"] == "flodl2-n[0-1]", tags.get("slurm_nodelist")


@pytest.mark.timeout(300)
def test_nccl_cadence_across_two_nodes(cluster, store):
    """nccl_cadence 2x2: Gloo all_reduces across the namespaces; the coordinator on node 0 by its bridge address."""
    records = Path(store["dir"]) / "mn_records_nccl"
    t0 = time.monotonic()
    r = run_cli(_overrides(store, "mode=nccl_cadence", f"record_log.dir={records}"), timeout=280)
    _ok(r)
    print(f"\n[{TAG}] nccl_cadence 2x2: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    job, run_id, job_id = job_dir_of(r.stdout), run_id_of(r.stdout), _job_id(r.stdout)
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/accuracy"] >= 0.90
    _assert_tags(run, job_id)
    assert run.data.tags["collective"] == "gloo"
    res = read_result(job)
    assert res["status"] == "FINISHED" and len(res["finals"]) == 4
    assert len({f["hash"] for f in res["finals"].values()}) == 1  # one consensus across both nodes
    assert res["regroups"] == 0 and not res.get("deaths")
    _assert_two_nodes(job, cluster)
    _assert_records(records)
    script = next((job / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script


@pytest.mark.timeout(300)
def test_cpu_async_across_two_nodes(cluster, store):
    """cpu_async 2x2 with hierarchical averaging (issue 52): each node's lower rank sums its node's snapshots and
    hands on the consensus; the coordinator on node 0 combines one partial per node."""
    records = Path(store["dir"]) / "mn_records_async"
    t0 = time.monotonic()
    r = run_cli(_overrides(store, "mode=cpu_async", f"record_log.dir={records}", "cluster.node_reduce=true"), timeout=280)
    _ok(r)
    print(f"\n[{TAG}] cpu_async 2x2: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    job, run_id, job_id = job_dir_of(r.stdout), run_id_of(r.stdout), _job_id(r.stdout)
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/accuracy"] >= 0.90
    _assert_tags(run, job_id)
    res = read_result(job)
    assert res["status"] == "FINISHED" and len(res["finals"]) == 4 and not res.get("deaths")
    _assert_two_nodes(job, cluster)
    _assert_records(records)
    assert [e["groups"] for e in read_events(job) if e.get("event") == "node_groups"] == [{"0": [0, 1], "2": [2, 3]}]


@pytest.mark.timeout(360)
def test_losing_a_node_of_four_recovers(cluster, store):
    """Node loss with the default cluster=slurm (no --kill-on-bad-exit) and without max_failure: nccl keeps 2 survivors (>= 2), so the
    run recovers as on one node: the survivors on node 0 regroup (a new Gloo group) and train the dead ranks'
    work; the run finishes. The two deaths reach the coordinator a little apart: the survivors told to form a
    group with rank 2 in it wait for its members at the store (reading control), so the next generation's
    regroup ends that wait (before, they sat ~100 s in Gloo's init and the run failed)."""
    args = _overrides(store, "mode=nccl_cadence")  # the default srun_args: the fault rules decide
    rc, text, job, _ = _run_and_lose_node1(store, args, "node_recover")
    # the run FINISHED; the CLI's own exit code is 0 (the dead tasks' errors are only recorded)
    assert rc == 0, f"exit {rc}\n{text[-4000:]}"
    res = read_result(job)
    assert res["status"] == "FINISHED" and sorted(d["rank"] for d in res["deaths"]) == [2, 3]
    assert res["regroups"] >= 1 and res["final_eval"]["eval/accuracy"] >= 0.90
    assert sorted(int(r) for r in res["finals"]) == [0, 1] and len({f["hash"] for f in res["finals"].values()}) == 1
    run = MlflowClient(store["uri"]).get_run(run_id_of(text))
    assert run.info.status == "FINISHED" and "death.rank2" in run.data.tags and "death.rank3" in run.data.tags
    assert run.data.metrics["alive_ranks"] == 2


@pytest.mark.timeout(420)
def test_losing_a_node_saves_a_bundle_that_resumes(cluster, store):
    """Node loss: SIGKILL both rank processes of node 1 (the pids the run's events name, checked to live in
    node 1's namespace). Two dead ranks exceed cluster.max_failure=1, so the coordinator has the survivors on
    node 0 save a bundle (ShutdownWithSave, save_reason=max_failure_exceeded) and ends the run FAILED, as on
    one node (tests/test_e2e_faults.py); a run resumed from that bundle on both nodes finishes.

    The default cluster.slurm.srun_args (no --kill-on-bad-exit): the step outlives the dead tasks and the
    fault rules decide. (With it, srun's SIGTERM to the whole step races the coordinator's death detection; on
    this busy 2-core machine SIGTERM was seen to win, and the run then ends FAILED without the bundle's meta.)

    Every rank waits at its first batch on a gate until the test opened it: the kill lands in a run that
    has started training and cannot have ended, however fast or slow the machine."""
    args = _overrides(store, "mode=nccl_cadence", "cluster.max_failure=1")
    rc, text, job, _ = _run_and_lose_node1(store, args, "node_loss")
    assert rc == 1, f"exit {rc}\n{text[-4000:]}"

    c = MlflowClient(store["uri"])
    run = c.get_run(run_id_of(text))
    assert run.info.status == "FAILED"
    assert run.data.tags["save_reason"] == "max_failure_exceeded", run.data.tags
    res = read_result(job)
    assert res["status"] == "FAILED" and sorted(d["rank"] for d in res["deaths"]) == [2, 3]
    stem = res["saved_stem"]
    meta = json.loads(Path(stem + ".meta.json").read_text())
    assert meta["save_reason"] == "max_failure_exceeded" and meta["world_size_at_save"] == 4
    # the survivors' pieces, written on node 0: the model, the callback rank's optimizer, the other survivor's
    assert Path(stem + ".pt").exists() and Path(stem + ".optim.pt").exists()
    assert [r for r in range(4) if Path(f"{stem}.optim.r{r}.pt").exists()] == [1]

    t1 = time.monotonic()
    r2 = run_cli(_overrides(store, "mode=nccl_cadence", f"checkpoint.resume_from={stem}"), timeout=280)
    _ok(r2)
    print(f"[{TAG}] resume 2x2 from the node-loss bundle: {time.monotonic() - t1:.1f}s", file=sys.stderr)
    job2 = job_dir_of(r2.stdout)
    res2 = read_result(job2)
    assert res2["status"] == "FINISHED" and res2["resumed_from"] == stem
    run2 = c.get_run(run_id_of(r2.stdout))
    assert run2.info.status == "FINISHED" and run2.data.tags["resumed_from"] == stem
    assert run2.data.metrics["eval/accuracy"] >= 0.90
    _assert_two_nodes(job2, cluster)


def _node_state(node: str) -> str:
    """slurmctld's state of ``node`` (``idle``, ``mixed``, ``down*``, ...)."""
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=20).stdout.strip()


def _job_state(job_id: str) -> tuple[str, str]:
    """(state, node list) of a job in squeue, ("", "") once it left."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %N"], capture_output=True, text=True, timeout=20).stdout.split()
    return (out[0], out[1] if len(out) > 1 else "") if out else ("", "")


@pytest.mark.timeout(480)
def test_a_failed_node_leaves_the_job_to_the_fault_rules(cluster, store):
    """A node failure as SLURM sees one, with the default ``cluster.slurm.no_kill`` (``--no-kill`` to sbatch and
    srun): tests/slurm/fail_node.sh takes node 1's link down and SIGKILLs everything in it (slurmd, slurmstepd,
    ranks 2 and 3), as a power loss. While the survivors still wait at their gate, slurmctld marks node 1 DOWN
    on its own (its slurmd silent for SlurmdTimeout) and the job stays RUNNING, shrunk to node 0, with ranks 0
    and 1 alive: without ``--no-kill`` slurmctld cancels the whole job at that moment (NODE_FAIL), and with it
    on sbatch only srun still force-terminates the step (both measured, jobs/executor.py). Then the gate opens
    and the fault rules recover as after a process kill: the two silent ranks are declared dead (no heartbeat),
    the survivors regroup and finish. The node is brought back afterwards (up.sh)."""
    args = _overrides(store, "mode=nccl_cadence", "cluster.heartbeat_timeout_s=10")
    held: dict[str, object] = {}

    def fail_node1(victims: list[int]) -> None:
        rc, out, _ = _script("fail_node.sh", 60, NODE1)
        assert rc == 0, f"fail_node.sh {NODE1} (rc={rc}):\n{out}"

    def slurm_keeps_the_job(job_id: str, joined: dict[int, dict]) -> None:
        _wait_for(lambda: _node_state(NODE1).startswith("down"), 150, f"slurmctld to mark {NODE1} DOWN", every=1.0)
        # the node is DOWN and its tasks gone; the job is not cancelled: it keeps running on node 0
        _wait_for(lambda: _job_state(job_id) == ("RUNNING", NODE0), 60, f"job {job_id} to run on {NODE0} alone")
        held["survivors_alive"] = all(alive(joined[r]["pid"]) for r in (0, 1))
        held["node1"] = _node_state(NODE1)

    try:
        rc, text, job, victims = _run_and_lose_node1(store, args, "node_fail", lose=fail_node1,
                                                     while_gated=slurm_keeps_the_job)
        assert held["survivors_alive"] is True, held
        assert str(held["node1"]).startswith("down"), held
        script = next((job / "submitit").glob("*_submission.sh")).read_text()
        assert "#SBATCH --no-kill" in script and " --no-kill " in next(x for x in script.splitlines() if x.startswith("srun "))
        assert rc == 0, f"exit {rc}\n{text[-4000:]}"
        res = read_result(job)
        assert res["status"] == "FINISHED" and sorted(d["rank"] for d in res["deaths"]) == [2, 3], res.get("deaths")
        assert all("heartbeat" in d["reason"] for d in res["deaths"]), res["deaths"]
        assert res["regroups"] >= 1 and res["final_eval"]["eval/accuracy"] >= 0.90
        assert sorted(int(r) for r in res["finals"]) == [0, 1] and len({f["hash"] for f in res["finals"].values()}) == 1
        run = MlflowClient(store["uri"]).get_run(run_id_of(text))
        assert run.info.status == "FINISHED" and run.data.metrics["alive_ranks"] == 2
    finally:  # node 1 back for whatever runs next (up.sh restarts its slurmd; ReturnToService=2 resumes it)
        rc_up, out_up, _ = _script("up.sh", UP_TIMEOUT_S)
        assert rc_up == 0, f"up.sh could not bring {NODE1} back (rc={rc_up}):\n{out_up[-3000:]}"
        _wait_for(lambda: _node_state(NODE1) in ("idle", "mixed", "allocated"), 60, f"{NODE1} back in service")


def _job_dir_in(path: Path):
    try:
        return job_dir_of(path.read_text())
    except AssertionError:
        return None


def _job_id_in(path: Path):
    try:
        return _job_id(path.read_text())
    except AssertionError:
        return None


def _kill_ranks(victims: list[int]) -> None:
    """The rank processes only: SLURM's node stays up (its slurmd answers), the fault rules see two deaths."""
    for pid in victims:
        os.kill(pid, signal.SIGKILL)


def _run_and_lose_node1(store: dict, args: list[str], name: str, lose: Callable[[list[int]], None] = _kill_ranks,
                        while_gated: Optional[Callable[[str, dict[int, dict]], None]] = None) -> tuple[int, str, Path, list[int]]:
    """Run the CLI (run.wait=true) in the background with every rank gated at its first batch; once all four
    wait there, lose node 1 (``lose(pids of ranks 2 and 3)``: by default SIGKILL those rank processes), call
    ``while_gated(job id, joined events)`` while the survivors still wait, then open the gate.
    Returns (exit code, output, job, the lost ranks' pids)."""
    gate = Path(store["dir"]) / f"mn_{name}.gate"
    fault = ",".join(f"{r}:1:gate:{gate}" for r in range(4))
    out_path = Path(store["dir"]) / f"mn_{name}.out"
    env = dict(os.environ, FLODL_FAULT_INJECT=fault)
    t0 = time.monotonic()
    with open(out_path, "w+") as out:
        # run.wait=true: the CLI waits for the job and ends the MLflow run, as a user's would
        proc = subprocess.Popen([sys.executable, "-m", "flodl_exp", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            try:
                job = _wait_for(lambda: _job_dir_in(out_path), 90, "the job folder in the CLI's output")
                job_id = _wait_for(lambda: _job_id_in(out_path), 90, "the job id in the CLI's output")
                logs = job / "submitit"

                def gated() -> bool:  # every task logged "gated at step 1" (it trained one batch and waits)
                    return all("gated at step 1" in (p.read_text(errors="replace") if p.exists() else "")
                               for p in (logs / f"{job_id}_{t}_log.err" for t in range(4)))

                _wait_for(gated, 200, "all four ranks at their gate")
                joined = _joined(job)
                assert sorted(joined) == [0, 1, 2, 3]
                assert not any(e.get("event") == "end" for e in read_events(job))
                victims = [joined[r]["pid"] for r in (2, 3)]
                assert all(joined[r]["host"] == NODE1 for r in (2, 3))
                node1_ns = os.stat(f"/run/netns/{NODE1}").st_ino
                assert all(_netns_inode(p) == node1_ns for p in victims), "node 1's rank processes live in its namespace"
                assert _netns_inode(joined[0]["pid"]) != node1_ns
                t_kill = time.monotonic()
                lose(victims)
                if while_gated is not None:
                    while_gated(job_id, joined)
            finally:
                gate.touch()
            rc = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        out.seek(0)
        text = out.read()
    print(f"\n[{TAG}] {name}: node 1 lost {t_kill - t0:.0f}s after the submission, the CLI returned "
          f"{time.monotonic() - t_kill:.1f}s later", file=sys.stderr)
    assert not any(alive(p) for p in victims)
    _wait_for(lambda: job_id not in _squeue(), 60, f"job {job_id} to leave squeue")
    return rc, text, job, victims
