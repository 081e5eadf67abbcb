"""The coordinator <-> rank protocol: one enum of message kinds, one small dataclass per payload.

``protocol/wire.py`` frames a :class:`~flodl_exp.protocol.wire.Message` (kind, JSON fields, raw
tensors) and authenticates the connection; this module says what each kind
carries (pure data: the control core imports it and no wire), and ``protocol/codec.py``
turns payloads into messages and back (:func:`~flodl_exp.protocol.codec.encode`,
:func:`~flodl_exp.protocol.codec.decode`) by the rules below. Both processes dispatch on the payload's type, so a field is
read by name in one place and an unread field is visible as dead code.

Decoding (protocol/codec.py) is strict about what is there and lenient about what is extra: a
missing required field or a value its field's rules refuse raises :class:`ProtocolError`
(the receiver logs it and drops that message; nothing else escapes :func:`decode`);
fields a newer peer adds are ignored; an unknown kind decodes to ``None`` (logged and ignored).

The rules sit on the dataclasses' annotations, so a field says what it accepts where it is declared:

* ``int``: an int (not a bool) in signed 64 bits, the range any peer's counters live in;
  :data:`Count` (ids, indices, counts, sizes: epochs, chunks, offsets, steps, ranks, pids) is also
  non-negative.
* ``float``: an int or float that fits a float and is finite. Times, durations, resource samples
  and blend factors are plain ``float``: a NaN or infinite one is a broken clock or sensor, and it would
  poison the sums and medians it is fed to (ElChe's costs, the callback slack). Their sign is not
  checked: a report is not refused over a clock that stepped back.
* :data:`Reading` (losses, learning rates, divergence norms, user metrics): any IEEE value, NaN and
  +-inf included. A diverging model reports them and the report must still count (the ledger skips a
  non-finite loss, the guards read NaN as 0); a loss refused would lose its batch's accounting.
* ``str``, ``bool``: that exact JSON type (a bool is no int, an int no bool).
* ``list[X]`` and ``dict[str, X]``: every element (every key a str) checked as ``X``; :class:`Len`
  fixes a record's length (``[offset, size]``, ``[epoch, offset, size]``...).

A float field given an int is converted (JSON has one number type); the payload is a fresh copy, so
``encode(decode(m))`` decodes to the same payload.
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Optional, Union

from flodl_exp.protocol.errors import WireError

if TYPE_CHECKING:
    import torch

    Tensors = dict[str, torch.Tensor]
else:  # the payloads' hints are read at import (codec._DECODERS); torch loads with a message's first tensor (wire.dtypes)
    Tensors = dict[str, Any]


class ProtocolError(WireError):
    """A message whose kind is known but whose fields do not fit its payload."""


I64_MIN, I64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Num:
    """A numeric field's rule beyond its type (attached with ``Annotated``): ``lo``/``hi`` narrow the
    signed 64-bit range of an int; ``finite=False`` lets a float be NaN or +-inf."""

    lo: int = I64_MIN
    hi: int = I64_MAX
    finite: bool = True


@dataclass(frozen=True)
class Len:
    """A list that is a fixed-length record (``[offset, size]``): exactly ``n`` elements."""

    n: int


Count = Annotated[int, Num(lo=0)]
"""An id, index, count or size: 0 <= v < 2**63."""
Reading = Annotated[float, Num(finite=False)]
"""A loss, learning rate, norm or metric: any IEEE value (a diverging model reports NaN and inf)."""


class Kind(str, enum.Enum):
    # coordinator -> rank
    START_EPOCH = "start_epoch"
    EXTEND_PARTITION = "extend_partition"
    FORM_GROUP = "form_group"
    REGROUP = "regroup"
    SYNC_NOW = "sync_now"
    REQUEST_PARAMS = "request_params"
    UPDATE = "update"
    SET_GLOBAL_STEP = "set_global_step"
    THROTTLE = "throttle"
    EXECUTE_EVAL = "execute_eval"
    SAVE = "save"
    SHUTDOWN = "shutdown"
    COORD_HEARTBEAT = "coord_heartbeat"
    EVICT = "evict"
    REQUEST_SESSION = "request_session"
    SET_EPOCH_ROLE = "set_epoch_role"
    STAGE_ADVISORY = "stage_advisory"
    EPOCH_AGGREGATED = "epoch_aggregated"
    EVAL_BROADCAST = "eval_broadcast"
    CHECKPOINT = "checkpoint"
    PROBE = "probe"
    REPORT_PACE = "report_pace"
    LOCKSTEP = "lockstep"
    NODE_GROUP = "node_group"
    NODE_UPDATE = "node_update"
    NODE_DROP = "node_drop"
    # rank -> coordinator
    SESSION_READY = "session_ready"
    BATCH = "batch"
    BATCHES = "batches"
    SYNC_ACK = "sync_ack"
    SNAPSHOT = "snapshot"
    METRICS = "metrics"
    EVAL_RESULT = "eval_result"
    SAVE_RESULT = "save_result"
    ERROR = "error"
    EXITING = "exiting"
    TELEMETRY = "telemetry"
    HEARTBEAT = "heartbeat"
    EPOCH_FN_RESULT = "epoch_fn_result"
    INTENT = "intent"
    LOOP_NOTICE = "loop_notice"
    CHECKPOINT_RESULT = "checkpoint_result"
    PROBE_RESULT = "probe_result"
    NODE_PARTIAL = "node_partial"
    NODE_DRIFT = "node_drift"


# ------------------------------------------------------------ coordinator -> rank
@dataclass
class StartEpoch:
    """Train picks ``[offset, offset + size)`` of epoch ``epoch``'s permutation as chunk ``chunk``."""

    KIND: ClassVar[Kind] = Kind.START_EPOCH
    epoch: Count
    offset: Count
    size: Count
    chunk: Count


