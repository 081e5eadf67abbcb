"""Averaging backends, rank side.

* :class:`CollectiveBackend` (``backend=nccl``): weighted in-place all_reduce
  over a torch.distributed process group formed through the job's TCPStore
  (task 0 hosts it); NCCL or Gloo as the coordinator chose for the whole cohort.
* :class:`CoordinatorBackend` (``backend=cpu``): the rank ships a snapshot to
  the coordinator and adopts the consensus it sends back (full overwrite, or
  the EASGD blend on cpu_async).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import nn

from flodl_exp.averaging import adopt, adopt_correction, float_buffers, mass, pack_into, unpack_from
from flodl_exp.protocol.messages import Snapshot, Update
from flodl_exp.store_names import group_prefix
from flodl_exp.torch_version import check_torch_version

log = logging.getLogger(__name__)

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_environment(env: MutableMapping[str, str]) -> list[str]:
    """Set what NCCL must see before its process group is created; returns a line to log for each user setting
    changed.

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, whatever was inherited: with 1 (common in DDP guides; sbatch passes the
      environment on) NCCL's watchdog tears the process down when a collective outlives the group's timeout,
      instead of our polling path raising :class:`CollectiveTimeout` and regrouping. torch reads this name
      after its deprecated alias ``NCCL_ASYNC_ERROR_HANDLING``, so setting it wins over both.
    * ``NCCL_SOCKET_IFNAME`` from ``GLOO_SOCKET_IFNAME`` when unset: the job pins Gloo's interface on multi-node
      runs (jobs/job.py) and NCCL's bootstrap needs the same routable interface; a user's own value is kept.
    """
    notes = []
    had = env.get(ASYNC_ERROR_HANDLING)
    if had is not None and had.strip() != "0":
        notes.append(f"{ASYNC_ERROR_HANDLING}={had} from the environment overridden to 0: a collective that outlives "
                     "cluster.collective_timeout_s raises in Python and the rank regroups, instead of NCCL's watchdog "
                     "ending the process")
    env[ASYNC_ERROR_HANDLING] = "0"
    if not env.get("NCCL_SOCKET_IFNAME") and env.get("GLOO_SOCKET_IFNAME"):
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"]
    return notes


_RETIRED: list[Any] = []
"""Gloo groups (and their pending work) given up on: kept for the life of the process (see :func:`retire`)."""


def retire(*objs: Any) -> None:
    """Keep ``objs`` alive until the process ends, without ever running their destructors.

    A Gloo group left with a collective pending on a peer that is alive but gave up on it (it saw a dead
    member and moved on) cannot be torn down: both ``abort`` and its destructor wait for that collective,
    which ends only at the group's timeout (``collective_timeout_s`` + 60 s). Seen: of two survivors of a
    three-rank group, the one whose all_reduce was still pending sat in ``abort`` past 2 minutes. The
    group is not needed any more, so it is kept, with an extra reference that interpreter teardown never
    drops: its threads and sockets go with the process.
    """
    for o in objs:
        if o is None:
            continue
        _RETIRED.append(o)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


def _divergence(pre: torch.Tensor, post: torch.Tensor) -> tuple[float, float, float]:
    """``averaging.divergence`` over the sync's own buffers: no flat copy, one host read. ``post`` (the averaged
    slice of the all-reduce buffer, free once the replica took it) is overwritten with ``post - pre``."""
    post_n = torch.linalg.vector_norm(post)
    pre_n = torch.linalg.vector_norm(pre)
    delta = torch.linalg.vector_norm(post.sub_(pre))
    post_f, pre_f, delta_f = torch.stack([post_n, pre_n, delta]).tolist()
    return (delta_f / post_f if post_f > 1e-10 else 0.0), post_f, pre_f


FAST_POLL_S = 2e-4
"""The longest pause between checks of a pending collective during its first :data:`FAST_POLL_FOR_S`."""
FAST_POLL_FOR_S = 0.025
"""How long a pending collective is checked often; after that, every 5 ms (a peer is slower: no CPU burnt)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited ``cluster.collective_timeout_s`` for its peers."""


class CollectiveInterrupted(RuntimeError):
    """The control channel ended the wait (a regroup or shutdown arrived while a collective was pending)."""


class LockstepMisaligned(RuntimeError):
    """A reduce found some of the group's members in a lockstep reduce (``mode.lockstep_ahead``) and others in a paced
    one (a sync_now's): they cannot be told apart into one reduce. Every member sees the same head and raises this
    together. (Members that are all in lockstep but at different versions re-align instead: see ``sync``.)"""


HEAD_SLOTS = 3
"""Floats appended to the sync's flat buffer: [mass, moved (0/1), in a lockstep reduce (0/1)], summed with it.
float32 sums them exactly for counts (2^24 ranks) and to float32's precision for masses."""


def lockstep_aligned(flags: float, version_sum: float, version_sq_sum: float, world_size: int) -> bool:
    """From the summed head: no member in lockstep, or every member in lockstep at one version (the sum of squares
    equals the square of the sum over W only when every version is the same). Every member decides alike."""
    if flags == 0:
        return True
    return flags == world_size and version_sum * version_sum == world_size * version_sq_sum


class CollectiveBackend:
    """Weighted all_reduce: each rank scales by its own mass ``n^gamma``, sums, divides by the total.

    One all_reduce a sync: the scaled replica with a head appended (this rank's mass, whether it moved, whether
    it is in a lockstep reduce: :data:`HEAD_SLOTS` floats), so the total mass, the movers and the lockstep flags
    arrive with the sum. A zero total (whole cohort idle) leaves every replica as it was, on every rank alike.
    Float buffers are averaged equally among movers. (The head was a collective of its own before the sum: one
    more round trip on every sync, ~120 us on Gloo over loopback, most of ``nccl_sync``'s gap to DDP.)

    ``backend`` is the cohort's (the coordinator chose it from every rank's hello,
    devices.py): NCCL reduces on the rank's GPU; Gloo reduces on the host (a
    CUDA replica is staged through CPU tensors), which is how ranks sharing a GPU or a
    mixed CPU/GPU cohort average.

    Collectives are issued with ``async_op=True`` and waited for by polling
    ``work.is_completed()`` with this process's own deadline (``op_timeout_s``), calling
    ``poll`` between checks: the rank keeps reading its control channel, so a regroup
    or a shutdown that arrives mid-collective ends the wait (``poll`` raises), and a
    slow peer raises :class:`CollectiveTimeout` in Python instead of NCCL's watchdog
    aborting the process (its async error handling is turned off here, and the group's
    own timeout is set past ours). On any failure :meth:`abort` tears the group down
    without waiting for pending work (``destroy_process_group`` would hang on a dead peer).

    Gloo groups are standalone ``ProcessGroupGloo`` objects, one per generation, never the default
    group: a regroup makes a new one beside the old, and the old one, if a collective is still pending
    in it, is retired (:func:`retire`) instead of aborted, since Gloo's abort waits for that collective.
    NCCL uses the default group and aborts its communicators (that abort does not wait).
    """

    GROUP_TIMEOUT_MARGIN_S = 60.0
    """The process group's timeout is ours plus this, so our deadline always fires first."""

    def __init__(self, *, host: str, store_port: int, rank: int, world_size: int, device: torch.device,
                 backend: str, op_timeout_s: float, store_timeout_s: float,
                 poll: Callable[[], None] = lambda: None, generation: int = 0,
                 clock: Callable[[], float] = time.monotonic, token: str = "") -> None:
        import torch.distributed as dist

        if backend not in ("nccl", "gloo"):
            raise ValueError(f"collective backend {backend!r}: nccl or gloo")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the cohort chose NCCL but this rank trains on {device}")
        self.dist = dist
        self.device = device
        self.backend = backend
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        self.op_timeout_s = float(op_timeout_s)
        self.poll = poll
        self._clock = clock
        self.token = token  # the job token: keys the process groups' store prefixes (store_names.group_prefix)
        if backend == "nccl":
            # Errors and timeouts surface as Python exceptions on our polling path, never as a process abort
            # by the watchdog (torch: use _abort_process_group with async error handling turned off).
            for note in nccl_environment(os.environ):
                log.warning("rank %d: %s", rank, note)
        self.reduced = False
        """The last sync averaged (some rank moved): the outer optimizer steps only then."""
        self.realigned_to: Optional[int] = None
        """The last sync was a lockstep reduce whose members were at different versions: the furthest one."""
        self.group: Any = None
        """Gloo: this generation's standalone process group (NCCL: the default group, through ``dist``)."""
        self.pending: Any = None
        """The collective being waited for (retired with its group if the wait ends before it does); still set
        after a wait that failed, so :meth:`close` aborts instead of waiting in ``destroy_process_group``."""
        self._flat: Optional[torch.Tensor] = None
        """The sync's all-reduce buffer (float32, parameters then float buffers, on the rank's device), reused by
        every sync: allocated once by :meth:`prepare`, so a sync allocates nothing and the bytes are live when
        the data plane sizes its device pool."""
        self._saved: Optional[torch.Tensor] = None
        """The replica as it was when the sync began (same layout): the divergence's ``pre`` and what
        :meth:`restore` puts back after a failed collective."""
        self._host: Optional[torch.Tensor] = None
        """Gloo with a CUDA replica: the pinned host copy the collective reduces."""
        self._n_params = 0
        """How many of the buffers' floats are parameters (the float buffers follow them)."""
        self._current: Optional[torch.Tensor] = None
        """``mode.overlap``: the replica as it was when an overlapped all-reduce landed (same layout), allocated at the
        first one: what the rank trained since it sent is kept from it (:meth:`apply_correction`)."""
        self._overlapped: Optional[tuple[int, float]] = None
        """The overlapped all-reduce in flight: this rank's ``n`` and ``gamma`` (to launch it again after a regroup)."""
        self._correct_pending = False
        """:meth:`land_overlapped` kept the current replica: :meth:`apply_correction` adds what it trained since."""
        self._launched_at = 0.0
        """When the last all-reduce was started (:meth:`overlapped_overdue`)."""
        self.store = dist.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=store_timeout_s))
        self.timeout = timedelta(seconds=self.op_timeout_s + self.GROUP_TIMEOUT_MARGIN_S)
        self._init(generation, rank, world_size)

    def _init(self, generation: int, rank: int, world_size: int, session: str = "", arrive: bool = False) -> None:
        pstore = self.dist.PrefixStore(group_prefix(self.token, generation, session), self.store)
        if arrive:
            self._arrive(pstore, rank, world_size)
        # device_id (NCCL): the communicator binds this GPU eagerly, so a bad device setup fails here, at start-up.
        if self.backend == "gloo":
            self.group = self.dist.ProcessGroupGloo(pstore, rank, world_size, self.timeout)
        else:
            self.dist.init_process_group(self.backend, store=pstore, rank=rank, world_size=world_size, timeout=self.timeout,
                                         device_id=self.device)
        self.generation, self.rank, self.world_size = generation, rank, world_size

    def _arrive(self, pstore: Any, rank: int, world_size: int) -> None:
        """Wait for every member at the generation's store prefix, reading control between checks, before
        ``init_process_group`` (which blocks in C++ until the group's timeout when a member never comes).

        A node loss kills several ranks at once, and their deaths reach the coordinator a little apart: the
        survivors may be told to form a group that still names a rank dead since. Here the next regroup (or a
        shutdown) ends the wait at once (``poll`` raises), and the coordinator's request for a session id is
        answered meanwhile, so the group the survivors form is the one of the latest generation."""
        pstore.set(f"arrived/{rank}", b"1")
        keys = [f"arrived/{q}" for q in range(world_size)]
        deadline = self._clock() + self.op_timeout_s
        pause = 1e-3
        while not pstore.check(keys):
            self.poll()
            if self._clock() > deadline:
                raise CollectiveTimeout(f"forming the group waited {self.op_timeout_s:.0f}s for its members "
                                        "(cluster.collective_timeout_s)")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def rebuild(self, generation: int, rank: int, world_size: int, session: str = "") -> None:
        """Elastic regroup: abort the old group (a member is gone), form a new one on a fresh prefix of the same store."""
        self.abort()
        self._init(generation, rank, world_size, session, arrive=True)

    def _wait(self, work: Any, since: Optional[float] = None) -> None:
        """Wait for ``work``, reading control between checks; raises its error, a timeout, or what ``poll`` raises.
        ``since``: when it was started, if before now (the deadline runs from there)."""
        start = self._clock()
        deadline = (start if since is None else since) + self.op_timeout_s
        pause = 5e-5
        self.pending = work
        while not work.is_completed():
            self.poll()
            now = self._clock()
            if now > deadline:
                raise CollectiveTimeout(f"a collective waited {self.op_timeout_s:.0f}s for its peers "
                                        "(cluster.collective_timeout_s)")
            time.sleep(pause)
            # Short checks while the collective may be about to end (a parameter all_reduce takes a few ms: a
            # 3.2 ms nap after a 3 ms reduce doubled the sync), longer ones once it waits on a slower peer.
            pause = min(pause * 2, FAST_POLL_S if now - start < FAST_POLL_FOR_S else 0.005)
        work.wait()
        self.pending = None  # kept when wait() raised: the group holds a failed collective (see close)

    def _start_all_reduce(self, t: torch.Tensor, op: Any = None) -> Any:
        """Start summing ``t`` over the group in place (``op``: another reduction, e.g. ``ReduceOp.MAX``); its work."""
        if self.group is not None:
            if op is None:
                return self.group.allreduce([t])
            opts = self.dist.AllreduceOptions()
            opts.reduceOp = op
            return self.group.allreduce([t], opts)
        return self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM if op is None else op, async_op=True)

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> None:
        """Sum ``t`` over the group in place, waited for (see :meth:`_wait`)."""
        self._wait(self._start_all_reduce(t, op))

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        """``t`` from the group's rank ``src`` to every member, in place (waited for as the all_reduce is)."""
        comm = t if t.device == self.comm_device else t.to(self.comm_device)
        if self.group is not None:
            self._wait(self.group.broadcast(comm, src))
        else:
            self._wait(self.dist.broadcast(comm, src=src, async_op=True))
        if comm is not t:
            t.copy_(comm)

    def prepare(self, model: nn.Module) -> None:
        """Allocate the sync's buffers for ``model`` (2x its parameter and float-buffer count in float32 on its
        device, plus a pinned host copy for Gloo with a CUDA replica) unless they fit already. The rank calls it
        when the group forms, before the first chunk sizes the data plane's device pool."""
        self._n_params = sum(p.numel() for p in model.parameters())
        n = self._n_params + sum(b.numel() for b in float_buffers(model))
        if self._saved is not None and self._saved.numel() == n:
            return
        self._flat = self._saved = self._host = self._current = None  # the old ones go before the new ones come
        self._saved = torch.empty(n, dtype=torch.float32, device=self.device)
        self._comm_buffers()

    def _comm_buffers(self) -> None:
        """The all-reduce buffer (and, for Gloo with a CUDA replica, its pinned host copy) sized to the kept replica,
        each allocated where missing: at :meth:`prepare`, and after :meth:`abort` retired one."""
        assert self._saved is not None
        n = self._saved.numel() + HEAD_SLOTS
        if self._flat is None:
            self._flat = torch.empty(n, dtype=torch.float32, device=self.device)
        if self._host is None and self.comm_device != self.device:
            self._host = torch.empty(n, dtype=torch.float32, pin_memory=self.device.type == "cuda")

    @property
    def workspace(self) -> Optional[torch.Tensor]:
        """The all-reduce buffer, free once a sync returned: the outer optimizer's scratch (no allocation)."""
        return self._flat

    def restore(self, model: nn.Module) -> None:
        """Put the replica back as it was when the last sync began (after a failed collective)."""
        if self._saved is not None:
            with torch.no_grad():
                unpack_from(self._saved, list(model.parameters()) + float_buffers(model))

    def sync(self, model: nn.Module, n: int, gamma: float, with_divergence: bool = True,
             lockstep_version: Optional[int] = None) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """All-reduce the replica (weights ``n^gamma``); the divergence read-out (``d``, ``||post||``, ``||pre||``)
        when ``with_divergence``. ``lockstep_version``: this reduce's version when the rank started it on its own
        (a Lockstep license); the members check in the head that they are all in the same reduce."""
        self._keep_sent(model)
        self._wait(self._launch(n, gamma, lockstep=lockstep_version is not None))
        return self._land(model, with_divergence, lockstep_version, keep_current=False)

    # -- mode.overlap: the all-reduce runs while the rank trains on -------------------------------------
    def start_overlapped(self, model: nn.Module, n: int, gamma: float) -> None:
        """Launch the all-reduce of the replica as it is now and return at once: the rank trains on while it runs
        (Gloo's own threads, or NCCL's stream), and :meth:`land_overlapped` applies it. What was sent stays in the
        sync's buffer until then (one more replica, the trained-since copy, is kept when it lands)."""
        self._keep_sent(model)
        saved = self._saved
        assert saved is not None
        self._overlapped = (n, gamma)
        if self._current is None or self._current.numel() != saved.numel():
            self._current = None
            self._current = torch.empty_like(saved)
        self._launch(n, gamma, lockstep=False)

    def relaunch_overlapped(self) -> None:
        """The overlapped all-reduce again, in the group formed since it failed: the same replica as sent."""
        if self._overlapped is None:
            raise RuntimeError("no overlapped all-reduce to launch again")
        self._launch(*self._overlapped, lockstep=False)

    def overlapped_done(self) -> bool:
        """The overlapped all-reduce finished (with its sum or its error): :meth:`land_overlapped` will not wait."""
        return self.pending is None or bool(self.pending.is_completed())

    def overlapped_overdue(self) -> bool:
        """The overlapped all-reduce has run past ``cluster.collective_timeout_s`` (a peer that will never join it: the
        rank gives up on it as a waited sync would, though it trained all along)."""
        return self._clock() - self._launched_at > self.op_timeout_s

    def land_overlapped(self, model: nn.Module, with_divergence: bool, *,
                        keep_current: bool) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """Wait for the overlapped all-reduce (raises as :meth:`sync` does) and put the consensus in the replica, as
        :meth:`sync` does; the divergence is of what was sent. ``keep_current``: the rank trained since it sent:
        the replica as it is now is kept, and :meth:`apply_correction` (after the outer step, if any) makes it
        ``W + (W_avg - W_sent)``. Without it the consensus is adopted as is (bit-exact across the replicas)."""
        if self.pending is None:
            raise RuntimeError("no overlapped all-reduce in flight")
        self._wait(self.pending, since=self._launched_at)  # the deadline runs from the launch, not from this wait
        self._overlapped = None
        return self._land(model, with_divergence, None, keep_current=keep_current)

    def apply_correction(self, model: nn.Module) -> None:
        """After :meth:`land_overlapped` with ``keep_current`` (and the outer optimizer's step): the replica, which
        holds the new global ``G``, becomes what it was before the landing plus ``G - W_sent`` (parameters and float
        buffers), so every step trained while the all-reduce ran is kept. Nothing to do otherwise."""
        cur, saved = self._current, self._saved
        if not self._correct_pending or cur is None or saved is None:
            return
        self._correct_pending = False
        with torch.no_grad():
            cur.sub_(saved)
            off = 0
            for t in list(model.parameters()) + float_buffers(model):
                k = t.numel()
                t.add_(cur[off:off + k].view_as(t).to(t.dtype))
                off += k

    # -- the parts of a sync ---------------------------------------------------------------
    def _keep_sent(self, model: nn.Module) -> None:
        """The replica as the sync found it, in its buffer (before anything can fail: :meth:`restore` puts it back)."""
        self.prepare(model)
        assert self._saved is not None
        with torch.no_grad():
            pack_into(list(model.parameters()) + float_buffers(model), self._saved)

    def _launch(self, n: int, gamma: float, *, lockstep: bool) -> Any:
        """Fill the all-reduce buffer from the kept replica (parameters scaled by this rank's mass, its head appended)
        and start the all-reduce; returns its work (also :attr:`pending`)."""
        self._comm_buffers()  # one retired with a collective still writing into it (abort) is replaced
        flat, saved = self._flat, self._saved
        assert flat is not None and saved is not None
        m = mass(n, gamma)
        n_all = saved.numel()
        n_params = self._n_params
        with torch.no_grad():
            flat[:n_all].copy_(saved)
            flat[:n_params].mul_(m)
            if n <= 0:
                flat[n_params:n_all].zero_()  # a rank that did not move gives no buffer vote
            flat[n_all:].copy_(torch.tensor([m, 1.0 if n > 0 else 0.0, 1.0 if lockstep else 0.0], dtype=torch.float32))
            t = flat
            if self._host is not None:
                self._host.copy_(flat)  # device -> host, synchronous: Gloo reads it on the host
                t = self._host
            work = self._start_all_reduce(t)
        self.pending = work
        self._launched_at = self._clock()
        return work

    def _land(self, model: nn.Module, with_divergence: bool, lockstep_version: Optional[int], *,
              keep_current: bool) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """The finished all-reduce into the replica: the weighted mean of the parameters, the movers' mean of the
        float buffers, and the divergence read-out against the kept replica."""
        flat, saved = self._flat, self._saved
        assert flat is not None and saved is not None
        params = list(model.parameters())
        bufs = float_buffers(model)
        n_all = saved.numel()
        n_params = self._n_params
        with torch.no_grad():
            if self._host is not None:
                head = self._host[n_all:].tolist()
                flat.copy_(self._host, non_blocking=self._host.is_pinned())  # stream-ordered before the uses below
            else:
                head = flat[n_all:].tolist()
        total, movers, flags = head
        self.realigned_to = None
        if flags != 0:
            self._check_lockstep(flags, float(lockstep_version) if lockstep_version is not None else 0.0)
        self.reduced = total > 0
        if total <= 0:  # nobody moved: every replica stays as it was (the sum is discarded)
            return (0.0, None, None) if with_divergence else (None, None, None)
        with torch.no_grad():
            if keep_current and self._current is not None:
                pack_into(params + bufs, self._current)
                self._correct_pending = True
            pflat = flat[:n_params].div_(total)
            unpack_from(pflat, params)
            if bufs and movers > 0:
                unpack_from(flat[n_params:n_all].div_(movers), bufs)
            if with_divergence:
                return _divergence(saved[:n_params], pflat)
        return None, None, None

    def _check_lockstep(self, flags: float, v: float) -> None:
        """Some member is in a lockstep reduce (``mode.lockstep_ahead``): every member must be, at one version.
        Every member sees the same summed flags, so all raise or all go on together; the versions take one more
        small collective, only in lockstep (float64: a version's square is past float32's exact integers)."""
        if flags != self.world_size:
            raise LockstepMisaligned(f"a reduce found {flags:.0f} of its {self.world_size} members in lockstep and "
                                     "the others paced: set mode.lockstep_ahead=0 to pace every reduce")
        head = torch.tensor([v, v * v], dtype=torch.float64, device=self.comm_device)
        self._all_reduce(head)
        v_sum, v_sq = head.tolist()
        if lockstep_aligned(flags, v_sum, v_sq, self.world_size):
            return
        # Every member in lockstep, at different versions: after a regroup one survivor completed a reduce its
        # peer had to redo. This all-reduce averaged them all the same (each one's steps once); the members
        # learn the furthest version, and the ones behind answer the reduces they skip with nothing.
        top = torch.tensor([v], dtype=torch.float64, device=self.comm_device)
        self._all_reduce(top, op=self.dist.ReduceOp.MAX)
        self.realigned_to = int(top.item())

    def abort(self) -> None:
        """Tear the group down without waiting for its pending work (the failure path, and every regroup).

        NCCL aborts its communicators at once. A Gloo group is dropped: at once when nothing is
        pending in it (a failed collective completed with its error), retired when a collective
        is still pending (a peer alive but silent, or one that gave up first): see :func:`retire`.
        """
        if self.group is not None:
            group, pending = self.group, self.pending
            self.group = self.pending = None
            if pending is not None and not pending.is_completed():
                # the retired collective may still write into the buffer it reduces (the host copy of a CUDA
                # replica, else the sync's own): the next sync (an overlapped one sent again at once) gets a fresh one
                if self._host is not None:
                    retire(group, pending, self._host)
                    self._host = None
                else:
                    retire(group, pending, self._flat)
                    self._flat = None
            return
        self.pending = None
        if not self.dist.is_initialized():
            return
        try:
            from torch.distributed.distributed_c10d import _abort_process_group
        except ImportError as e:  # torch < 2.6: a regroup would re-initialise the live group and fail; say why
            raise RuntimeError(check_torch_version(torch.__version__)
                               or f"torch {torch.__version__} has no torch.distributed _abort_process_group") from e
        try:
            _abort_process_group()
        except Exception as e:  # pragma: no cover - teardown best effort
            log.warning("aborting the process group: %s", e)

    def close(self) -> None:
        """Orderly teardown at the end of a healthy run; an abort when a collective failed or is still pending
        (``destroy_process_group`` would wait for it)."""
        if self.group is not None or self.pending is not None:
            self.abort()
            return
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception as e:  # pragma: no cover - teardown best effort
            log.debug("destroy_process_group: %s", e)


