"""The job function every submitit task runs (local processes or SLURM tasks alike).

Task 0 first starts the coordinator as its own process (which dies with the
task: PR_SET_PDEATHSIG), then every task waits for rendezvous.json and runs
its rank. Kept import-light: torch is imported inside, after the thread
environment is set.

Preemption and time limits (submitit's checkpoint/requeue): the submitted
callable is :data:`run_task`, a ``submitit.helpers.Checkpointable``. SLURM sends
``USR2`` to every process of the step ``signal_delay_s`` before the limit (or on
preemption); submitit's handler runs only in task 0 (global rank 0; the other
tasks log and carry on) and calls :meth:`RunTask.checkpoint`, which

1. sends ``SIGUSR1`` to the coordinator, which saves a bundle at the next reduce
   (coverage-granular in progressive modes), writes ``preempted.json``, tells the
   ranks to stop and exits with :data:`PREEMPT_EXIT` (status PREEMPTED, MLflow
   run left RUNNING);
2. writes ``spec.attempt<k>.json`` = the spec resuming from that bundle, same
   run id and job folder, ``attempt`` + 1;
3. returns ``DelayedSubmission(run_task, <that spec>)``: submitit pickles it over
   the job's submitted pickle and runs ``scontrol requeue``; the requeued job
   starts every task on the new spec and the run continues in the same MLflow run.

Because the handler runs in task 0's main thread and blocks until the bundle is
written, task 0 trains rank 0 on a worker thread: the save needs rank 0. The
other tasks leave without a result after a preempted stop (exit 0, so
``--kill-on-bad-exit`` does not fire before task 0 has requeued).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import submitit

from flodl_exp.config import ClusterConfig, load_cluster
from flodl_exp.constants import COORDINATOR_LOG, FAULT_ENV, JOB_DIR_ENV, LOST_GRACE_S, PREEMPT_EXIT, PREEMPT_MARK, RANK_ENV
from flodl_exp.job_spec import JobSpec
from flodl_exp.jobs.collective_store import bind_store_socket, needs_store, serve_store
from flodl_exp.jobs.executor import restore_visible_devices

PREEMPT_WAIT_S = 120.0
"""How long task 0 waits for the coordinator's preemption bundle before giving up."""
COORD_EXIT_WAIT_S = 120.0

log = logging.getLogger("flodl_exp.job")


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _routable_address(peers: list[str]) -> Optional[str]:
    """This node's address on the route to another node of the job (UDP connect: sends nothing)."""
    for peer in peers:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer, 9))
                addr = s.getsockname()[0]
                if not addr.startswith("127."):
                    return addr
        except OSError:
            continue
    return None


def _own_address(name: str) -> Optional[str]:
    """The first non-loopback IPv4 address ``name`` resolves to (None: unresolvable or loopback only)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    for ai in infos:
        addr = str(ai[4][0])
        if not addr.startswith("127."):
            return addr
    return None


def _peer_hosts() -> list[str]:
    """The other nodes of this SLURM job (host names), from submitit's job environment ([] outside a job)."""
    try:
        me = submitit.JobEnvironment()
        mine = {socket.gethostname(), me.hostname}
        return [h for h in me.hostnames if h not in mine]
    except Exception:
        return []