@dataclass
class ExtendPartition:
    """A dead rank's remainder: append it to the running chunk of that epoch (or run it alone)."""

    KIND: ClassVar[Kind] = Kind.EXTEND_PARTITION
    epoch: Count
    offset: Count
    size: Count
    chunk: Count


@dataclass
class FormGroup:
    """nccl modes, once every rank said hello: form the process group with ``backend`` (the coordinator
    chose it for the whole cohort from the hellos' devices: one backend, never one per rank)."""

    KIND: ClassVar[Kind] = Kind.FORM_GROUP
    backend: str
    reason: str = ""


@dataclass
class Regroup:
    """Re-form the process group: this rank becomes ``new_rank`` of ``world_size`` (generation = store prefix)."""

    KIND: ClassVar[Kind] = Kind.REGROUP
    generation: Count
    new_rank: Count
    world_size: Count
    ranks: list[Count]
    session: str = ""
    """The generator rank's session id: the new group's store prefix (the NCCL unique id's place)."""


@dataclass
class SyncNow:
    """nccl backend: all_reduce now (read the divergence when ``divergence``). ``overlap`` (``mode.overlap``): start
    the all_reduce and train on; once it lands, apply the consensus as the correction ``W += W_avg - W_sent`` and
    ack then."""

    KIND: ClassVar[Kind] = Kind.SYNC_NOW
    version: Count
    divergence: bool = True
    overlap: bool = False


@dataclass
class RequestParams:
    """cpu backend: send a snapshot; with ``barrier`` wait for the update before training on. ``overlap``
    (``mode.overlap``): train on, and apply this reduce's update as the correction ``W += W_avg - W_sent``."""

    KIND: ClassVar[Kind] = Kind.REQUEST_PARAMS
    version: Count
    barrier: bool
    overlap: bool = False


@dataclass
class Update:
    """cpu backend: the consensus (``p<i>``/``b<j>`` tensors) to adopt, blended by ``alpha`` when set;
    ``skip`` = nobody moved, keep your state. ``n`` = the steps of yours this reduce consumed."""

    KIND: ClassVar[Kind] = Kind.UPDATE
    n: Count
    alpha: Optional[float] = None
    skip: bool = False
    tensors: Tensors = field(default_factory=dict)
    next_plan: Optional[Annotated[list[Count], Len(4)]] = None
    """cpu cadence: the rank's next chunk ``[epoch, offset, size, chunk]`` folded in (a StartEpoch saved)."""
    version: Optional[Count] = None
    """The reduce it answers: a rank adopts one update per reduce (a member whose node leader died may be sent
    it again by the coordinator, and ignores the second)."""


