"""Shared fixtures: the repo root, one MLflow store per session, config composition and CLI runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> dict:
    """One SQLite MLflow store and job root for the whole session (creating a store costs ~4 s)."""
    d = tmp_path_factory.mktemp("store")
    return {"dir": d, "uri": f"sqlite:///{d}/mlflow.db", "jobs": str(d / "jobs")}


@pytest.fixture
def master_store():
    """A loopback TCPStore master for in-process process groups (one rank); any group left is destroyed."""
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s
    if dist.is_initialized():
        dist.destroy_process_group()


def base_overrides(store: dict, experiment: str = "e2e") -> list[str]:
    # tracking.log_model=false: the MLflow model export (seconds of torch.export per run) is proven by
    # test_single_rank_run_logs_to_mlflow; tracking.predict=false: the simulator's prediction (an import of torch in
    # the launching process) is proven by test_e2e_timeline's run; the other runs test other things
    return [f"tracking.uri={store['uri']}", f"tracking.experiment_name={experiment}", f"run.job_root={store['jobs']}",
            "run.progress=plain", f"hydra.run.dir={store['dir']}/hydra/${{now:%H-%M-%S-%f}}", "run.timeout_min=10",
            "tracking.log_model=false", "tracking.predict=false"]


def compose(overrides: list[str]):
    """The app's config for ``overrides``, composed with Hydra's compose API (as the CLI would)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from flodl_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hcompose("config", overrides=[o for o in overrides if not o.startswith("hydra.")])


def run_cli(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "flodl_exp", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=e)


class CliProcess:
    """The CLI in a process of its own, its stdout and stderr read into lists as lines come: a test waits for a
    line (the run's folder, "queued"), acts (opens a gate, sends a signal), then waits for the exit."""

    def __init__(self, args: list[str], env: dict | None = None, **popen: Any) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "flodl_exp", *args], cwd=ROOT, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, **popen)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=lambda s=s, buf=buf: buf.extend(s), daemon=True)
                         for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def output(self, timeout: float = 10.0) -> tuple[str, str]:
        """stdout and stderr whole, once the process has exited (its pipes closed)."""
        for t in self._readers:
            t.join(timeout)
        return "".join(self.out), "".join(self.err)


def job_dir_of(out: str) -> Path:
    for line in out.splitlines():
        if line.startswith("MLflow run ") and " folder " in line:
            return Path(line.split(" folder ", 1)[1].strip())
    raise AssertionError(f"no job folder in output:\n{out}")


def run_id_of(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("MLflow run "):
            return line.split()[2]
    raise AssertionError(f"no run id in output:\n{out}")


def read_result(job_dir: Path) -> dict:
    return json.loads((job_dir / "result.json").read_text())


def read_events(job_dir: Path) -> list[dict]:
    p = job_dir / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def pids_of(job_dir: Path) -> list[int]:
    """Every process the run started that we can name: the coordinator and each rank."""
    pids = [e["pid"] for e in read_events(job_dir) if e.get("event") == "joined" and e.get("pid")]
    rdv = job_dir / "rendezvous.json"
    if rdv.exists():
        pids.append(json.loads(rdv.read_text())["pid"])
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_exact_coverage(result: dict, batch_size: int) -> None:
    """Every pick of the batch-aligned epoch range trained exactly once, every epoch."""
    total = (result["total_picks"] // batch_size) * batch_size
    assert len(result["coverage"]) == result["epochs"]
    for e, ranges in result["coverage"].items():
        hits = [0] * total
        for off, size in ranges:
            for i in range(off, off + size):
                hits[i] += 1
        assert all(h == 1 for h in hits), f"epoch {e}: picks trained {sorted(set(hits))} times"


def launch_run(store: dict, experiment: str, *overrides: str):
    """Launch in-process (flodl_exp.launch) with the session store; returns the RunHandle."""
    from flodl_exp.jobs.launcher import launch

    return launch(compose([*base_overrides(store, experiment), *overrides]))


def run_spawned(target, args: list[tuple], timeout: float = 120.0) -> tuple[list, list]:
    """Run ``target(*a, q)`` in one spawned process per ``a``; returns (what each put on ``q``, exit codes).
    Every process is joined (killed past a deadline), whatever happens."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got, [p.exitcode for p in procs]


def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# -- a real single-node SLURM for the slurm-marked modules -------------------------------------
SLURM_SCRIPTS = ROOT / "tests" / "slurm"
SLURM_STATE_DIR = Path(os.environ.get("FLODL_SLURM_DIR") or "/tmp/flodl-slurm")
SLURM_UP_TIMEOUT_S = 540  # cold: apt-get install (~15-30 s) + bring-up (~3 s)


def _slurm_script(name: str, timeout: float) -> tuple[int, str, float]:
    """Run tests/slurm/<name>; output goes to a file, not a pipe: daemons must not hold it open."""
    import tempfile
    import time

    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            rc = subprocess.run(["bash", str(SLURM_SCRIPTS / name), str(SLURM_STATE_DIR)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        return rc, out.read(), time.monotonic() - t0


def _skip_loudly(tag: str, reason: str) -> None:
    import warnings

    msg = f"SLURM tests skipped: {reason}"
    print(f"\n[{tag}] {msg}", file=sys.stderr, flush=True)
    warnings.warn(msg, stacklevel=2)  # shows in the warnings summary even without -s
    pytest.skip(msg)


@__import__("contextlib").contextmanager
def slurm_cluster_up(tag: str):
    """Bring the test cluster up (tests/slurm/up.sh), export SLURM_CONF, and stop it afterwards.

    Skips, loudly, only where SLURM cannot run at all (not root, packages not installable).
    ``FLODL_SLURM_KEEP=1`` leaves the cluster up.
    """
    if os.name != "posix" or os.geteuid() != 0:
        _skip_loudly(tag, "not root (up.sh starts munged/mariadbd/slurm daemons and may apt-get install)")
    rc, out, dt = _slurm_script("up.sh", SLURM_UP_TIMEOUT_S)
    if rc in (2, 3):  # 2: not root, 3: packages missing and apt-get could not install them
        _skip_loudly(tag, f"up.sh could not install/find slurm (rc={rc}):\n{out[-3000:]}")
    if rc != 0:
        pytest.fail(f"tests/slurm/up.sh failed (rc={rc}) after {dt:.1f}s:\n{out[-6000:]}")
    print(f"\n[{tag}] up.sh: {dt:.1f}s", file=sys.stderr, flush=True)
    conf = str(SLURM_STATE_DIR / "slurm.conf")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # submitit's sbatch calls and run_cli's children inherit it
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if os.environ.get("FLODL_SLURM_KEEP") == "1":
            print(f"[{tag}] FLODL_SLURM_KEEP=1: cluster left up", file=sys.stderr)
        else:
            rc, out, dt = _slurm_script("down.sh", 120)
            print(f"[{tag}] down.sh: {dt:.1f}s (rc={rc})", file=sys.stderr, flush=True)
            if rc != 0:
                print(out, file=sys.stderr)