def snapshot_nbytes(model: nn.Module) -> int:
    """Tensor bytes of the largest frame the cpu backend sends either way (a snapshot or an update):
    every parameter and float buffer as float32 (bf16_wire halves the parameters, never the buffers).
    The wire's frame ceiling is sized from this, not from the parameters alone: a model with large
    float buffers (running statistics, embeddings held as buffers) would exceed it."""
    return 4 * (sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in float_buffers(model)))


@dataclass
class SentState:
    """``mode.overlap``: a replica as it answered reduce ``version`` (float32 copies on its device), kept until that
    reduce's update comes, which is applied as the correction ``W += W_avg - W_sent``."""

    version: int
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]


class CoordinatorBackend:
    """Snapshots up, consensus down (the cpu backend).

    A CUDA replica is staged for the wire through one pinned host buffer, reused across
    snapshots: parameters are flattened (and cast to bf16 with ``bf16_wire``) on the GPU,
    copied in one transfer per dtype, and the stream is synchronised once. The snapshot's
    tensors are views of that buffer, valid until the next snapshot (the rank sends each
    snapshot before it takes another). The consensus comes back the same way round: packed
    into a second pinned buffer and sent to the GPU in one transfer (:meth:`inbound`).
    """

    def __init__(self, bf16_wire: bool = False) -> None:
        self.bf16_wire = bf16_wire
        self._staging: Optional[torch.Tensor] = None
        self._inbound: Optional[torch.Tensor] = None
        """The host buffer a consensus frame is packed into on its way to a CUDA replica (:meth:`inbound`)."""
        self._inbound_done: Any = None
        """The CUDA event after the last inbound transfer: the buffer is rewritten only once it completed."""

    def snapshot(self, model: nn.Module, n: int) -> Snapshot:
        params = [p.detach() for p in model.parameters()]
        bufs = [b.detach() for b in float_buffers(model)]
        pdtype = torch.bfloat16 if self.bf16_wire else torch.float32
        with torch.no_grad():
            if params and params[0].device.type == "cuda":
                return Snapshot(n=int(n), tensors=self.stage(params, bufs, pdtype, pin=True))
            tensors: dict[str, torch.Tensor] = {f"p{i}": p.to("cpu").to(pdtype) for i, p in enumerate(params)}
            tensors.update({f"b{j}": b.to("cpu").float() for j, b in enumerate(bufs)})
        return Snapshot(n=int(n), tensors=tensors)

    def staging_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        """The reused host buffer, grown to ``nbytes`` (pinned for CUDA)."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._staging

    @torch.no_grad()
    def stage(self, params: list[torch.Tensor], bufs: list[torch.Tensor], pdtype: torch.dtype, *, pin: bool) -> dict[str, torch.Tensor]:
        """``p<i>`` (``pdtype``) and ``b<j>`` (float32) as views of one host buffer, filled by one copy per group."""
        groups = [(prefix, ts, torch.cat([t.reshape(-1).to(dt) for t in ts]))
                  for prefix, ts, dt in (("p", params, pdtype), ("b", bufs, torch.float32)) if ts]
        offsets, total = [], 0
        for _, _, flat in groups:
            offsets.append(total)
            total += -(-flat.numel() * flat.element_size() // 8) * 8  # 8-byte aligned: each view starts on its dtype
        host = self.staging_buffer(total, pin)
        out: dict[str, torch.Tensor] = {}
        for (prefix, ts, flat), off in zip(groups, offsets):
            dst = host[off:off + flat.numel() * flat.element_size()].view(flat.dtype)
            dst.copy_(flat, non_blocking=pin)  # device -> pinned host: safe to read after the one sync below
            k = 0
            for i, t in enumerate(ts):
                out[f"{prefix}{i}"] = dst[k:k + t.numel()].view(t.shape)
                k += t.numel()
        if pin and groups and groups[0][2].device.type == "cuda":
            torch.cuda.current_stream(groups[0][2].device).synchronize()
        return out

    def consensus_for(self, model: nn.Module, msg: Update) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A consensus frame's parameters and float buffers where ``model`` lives, float32: a CUDA replica gets them
        through :meth:`inbound` (one transfer, no sync per tensor)."""
        params_ = list(model.parameters())
        n_b = len(float_buffers(model))
        params = [msg.tensors[f"p{i}"] for i in range(len(params_))]
        bufs = [msg.tensors[f"b{j}"] for j in range(n_b)]
        if params_ and params_[0].device.type == "cuda":
            return self.inbound(params, bufs, params_[0].device, pin=True)
        return [t.float() for t in params], bufs

    def adopt_update(self, model: nn.Module, msg: Update, alpha: Optional[float]) -> None:
        """Load a consensus frame into ``model`` (full overwrite, or the EASGD blend with ``alpha``)."""
        adopt(model, *self.consensus_for(model, msg), alpha)

    @torch.no_grad()
    def keep_sent(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """float32 copies of ``model``'s parameters and float buffers where they live (the exact state a snapshot was
        taken of, whatever ``bf16_wire`` sent): one extra replica while a reduce is in flight."""
        return ([p.detach().float().clone() for p in model.parameters()],
                [b.detach().float().clone() for b in float_buffers(model)])

    def adopt_correction(self, model: nn.Module, msg: Update, alpha: Optional[float], sent_params: list[torch.Tensor],
                         sent_buffers: list[torch.Tensor]) -> None:
        """Apply a consensus to a replica that trained on since its snapshot: ``W += a (W_avg - W_sent)`` for every
        parameter and float buffer (``a`` = EASGD's alpha, 1 without it), so the steps after the snapshot are kept
        and the replica moves by what averaging moved the state it sent."""
        adopt_correction(model, *self.consensus_for(model, msg), sent_params, sent_buffers, alpha)

    @torch.no_grad()
    def inbound(self, params: list[torch.Tensor], bufs: list[torch.Tensor], device: torch.device, *,
                pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A frame's tensors on ``device`` as float32 views of one flat copy: packed into one reused host buffer
        (pinned for CUDA) and sent in one ``non_blocking`` transfer, instead of one pageable, synchronising copy
        per tensor. The buffer is written again only once that transfer is done: one event wait at the next
        adoption (long finished by then, as a rule)."""
        ts = params + bufs
        n = sum(t.numel() for t in ts)
        if self._inbound_done is not None:
            self._inbound_done.synchronize()
            self._inbound_done = None
        if self._inbound is None or self._inbound.numel() < n:
            self._inbound = None
            self._inbound = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        host = self._inbound[:n]
        pack_into(ts, host)
        dev = host.to(device, non_blocking=pin)
        if device.type == "cuda":
            self._inbound_done = torch.cuda.Event()
            self._inbound_done.record(torch.cuda.current_stream(device))
        views, off = [], 0
        for t in ts:
            views.append(dev[off:off + t.numel()].view(t.shape))
            off += t.numel()
        return views[:len(params)], views[len(params):]