@dataclass
class NodeGroup:
    """cpu backend, hierarchical averaging (``cluster.node_reduce``): the ranks sharing this rank's node, and the
    one of them (``leader``) that sums their snapshots into one :class:`NodePartial` and hands each its
    :class:`Update` from the coordinator's :class:`NodeUpdate`. ``address``: the leader's node-local socket
    (an abstract unix socket name), which the leader binds and the members connect to. Sent once, before
    training; a rank without one (or whose leader is gone) answers the coordinator directly."""

    KIND: ClassVar[Kind] = Kind.NODE_GROUP
    leader: Count
    members: list[Count]
    address: str


@dataclass
class NodeUpdate:
    """cpu backend, hierarchical averaging: one reduce's consensus for a node's ranks, sent to its leader, which
    forwards each member ``ranks[i]`` an ``Update(n=ns[i], alpha, skip, tensors)`` (its ``p<i>``/``b<j>``) and
    then answers :class:`NodeDrift`. When an outer optimizer stepped, ``tensors`` also holds ``c<i>``, the
    average before its step, which each replica's drift is measured against (else against ``p<i>``)."""

    KIND: ClassVar[Kind] = Kind.NODE_UPDATE
    version: Count
    ranks: list[Count]
    ns: list[Count]
    alpha: Optional[float] = None
    skip: bool = False
    tensors: Tensors = field(default_factory=dict)


@dataclass
class NodeDrop:
    """cpu backend, hierarchical averaging: the coordinator declared ``rank`` of this rank's node dead. Its leader stops
    waiting for its snapshot (a frozen member's relay socket may stay open); a member whose leader it was closes its
    relay and answers the coordinator directly, re-sending a snapshot the leader never answered."""

    KIND: ClassVar[Kind] = Kind.NODE_DROP
    rank: Count


@dataclass
class SetGlobalStep:
    KIND: ClassVar[Kind] = Kind.SET_GLOBAL_STEP
    global_step: Count


@dataclass
class Throttle:
    """cpu backend, ``max_batch_diff``: stop training until the next update."""

    KIND: ClassVar[Kind] = Kind.THROTTLE


@dataclass
class ExecuteEval:
    KIND: ClassVar[Kind] = Kind.EXECUTE_EVAL
    epoch: Count
    final: bool = False


@dataclass
class Save:
    """Write this rank's bundle pieces under ``stem``: the model when ``model``, the optimizer as
    ``.optim.pt`` when ``primary`` (else ``.optim.r<N>.pt``)."""

    KIND: ClassVar[Kind] = Kind.SAVE
    stem: str
    primary: bool
    model: bool
    consensus: bool = False
    """cpu backend: write the model piece from the last consensus adopted, not the replica
    (EASGD keeps replicas apart from it; the bundle holds the consensus, as the reference's CPU path)."""
    reduces: Optional[Count] = None
    """The reduces finished when it was sent: a rank whose update of one of them is still on its way (``mode.overlap``,
    through a node leader) adopts it first; one still in flight (a stalled reduce, ShutdownWithSave) is not waited for."""


@dataclass
class Checkpoint:
    """Run the user's ``experiment.checkpoint_fn(version, model)`` on this rank (algorithms.md 8.3): sent to the
    rank that writes a periodic or requested bundle's model piece, right after its ``save``, so the function
    sees the bundle's state; answered with a :class:`CheckpointResult`."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINT
    version: Count
    """The bundle's epoch: the model state at the end of epoch ``version - 1``."""
    consensus: bool = False
    """cpu backend: hand the function a copy of the model holding the last consensus adopted (as ``Save``),
    never the training replica."""