def coordinator_host(cluster: ClusterConfig) -> str:
    """The address the coordinator binds and advertises in rendezvous.json.

    ``cluster.host`` when set; 127.0.0.1 locally; on one SLURM node the node's host name. When the
    job spans nodes, an IP address the other nodes reach, so no rank depends on resolving task 0's
    host name the way task 0 does (Debian maps a host's own name to ``127.0.1.1``): this node's
    address on the route to the other nodes of the job, else the non-loopback address its host
    name resolves to, else (with a warning) the host name.
    """
    if cluster.host:
        return str(cluster.host)
    if cluster.executor == "local":
        return "127.0.0.1"
    name = socket.gethostname()
    if cluster.nodes > 1:
        addr = _routable_address(_peer_hosts()) or _own_address(name)
        if addr:
            return addr
        log.warning("no routable address for host %s (its name resolves to loopback or not at all, and no other "
                    "node of the job resolves): ranks on other nodes may not reach the coordinator (set cluster.host)",
                    name)
    return name


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def _interface_of(addr: str) -> Optional[str]:
    """The network interface holding the IPv4 address ``addr`` (Linux; None when unknown)."""
    try:
        import fcntl
        import struct

        names = [n for _, n in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return None
    for name in names:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
        except OSError:
            continue
    return None


def gloo_interface(cluster: Any, env: Any, hostname: Optional[str] = None) -> Optional[str]:
    """Set ``GLOO_SOCKET_IFNAME`` for a multi-node job where Gloo would pick loopback; returns what it set.

    Gloo advertises the address its host name resolves to (loopback when it resolves to ``127.0.1.1``
    or not at all), and peers on other nodes then cannot connect: the cross-node all_reduce of the
    ``nccl_*`` modes on CPU (and any Gloo group) fails. Then the interface on the route to the other
    nodes is chosen. A user's ``GLOO_SOCKET_IFNAME``, one node, or a host name with a routable
    address leave it alone.
    """
    if cluster.executor != "slurm" or int(cluster.nodes) <= 1 or env.get(GLOO_IFNAME):
        return None
    name = hostname or socket.gethostname()
    if _own_address(name) is not None:
        return None
    addr = _routable_address(_peer_hosts())
    ifname = _interface_of(addr) if addr else None
    if ifname is None:
        log.warning("host name %s resolves to loopback (or not at all) and no interface towards the other nodes was "
                    "found: Gloo may not connect across nodes (export GLOO_SOCKET_IFNAME)", name)
        return None
    env[GLOO_IFNAME] = ifname
    log.info("host name %s resolves to loopback: %s=%s (address %s, towards the other nodes)", name, GLOO_IFNAME,
             ifname, addr)
    return ifname


def spawn_coordinator(spec_path: str, host: str, store_port: Optional[int] = None) -> subprocess.Popen:
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    log_fh = open(os.path.join(job_dir, COORDINATOR_LOG), "ab")
    store_arg = [] if store_port is None else [str(store_port)]
    return subprocess.Popen([sys.executable, "-m", "flodl_exp.coordinator.main", spec_path, host, *store_arg],
                            stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            return b"".join(fh.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def preempt_mark(job_dir: str, attempt: int) -> Optional[dict]:
    """The coordinator's preemption record for this incarnation, if it wrote one."""
    mark = _read_json(os.path.join(job_dir, PREEMPT_MARK))
    return mark if mark is not None and int(mark.get("attempt", -1)) == int(attempt) else None


def fail_run_if_running(tracking_uri: str, run_id: str, error: str, tags: Optional[dict[str, Any]] = None) -> None:
    """End the MLflow run FAILED with ``error`` unless someone (the coordinator) already ended it.
    ``tracking_uri``: the spec's (redacted: the credentials come from the environment) or the launcher's own."""
    try:
        from flodl_exp.tracking import client

        c = client(tracking_uri)
        if c.get_run(run_id).info.status not in ("RUNNING", "SCHEDULED"):
            return
        c.set_tag(run_id, "error", error[:5000])
        for k, v in (tags or {}).items():
            c.set_tag(run_id, k, str(v))
        c.set_terminated(run_id, status="FAILED")
    except Exception as e:  # the store must not hide the job's own error
        log.warning("could not mark the MLflow run FAILED: %s", e)


def _fail_run(spec: JobSpec, error: str, tags: Optional[dict[str, Any]] = None) -> None:
    """:func:`fail_run_if_running` on the spec's run, its id read from the job folder where the submitted spec has
    none yet (the launcher creates the run after submitting: :meth:`JobSpec.with_run_id`)."""
    from flodl_exp.job_spec import RunIdMissing

    try:
        spec = spec.with_run_id(RUN_ID_FAIL_WAIT_S)
    except RunIdMissing as e:
        log.warning("could not mark the MLflow run FAILED: %s", e)
        return
    fail_run_if_running(spec.tracking_uri, spec.run_id, error, tags)


RUN_ID_FAIL_WAIT_S = 30.0
"""How long a failing task 0 waits for the launcher's run id before it gives up marking the run FAILED."""


class _RunEnded(BaseException):
    """Raised out of the signal handler when the run finished while the signal was handled."""


def add_import_paths(spec: JobSpec) -> None:
    """Make the launch directory importable here: experiment modules (``flodl_exp.zoo.digits``, a
    user's ``my_task``) are found from where the user launched, not installed into site-packages."""
    for path in reversed(spec.import_paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def _wait_rank0(worker: threading.Thread, coord: subprocess.Popen, spec: JobSpec, job_dir: str, attempt: int) -> None:
    """Task 0's main thread while rank 0 trains: wait for it, and leave it behind when it outlives the coordinator
    by LOST_GRACE_S. A USR2 that does not requeue (an exception from submitit's handler) fails the run."""
    try:
        coord_gone_at: Optional[float] = None
        while worker.is_alive():
            worker.join(0.2)
            if coord_gone_at is None and coord.poll() is not None:
                coord_gone_at = time.monotonic()
            if coord_gone_at is not None and time.monotonic() - coord_gone_at > LOST_GRACE_S:
                # rank 0 sits in a call that reads no control (a collective or a store wait on peers
                # that went with the coordinator): end the task without it, as the other ranks' readers do
                log.error("rank 0 did not stop within %.0fs of the coordinator's end: leaving it", LOST_GRACE_S)
                break
    except _RunEnded:
        worker.join()
    except (SystemExit, KeyboardInterrupt):  # SystemExit: submitit requeued the job
        raise
    except Exception as e:  # from submitit's USR2 handler: the job is not requeued
        mark = preempt_mark(job_dir, attempt)
        hint = f"; resume with checkpoint.resume_from={mark['stem']}" if mark else ""
        _fail_run(spec,
                            f"time limit / preemption: the job was not requeued ({e}){hint}", {"end_reason": "time_limit"})
        raise


def _reap(coord: subprocess.Popen) -> None:
    """Give the coordinator COORD_EXIT_WAIT_S to exit, then kill it."""
    deadline = time.monotonic() + COORD_EXIT_WAIT_S
    while coord.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if coord.poll() is None:
        coord.kill()
        coord.wait(10)


def _exit_text(rc: Optional[int]) -> str:
    """``exit code 3`` or ``exit code -9: killed by SIGKILL``."""
    if rc is not None and rc < 0:
        try:
            return f"exit code {rc}: killed by {signal.Signals(-rc).name}"
        except ValueError:
            pass
    return f"exit code {rc}"


def _task0_outcome(rc: Optional[int], box: dict[str, Any], spec: JobSpec, job_dir: str, attempt: int) -> dict:
    """Task 0's result from the coordinator's exit code and rank 0's (``box``: its result or its error)."""
    if rc not in (0, PREEMPT_EXIT):
        res = _read_json(os.path.join(job_dir, "result.json"))
        ended = res is not None and int(res.get("attempt", attempt)) == attempt and res.get("status") in ("FAILED", "KILLED")
        if not ended and isinstance(box.get("error"), RankSetupFailed):
            # rank 0 could not set up and the coordinator, still waiting for it, ended without a word: the rank's
            # line is the cause (a coordinator that ended the run itself says why first, below)
            _fail_run(spec, str(box["error"]))
            raise box["error"]
        if res is not None and int(res.get("attempt", attempt)) == attempt and res.get("status") in ("FAILED", "KILLED"):
            # The coordinator ended the run itself (it may then die from the cluster's SIGTERM on its way out).
            why = f"the run ended {res['status']}: {res.get('failure')}"
        else:
            why = f"coordinator failed ({_exit_text(rc)}):\n{_tail(os.path.join(job_dir, COORDINATOR_LOG))}"
            _fail_run(spec, why)
        if "error" in box:
            raise RuntimeError(f"{why}\nrank 0: {type(box['error']).__name__}: {box['error']}") from box["error"]
        raise RuntimeError(why)
    if "error" in box:
        raise box["error"]
    if rc == PREEMPT_EXIT:  # preempted without task 0 asking (a USR1 sent by hand): no requeue
        why = ("the coordinator stopped for preemption but no requeue was asked: "
               f"resume with checkpoint.resume_from={(preempt_mark(job_dir, attempt) or {}).get('stem')}")
        _fail_run(spec, why, {"end_reason": "preempted"})
        raise RuntimeError(why)
    if "out" not in box:  # the coordinator ended the run; rank 0's thread was left in its cleanup
        return {"rank": 0, "left_running": True}
    return box["out"]


class RunTask(submitit.helpers.Checkpointable):
    """``run_task(spec_path)``: one task of the job (see the module doc). Picklable, stateless until called."""

    def __init__(self) -> None:
        self._live: Optional[dict[str, Any]] = None

    def __getstate__(self) -> dict:
        return {"_live": None}

    # -- the task ---------------------------------------------------------
    def __call__(self, spec_path: str) -> dict:
        env = submitit.JobEnvironment()
        rank, local_rank = env.global_rank, env.local_rank
        returned = _leave_fast_after_success(env)
        out = self._run(spec_path, env, rank, local_rank)
        returned.append(time.time())
        return out

    def _run(self, spec_path: str, env: Any, rank: int, local_rank: int) -> dict:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", stream=sys.stderr)
        spec = JobSpec.load(spec_path)
        job_dir = os.path.dirname(os.path.abspath(spec_path))
        attempt = spec.attempt
        add_import_paths(spec)
        cluster = load_cluster(spec.config["cluster"])
        restore_visible_devices(cluster.executor, spec.cuda_visible_devices, os.environ, local_rank)
        gloo_interface(cluster, os.environ)
        if cluster.device != "cuda":
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        if attempt:
            log.info("attempt %d (requeued): resuming from %s", attempt, spec.resume.stem if spec.resume else None)
        if rank != 0:
            try:
                out = _run_rank(spec, rank, local_rank, job_dir, attempt, None)
            except Exception as e:
                keep_rank_traceback(job_dir, rank, attempt, e)
                raise
            if preempt_mark(job_dir, attempt) is not None:
                # Preempted: task 0 requeues the job. Leave without a result (exit 0: no
                # --kill-on-bad-exit before the requeue; the requeued job writes the real one).
                log.info("rank %d stopped for preemption; task 0 requeues the job", rank)
                logging.shutdown()
                sys.exit(0)
            return out
        return self._task0(spec_path, spec, cluster, local_rank, job_dir, attempt)

    def _task0(self, spec_path: str, spec: JobSpec, cluster: ClusterConfig, local_rank: int, job_dir: str,
               attempt: int) -> dict:
        host = coordinator_host(cluster)
        store_sock = bind_store_socket(host) if needs_store(spec.config, cluster) else None
        coord = spawn_coordinator(spec_path, host, store_sock.getsockname()[1] if store_sock is not None else None)
        box: dict[str, Any] = {}

        def coord_dead() -> Optional[str]:
            if coord.poll() is not None:
                return f"exit code {coord.returncode}; log tail:\n{_tail(os.path.join(job_dir, COORDINATOR_LOG))}"
            return None

        def rank0() -> None:
            try:
                if store_sock is not None:  # torch.distributed loads here, as rank 0's torch would
                    try:
                        box["store"] = serve_store(store_sock)  # kept until the task returns
                    except Exception as e:  # rank 0's setup failed: its death record ends the run at once, naming it
                        raise _setup_failed(spec, 0, job_dir, attempt, e) from e
                box["out"] = _run_rank(spec, 0, local_rank, job_dir, attempt, coord_dead)
            except BaseException as e:  # handed to the main thread
                if isinstance(e, Exception):
                    keep_rank_traceback(job_dir, 0, attempt, e)
                box["error"] = e

        self._live = {"coord": coord, "spec": spec, "spec_path": spec_path, "job_dir": job_dir, "attempt": attempt,
                      "in_call": True}
        # Rank 0 trains on a thread: the main thread stays free for submitit's USR2 handler,
        # which blocks (checkpoint()) while rank 0 takes part in the preemption bundle.
        worker = threading.Thread(target=rank0, name="rank0", daemon=True)
        worker.start()
        try:
            _wait_rank0(worker, coord, spec, job_dir, attempt)
            self._live["in_call"] = False
        finally:
            _reap(coord)
        return _task0_outcome(coord.returncode, box, spec, job_dir, attempt)

    # -- submitit's checkpoint hook (task 0, inside its USR2 handler) -----
    # submitit declares checkpoint(*args, **kwargs) -> DelayedSubmission, but it calls it with the
    # task's own arguments and documents None as "do not requeue": its annotation is too narrow.
    def checkpoint(self, spec_path: str) -> Optional[submitit.helpers.DelayedSubmission]:  # type: ignore[override]
        live = self._live
        if live is None:  # the signal came before this task started: run again as submitted
            log.warning("preemption signal before the run started: requeueing as submitted")
            return submitit.helpers.DelayedSubmission(RunTask(), spec_path)
        coord: subprocess.Popen = live["coord"]
        spec: JobSpec = live["spec"]
        job_dir, attempt = live["job_dir"], live["attempt"]
        t0 = time.monotonic()
        if coord.poll() is None:
            log.warning("preemption / time-limit signal: asking the coordinator for a bundle")
            try:
                os.kill(coord.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        while coord.poll() is None and time.monotonic() - t0 < PREEMPT_WAIT_S:
            time.sleep(0.1)
        rc = coord.poll()
        if rc is None:
            coord.kill()
            _fail_run(spec,
                                f"time limit reached: no preemption bundle after {PREEMPT_WAIT_S:.0f}s",
                                {"end_reason": "time_limit"})
            return None  # submitit: "Job not requeued because: checkpoint function returned None"
        if rc == 0:
            log.info("the run finished while the preemption signal was handled: no requeue")
            if live.get("in_call"):
                raise _RunEnded()
            return None
        mark = preempt_mark(job_dir, attempt)
        if rc != PREEMPT_EXIT or mark is None:
            log.error("the coordinator ended with exit code %s instead of a preemption bundle", rc)
            _fail_run(spec,
                                f"time limit / preemption: the coordinator ended with exit code {rc} "
                                f"instead of a bundle:\n{_tail(os.path.join(job_dir, COORDINATOR_LOG))}",
                                {"end_reason": "time_limit"})
            return None
        return self._requeue_spec(live, mark, time.monotonic() - t0)

    def _requeue_spec(self, live: dict, mark: dict, waited_s: float) -> Optional[submitit.helpers.DelayedSubmission]:
        from flodl_exp.bundle_meta import Resume
        from flodl_exp.checkpoint import check_pieces, load_meta
        from flodl_exp.fsio import atomic_json
        from flodl_exp.job_spec import RunIdMissing

        spec: JobSpec = live["spec"]
        job_dir, attempt = live["job_dir"], live["attempt"]
        stem = str(mark["stem"])
        try:
            meta = load_meta(stem)
            bad = check_pieces(stem, meta)
        except ValueError as e:
            bad = str(e)
        if bad:  # never requeue onto a bundle that cannot resume
            why = f"time limit / preemption: the bundle {stem} cannot resume: {bad}"
            log.error("%s: not requeued", why)
            _fail_run(spec, why, {"end_reason": "bundle_failed"})
            return None
        try:  # the next attempt's spec carries the run id (read from the job folder when the submitted one had none)
            spec = spec.with_run_id(RUN_ID_FAIL_WAIT_S)
        except RunIdMissing as e:  # the next attempt's coordinator reads it from the job folder in turn
            log.warning("requeue: %s", e)
        nxt = spec.requeued(Resume(stem=stem, meta=meta))
        path = os.path.join(job_dir, f"spec.attempt{attempt + 1}.json")
        atomic_json(nxt.to_dict(), path, mode=0o600)
        for name, dest in (("result.json", f"result.attempt{attempt}.json"), ("rendezvous.json", None)):
            p = os.path.join(job_dir, name)
            try:
                os.replace(p, os.path.join(job_dir, dest)) if dest else os.unlink(p)
            except FileNotFoundError:
                pass
        log.warning("bundle %s written in %.1fs: requeueing as attempt %d", stem, waited_s, attempt + 1)
        return submitit.helpers.DelayedSubmission(RunTask(), path)


def _leave_fast_after_success(env: Any) -> list[float]:
    """In a task process that submitit's entry point runs (``python -m submitit.core._submit``, locally and under
    srun): once this task's callable returned and submitit pickled its success, the process ends without the
    interpreter's teardown of torch and the data plane's modules (a second or more on a loaded machine, which the
    job's end, and so the launcher, waits for). An ``atexit`` hook: it runs after every non-daemon thread ended and
    leaves with 0, the status submitit itself would return then; any other way out (an error, a requeue, a
    preempted rank's exit) keeps the normal exit and its status. Returns the list the call appends its return
    time to."""
    returned: list[float] = []
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main_spec, "name", None) != "submitit.core._submit":
        return returned  # called in-process (tests, a debugger): the caller's interpreter is not ours to end
    try:
        result_pickle = str(env.paths.result_pickle)
    except Exception:
        return returned

    def leave() -> None:
        if not returned or not submitit_succeeded(result_pickle, returned[-1]):
            return
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)

    atexit.register(leave)
    return returned


def submitit_succeeded(result_pickle: str, returned_at: float) -> bool:
    """submitit pickled ``("success", result)`` for the call that returned at ``returned_at`` (not an earlier
    attempt's pickle, nor the ``("error", ...)`` it writes when the result's dump fails).

    The pickle is never loaded: :func:`pickletools.genops` walks its opcodes without building any object, and the
    outcome is the first string in it (submitit writes the tuple's tag before the result)."""
    import pickletools

    try:
        if os.stat(result_pickle).st_mtime < returned_at - 1.0:
            return False
        with open(result_pickle, "rb") as fh:
            for op, arg, _ in pickletools.genops(fh):
                if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                    return arg == "success"
    except Exception:  # a truncated or foreign file: not a success we can see
        return False
    return False


def _run_rank(spec: JobSpec, rank: int, local_rank: int, job_dir: str, attempt: int,
              coord_dead: Optional[Callable[[], Optional[str]]]) -> dict:
    from flodl_exp.rank.fault_inject import CONNECT_STEP, inject_fault, parse_fault
    from flodl_exp.rendezvous import wait_rendezvous, write_rank_marker

    write_rank_marker(job_dir, rank, attempt)
    os.environ[RANK_ENV], os.environ[JOB_DIR_ENV] = str(rank), job_dir  # for user code (experiment.checkpoint_fn)
    fault = parse_fault(os.environ.get(FAULT_ENV), rank)
    if fault is not None and fault[0] == CONNECT_STEP:
        inject_fault(fault[1], rank, CONNECT_STEP)  # test hook: a rank lost during rendezvous
    timeout, since = load_cluster(spec.config["cluster"]).rendezvous_timeout_s, time.monotonic()

    def rdv() -> dict:  # the rank builds its replica and data set first, while the coordinator starts
        return wait_rendezvous(job_dir, timeout, coord_dead, attempt=attempt, since=since)

    from flodl_exp.rank.lazy_dynamo import defer_optimizer_dynamo

    defer_optimizer_dynamo()  # the optimizers import no torch._dynamo (1.3-1.8 s of CPU a rank) unless something compiles
    loop = spec.experiment_loop
    if loop:  # the cooperative tier: the user's loop drives the rank (rank/cooperative.py)
        from hydra.utils import get_method

        from flodl_exp.experiment import ExperimentSetupError
        from flodl_exp.rank.cooperative import RankContext, run_loop

        try:
            fn = get_method(loop)
        except Exception as e:
            raise _setup_failed(spec, rank, job_dir, attempt, ExperimentSetupError("experiment.loop", loop, e)) from e
        try:
            return run_loop(fn, RankContext(spec, rank, local_rank, rdv, owns_process=coord_dead is None))
        except ExperimentSetupError as e:  # flodl_exp.worker() in the user's loop could not build the experiment
            raise _setup_failed(spec, rank, job_dir, attempt, e) from e
    from flodl_exp.experiment import ExperimentSetupError
    from flodl_exp.rank.worker import RankWorker

    try:
        worker = RankWorker(spec, rank, local_rank, rdv, owns_process=coord_dead is None)
    except ExperimentSetupError as e:  # only the experiment's build: a rendezvous or link error keeps its own report
        raise _setup_failed(spec, rank, job_dir, attempt, e) from e
    return worker.run()


class RankSetupFailed(RuntimeError):
    """A rank could not set up (build its experiment, reach the coordinator): one line naming the rank, the config
    key and the cause, with where the full traceback is kept."""


def _setup_failed(spec: JobSpec, rank: int, job_dir: str, attempt: int, e: BaseException) -> RankSetupFailed:
    """Keep the full traceback in the job folder (``ranks/setup_error.r<rank>.txt``) and the rank's death record
    (the coordinator names the cause from it), and return the one-line error the task raises."""
    import traceback

    from flodl_exp.experiment import ExperimentSetupError, root_cause
    from flodl_exp.fsio import atomic_text
    from flodl_exp.rendezvous import write_death_record

    what = str(e) if isinstance(e, ExperimentSetupError) else root_cause(e)
    cause = e.cause if isinstance(e, ExperimentSetupError) else e
    if isinstance(cause, ImportError) or "ModuleNotFoundError" in what or "ImportError" in what:
        what += f" (the task imports from {', '.join(spec.import_paths) or '(no launch folder)'} and site-packages)"
    path = setup_error_path(job_dir, rank)
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_text(f"rank {rank} could not set up: {what}\n\n{tb}", path, mode=0o600)
        where = f" (full traceback: {path})"
    except OSError:
        where = ""
    write_death_record(job_dir, rank, 0, what, tb[-4000:], attempt=attempt, phase="setup")
    return RankSetupFailed(f"rank {rank} could not set up: {what}{where}")


def keep_rank_traceback(job_dir: str, rank: int, attempt: int, e: BaseException) -> Optional[str]:
    """The exception a rank's task ends with, kept for the one-line failure the launcher prints: its full traceback
    in ``ranks/rank<rank>.traceback`` and, in the rank's death record, the error in the user's terms (the user's
    exception and own innermost frame: flodl_exp/failure_cause.py). Returns the traceback file's path (None: not
    written). Never raises: the rank's own error is what its task reports."""
    import traceback

    from flodl_exp.failure_cause import user_error
    from flodl_exp.fsio import atomic_text
    from flodl_exp.rendezvous import note_user_error, rank_traceback_path

    try:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        path: Optional[str] = rank_traceback_path(job_dir, rank)
        try:
            os.makedirs(os.path.dirname(str(path)), exist_ok=True)
            atomic_text(f"rank {rank}: {type(e).__name__}: {e}\n\n{tb}", str(path), mode=0o600)
        except OSError:
            path = None
        told = user_error(e)
        note_user_error(job_dir, rank, attempt, told.error, told.frame, path, tb)
        return path
    except Exception as err:  # a report of a report: the task's error goes on as it is
        log.warning("rank %d: could not keep its traceback: %s", rank, err)
        return None


def setup_error_path(job_dir: str, rank: int) -> str:
    """Where a rank that could not set up keeps its full traceback."""
    return os.path.join(job_dir, "ranks", f"setup_error.r{rank}.txt")


run_task = RunTask()
"""The submitted callable: ``run_task(spec_path)``."""