@dataclass
class Probe:
    """``mode.auto``, before the first chunk: time ``steps`` full training steps (forward, backward, optimizer)
    on this rank's data, then put the model, the optimizer and the RNG back as they were (nothing is trained);
    answered with a :class:`ProbeResult`. The first step is warm-up and is reported too."""

    KIND: ClassVar[Kind] = Kind.PROBE
    steps: Count


@dataclass
class ReportPace:
    """Cadence and async windows: this rank's Batch reports may travel several to a frame
    (:class:`Batches`, at most ``cluster.report_coalesce_ms`` late) until its ``flush_at``-th report (counted
    from its first), the one that completes its count for the window in progress; that one, and every later one,
    goes at once, so the reduce is triggered as soon as without coalescing. The coordinator sends it when a
    window's counts are set (flodl_exp/core/report_pace.py); a rank that never got one sends every report
    at once."""

    KIND: ClassVar[Kind] = Kind.REPORT_PACE
    flush_at: Count


@dataclass
class Lockstep:
    """nccl_sync (``mode.lockstep_ahead``): after each trained step, all_reduce at once, without waiting for a
    ``sync_now``, while this rank's sync count (the reduces it took part in, the next one's version) is below
    ``until``; each such reduce is acked as a ``sync_now``'s is, with its version. The coordinator only raises
    ``until``, never above what every rank's chunk has steps left for, and never sends a ``sync_now`` below it,
    so every rank takes part in the same reduces in the same order. A rank whose chunk ends below ``until``
    (it trained a step while the last license had run out) takes part in the rest with nothing (n 0)."""

    KIND: ClassVar[Kind] = Kind.LOCKSTEP
    until: Count


@dataclass
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str


@dataclass
class RequestSession:
    """Regroup, step 1 (algorithms.md 7.4): the chosen generator makes the new group's session id."""

    KIND: ClassVar[Kind] = Kind.REQUEST_SESSION
    generation: Count


@dataclass
class SessionReady:
    KIND: ClassVar[Kind] = Kind.SESSION_READY
    generation: Count
    session: str


@dataclass
class CoordHeartbeat:
    """The coordinator's beacon: a rank that hears nothing for the heartbeat timeout exits."""

    KIND: ClassVar[Kind] = Kind.COORD_HEARTBEAT


# ------------------------------------------------------------ rank -> coordinator
@dataclass
class Batch:
    """One trained batch: its compute wall ``ms`` and data wait ``data_ms``, control work handled while waiting
    included (ElChe's delivered-cost feed, algorithms.md 9.1)."""

    KIND: ClassVar[Kind] = Kind.BATCH
    ms: float
    data_ms: float
    chunk: Count
    loss: Optional[Reading] = None
    lr: Optional[Reading] = None
    age_ms: float = 0.0
    """Set on the reports a :class:`Batches` frame carried (how long they waited on the rank); 0 on a single one."""


@dataclass
class Batches:
    """Several :class:`Batch` reports in one frame, oldest first, one column per field (see :class:`ReportPace`).
    ``age_ms``: how long before the frame left each report was taken, so the coordinator's timeline places
    each batch when it ended, not when the frame came in. Columns of unequal length are refused."""

    KIND: ClassVar[Kind] = Kind.BATCHES
    ms: list[float]
    data_ms: list[float]
    chunk: list[Count]
    loss: list[Optional[Reading]]
    lr: list[Optional[Reading]]
    age_ms: list[float]

    def __post_init__(self) -> None:
        n = len(self.ms)
        if not (len(self.data_ms) == len(self.chunk) == len(self.loss) == len(self.lr) == len(self.age_ms) == n):
            raise ProtocolError(f"batches: columns of unequal length (ms {n}, data_ms {len(self.data_ms)}, chunk "
                                f"{len(self.chunk)}, loss {len(self.loss)}, lr {len(self.lr)}, age_ms {len(self.age_ms)})")

    def records(self) -> list[Batch]:
        """The reports one by one (the core books each as a single Batch)."""
        return [Batch(m, d, c, lo, lr, a) for m, d, c, lo, lr, a
                in zip(self.ms, self.data_ms, self.chunk, self.loss, self.lr, self.age_ms)]

    @staticmethod
    def of(reports: list[Batch], ages_ms: list[float]) -> Batches:
        return Batches([b.ms for b in reports], [b.data_ms for b in reports], [b.chunk for b in reports],
                       [b.loss for b in reports], [b.lr for b in reports], list(ages_ms))


@dataclass
class SyncAck:
    """nccl backend: the all_reduce is done. ``n`` steps were averaged in; ``d``/``pre``/``post`` = divergence read-out."""

    KIND: ClassVar[Kind] = Kind.SYNC_ACK
    n: Count
    d: Optional[Reading] = None
    pre: Optional[Reading] = None
    post: Optional[Reading] = None
    outer_step: Optional[Reading] = None
    """Norm of the outer optimizer's step after this reduce (None: outer=avg, or nobody moved)."""
    outer_momentum: Optional[Reading] = None
    """Norm of the outer momentum after this reduce."""
    generation: Count = 0
    """The process group's generation whose all_reduce this rank completed (a regroup redoes it in the next)."""
    version: Optional[Count] = None
    """The reduce this answers (its ``sync_now``'s version, or a lockstep reduce's); None: the one in flight."""
    left: Optional[Count] = None
    """Steps left in the rank's running chunk after this reduce (lockstep: how far the license may reach)."""
    held_ms: Optional[float] = None
    """``mode.overlap``: the time this rank's training stood still for averaging since its last answer (this
    reduce's launch and landing, its idle while the reduce was unresolved; rank/hold_clock.py): what the reduce cost
    it, ElChe's ``sync_ms``."""


@dataclass
class Snapshot:
    """cpu backend: this rank's parameters (``p<i>``) and float buffers (``b<j>``) after ``n`` steps."""

    KIND: ClassVar[Kind] = Kind.SNAPSHOT
    n: Count
    tensors: Tensors = field(default_factory=dict)
    version: Optional[Count] = None
    """The reduce it answers (``RequestParams.version``): a node leader matches its members' snapshots by it."""
    held_ms: Optional[float] = None
    """``mode.overlap``: the time this rank's training stood still for averaging since its last answer (its idle
    while the last reduce was unresolved, that update's correction, this snapshot; rank/hold_clock.py): ElChe's
    ``sync_ms``."""


@dataclass
class NodePartial:
    """cpu backend, hierarchical averaging: a node leader's answer to ``RequestParams`` for the node's ranks
    ``ranks`` (ascending; the members that answered it, itself included), with ``ns[i]`` their steps and
    ``pre[i]`` each replica's norm ``||W_i||``. ``weighted``: ``tensors`` hold ``p<i>`` = the float64 sum of
    ``mass(n_r, gamma) * W_r`` and ``b<j>`` = the float64 sum of the float buffers of the ranks that moved
    (``n_r > 0``); not weighted (nobody on the node moved): the plain float64 sums over every member, which
    only EASGD's final round (the mean of idle replicas) reads. The coordinator divides once, over all nodes,
    so the consensus is the flat one's to the float32 rounding (core/averager.py)."""

    KIND: ClassVar[Kind] = Kind.NODE_PARTIAL
    version: Count
    ranks: list[Count]
    ns: list[Count]
    pre: list[Reading]
    weighted: bool
    tensors: Tensors = field(default_factory=dict)
    held_ms: Optional[float] = None
    """``mode.overlap``: the most any of the node's ranks was held (their snapshots' ``held_ms``)."""


@dataclass
class NodeDrift:
    """cpu backend, hierarchical averaging: after forwarding reduce ``version``'s update, the leader's read-out
    of each member's drift ``||W_r - consensus|| / ||consensus||`` (``ranks[i]``: ``drift[i]``), measured on the
    snapshot it summed; the guard's input, as the flat reduce computes it at the coordinator."""

    KIND: ClassVar[Kind] = Kind.NODE_DRIFT
    version: Count
    ranks: list[Count]
    drift: list[Reading]


@dataclass
class ChunkMetrics:
    """A finished chunk (algorithms.md 9.3); ``ranges`` = the [offset, size] it covered."""

    KIND: ClassVar[Kind] = Kind.METRICS
    epoch: Count
    chunk: Count
    avg_loss: Reading
    batches: Count
    samples: Count
    epoch_ms: float
    share_complete_ms: float
    compute_only_ms: float
    data_starve_ms: float
    scalars: dict[str, list[Reading]] = field(default_factory=dict)
    ranges: list[Annotated[list[Count], Len(2)]] = field(default_factory=list)
    extra_chunks: list[Count] = field(default_factory=list)
    """ExtendPartition chunks this chunk absorbed."""
    loss_batches: Optional[Count] = None
    """Batches behind ``avg_loss`` when fewer than ``batches`` (a cooperative loop's steps without a loss)."""


@dataclass
class EvalResult:
    KIND: ClassVar[Kind] = Kind.EVAL_RESULT
    epoch: Count
    metrics: dict[str, Reading] = field(default_factory=dict)
    error: Optional[str] = None
    final: bool = False
    elapsed_ms: Optional[float] = None
    """How long the eval took on the rank (the coordinator's callback slack learns from it)."""


@dataclass
class SaveResult:
    KIND: ClassVar[Kind] = Kind.SAVE_RESULT
    stem: str
    error: Optional[str] = None


@dataclass
class RankError:
    """The rank is failing: why, before its connection drops."""

    KIND: ClassVar[Kind] = Kind.ERROR
    error: str
    traceback: str = ""
    loop: bool = False
    """The exception came out of the user's own training loop (the cooperative tier): the coordinator applies
    ``cluster.loop_error`` (lose_rank, the default: recover without this rank; fail: the run ends FAILED)."""


@dataclass
class Exiting:
    """A clean exit: the replica's hash (equal hashes = identical replicas) and counters."""

    KIND: ClassVar[Kind] = Kind.EXITING
    rank: Count
    pid: Count
    hash: str
    steps: Count
    global_step: Count


@dataclass
class Telemetry:
    """Resource samples averaged over the last period (absent on hosts that cannot measure them)."""

    KIND: ClassVar[Kind] = Kind.TELEMETRY
    cpu_pct: Optional[float] = None
    rss_gb: Optional[float] = None
    gpu_util: Optional[float] = None
    mem_gb: Optional[float] = None
    """Device-wide GPU memory in use (ranks sharing a GPU report the same total)."""
    gpu_proc_mem_gb: Optional[float] = None
    """This rank's own GPU memory."""

    def values(self) -> dict[str, float]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class Heartbeat:
    """The rank's pulse (its heartbeat thread, every second), with what its main thread is doing: ``state``
    is ``train`` (a chunk in progress), ``collective``, ``eval``, ``save`` or ``wait`` (for the coordinator
    or its peers), and ``steps`` its step count. A rank that keeps beating in ``train`` with ``steps``
    frozen has a stuck main thread (the coordinator's progress watch)."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    steps: Optional[Count] = None
    state: Optional[str] = None


@dataclass
class Evict:
    """The coordinator declared this rank dead (its main thread made no progress): the rank's reader
    thread exits the process after a short grace if the main thread does not, so peers blocked in a
    collective with it see the failure."""

    KIND: ClassVar[Kind] = Kind.EVICT
    reason: str


@dataclass
class SetEpochRole:
    """The epoch-role rank (it runs ``experiment.epoch_fn`` before each epoch); sent to every rank before the
    first chunk and whenever the role moves (algorithms.md 3.15)."""

    KIND: ClassVar[Kind] = Kind.SET_EPOCH_ROLE
    rank: Count
    from_epoch: Count = 0
    """The first epoch this holder runs the hook for (a role moved mid-run starts after the newest epoch begun)."""


@dataclass
class StageAdvisory:
    """The picks this rank is likely to be handed next (``[epoch, offset, size]`` ranges, most likely first), at
    epoch start and at each reduce, for its data plane to stage ahead (algorithms.md 5.10). Purely advisory."""

    KIND: ClassVar[Kind] = Kind.STAGE_ADVISORY
    segments: list[Annotated[list[Count], Len(3)]] = field(default_factory=list)
    counts: list[Count] = field(default_factory=list)
    """ElChe's schedule, when it changed since this rank's last advisory; empty: unchanged (latest wins)."""


@dataclass
class EpochAggregated:
    """Epoch ``epoch`` is complete on every rank: its cohort-level metrics (loss, times, global step)."""

    KIND: ClassVar[Kind] = Kind.EPOCH_AGGREGATED
    epoch: Count
    metrics: dict[str, Reading] = field(default_factory=dict)


@dataclass
class EvalBroadcast:
    """An eval of epoch ``epoch`` reported (the reference's ``EvalBroadcast``): every rank hears its metrics, so a
    cooperative loop can read them (``w.poll_eval()``): early stopping, a schedule, logging."""

    KIND: ClassVar[Kind] = Kind.EVAL_BROADCAST
    epoch: Count
    metrics: dict[str, Reading] = field(default_factory=dict)
    final: bool = False


@dataclass
class EpochFnResult:
    """The epoch-role rank ran ``experiment.epoch_fn`` before epoch ``epoch``."""

    KIND: ClassVar[Kind] = Kind.EPOCH_FN_RESULT
    epoch: Count
    elapsed_ms: float
    metrics: dict[str, Reading] = field(default_factory=dict)
    error: Optional[str] = None


@dataclass
class CheckpointResult:
    """The rank ran ``experiment.checkpoint_fn`` for ``version``; ``error`` when it raised (or none is configured)."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINT_RESULT
    version: Count
    elapsed_ms: float
    error: Optional[str] = None


@dataclass
class ProbeResult:
    """The probe's step times (ms, the simulated slowdown of ``cluster.rank_speeds`` included) and data waits, in
    order; ``error`` when the rank cannot probe (a cooperative loop has no step the framework can run)."""

    KIND: ClassVar[Kind] = Kind.PROBE_RESULT
    step_ms: list[Reading] = field(default_factory=list)
    data_ms: list[Reading] = field(default_factory=list)
    model_bytes: Count = 0
    error: Optional[str] = None


INTENT_KINDS = ("eval", "checkpoint", "stop")
"""What a cooperative loop may ask for (Intent.kind)."""


@dataclass
class Intent:
    """The user's loop asks for an eval or a bundle (``w.request_eval()`` / ``w.request_checkpoint()``) in
    ``epoch``; the coordinator answers it at that epoch's boundary, once for all ranks (core/intents.py).
    ``stop`` (``w.request_stop()``): the run ends after the furthest epoch the cohort has started."""

    KIND: ClassVar[Kind] = Kind.INTENT
    kind: str
    epoch: int


@dataclass
class LoopNotice:
    """The cooperative loop has held a batch for ``held_s`` without calling ``w.step()`` (sent once per batch)."""

    KIND: ClassVar[Kind] = Kind.LOOP_NOTICE
    message: str
    held_s: float


Payload = Union[
    StartEpoch, ExtendPartition, FormGroup, Regroup, SyncNow, RequestParams, Update, SetGlobalStep, Throttle, ExecuteEval,
    Save, Shutdown, CoordHeartbeat, Evict, RequestSession, SessionReady, Batch, SyncAck, Snapshot, ChunkMetrics, EvalResult, SaveResult, RankError,
    Exiting, Telemetry, Heartbeat, SetEpochRole, EpochAggregated, EpochFnResult, StageAdvisory, Intent, LoopNotice,
    EvalBroadcast, Checkpoint, CheckpointResult, Probe, ProbeResult, ReportPace, Batches, Lockstep,
    NodeGroup, NodeUpdate, NodePartial, NodeDrift, NodeDrop,
]
PAYLOADS: dict[str, type] = {t.KIND.value: t for t in typing.get_args(Payload)}
assert len(PAYLOADS) == len(Kind), "every kind has exactly one payload"
