"""The coordinator <-> rank protocol: one enum of message kinds, one small dataclass per payload.

``wire.py`` frames a :class:`~flodl_exp.wire.Message` (kind, JSON fields, raw
tensors) and authenticates the connection; this module says what each kind
carries, and turns payloads into messages and back (:func:`encode`,
:func:`decode`). Both processes dispatch on the payload's type, so a field is
read by name in one place and an unread field is visible as dead code.

Decoding is strict about what is there and lenient about what is extra: a
missing required field or a wrong JSON type raises :class:`ProtocolError`
(the receiver logs it and drops that message); fields a newer peer adds are
ignored; an unknown kind decodes to ``None`` (logged and ignored).
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch

from .wire import Message, WireError


class ProtocolError(WireError):
    """A message whose kind is known but whose fields do not fit its payload."""


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
    # rank -> coordinator
    SESSION_READY = "session_ready"
    BATCH = "batch"
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


# ------------------------------------------------------------ coordinator -> rank
@dataclass
class StartEpoch:
    """Train picks ``[offset, offset + size)`` of epoch ``epoch``'s permutation as chunk ``chunk``."""

    KIND: ClassVar[Kind] = Kind.START_EPOCH
    epoch: int
    offset: int
    size: int
    chunk: int


@dataclass
class ExtendPartition:
    """A dead rank's remainder: append it to the running chunk of that epoch (or run it alone)."""

    KIND: ClassVar[Kind] = Kind.EXTEND_PARTITION
    epoch: int
    offset: int
    size: int
    chunk: int


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
    generation: int
    new_rank: int
    world_size: int
    ranks: list[int]
    session: str = ""
    """The generator rank's session id: the new group's store prefix (the NCCL unique id's place)."""


@dataclass
class SyncNow:
    """nccl backend: all_reduce now (read the divergence when ``divergence``)."""

    KIND: ClassVar[Kind] = Kind.SYNC_NOW
    version: int
    divergence: bool = True


@dataclass
class RequestParams:
    """cpu backend: send a snapshot; with ``barrier`` wait for the update before training on."""

    KIND: ClassVar[Kind] = Kind.REQUEST_PARAMS
    version: int
    barrier: bool


@dataclass
class Update:
    """cpu backend: the consensus (``p<i>``/``b<j>`` tensors) to adopt, blended by ``alpha`` when set;
    ``skip`` = nobody moved, keep your state. ``n`` = the steps of yours this reduce consumed."""

    KIND: ClassVar[Kind] = Kind.UPDATE
    n: int
    alpha: Optional[float] = None
    skip: bool = False
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    next_plan: Optional[list[int]] = None
    """cpu cadence: the rank's next chunk ``[epoch, offset, size, chunk]`` folded in (a StartEpoch saved)."""


@dataclass
class SetGlobalStep:
    KIND: ClassVar[Kind] = Kind.SET_GLOBAL_STEP
    global_step: int


@dataclass
class Throttle:
    """cpu backend, ``max_batch_diff``: stop training until the next update."""

    KIND: ClassVar[Kind] = Kind.THROTTLE


@dataclass
class ExecuteEval:
    KIND: ClassVar[Kind] = Kind.EXECUTE_EVAL
    epoch: int
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


@dataclass
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str


@dataclass
class RequestSession:
    """Regroup, step 1 (algorithms.md 7.4): the chosen generator makes the new group's session id."""

    KIND: ClassVar[Kind] = Kind.REQUEST_SESSION
    generation: int


@dataclass
class SessionReady:
    KIND: ClassVar[Kind] = Kind.SESSION_READY
    generation: int
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
    chunk: int
    loss: Optional[float] = None
    lr: Optional[float] = None


@dataclass
class SyncAck:
    """nccl backend: the all_reduce is done. ``n`` steps were averaged in; ``d``/``pre``/``post`` = divergence read-out."""

    KIND: ClassVar[Kind] = Kind.SYNC_ACK
    n: int
    d: Optional[float] = None
    pre: Optional[float] = None
    post: Optional[float] = None
    outer_step: Optional[float] = None
    """Norm of the outer optimizer's step after this reduce (None: outer=avg, or nobody moved)."""
    outer_momentum: Optional[float] = None
    """Norm of the outer momentum after this reduce."""


@dataclass
class Snapshot:
    """cpu backend: this rank's parameters (``p<i>``) and float buffers (``b<j>``) after ``n`` steps."""

    KIND: ClassVar[Kind] = Kind.SNAPSHOT
    n: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ChunkMetrics:
    """A finished chunk (algorithms.md 9.3); ``ranges`` = the [offset, size] it covered."""

    KIND: ClassVar[Kind] = Kind.METRICS
    epoch: int
    chunk: int
    avg_loss: float
    batches: int
    samples: int
    epoch_ms: float
    share_complete_ms: float
    compute_only_ms: float
    data_starve_ms: float
    scalars: dict[str, list[float]] = field(default_factory=dict)
    ranges: list[list[int]] = field(default_factory=list)
    extra_chunks: list[int] = field(default_factory=list)
    """ExtendPartition chunks this chunk absorbed."""
    loss_batches: Optional[int] = None
    """Batches behind ``avg_loss`` when fewer than ``batches`` (a cooperative loop's steps without a loss)."""


@dataclass
class EvalResult:
    KIND: ClassVar[Kind] = Kind.EVAL_RESULT
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)
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
    """The exception came out of the user's own training loop (the cooperative tier): a bug every rank
    would hit, so the run ends FAILED instead of recovering without this rank."""


@dataclass
class Exiting:
    """A clean exit: the replica's hash (equal hashes = identical replicas) and counters."""

    KIND: ClassVar[Kind] = Kind.EXITING
    rank: int
    pid: int
    hash: str
    steps: int
    global_step: int


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
    steps: Optional[int] = None
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
    rank: int
    from_epoch: int = 0
    """The first epoch this holder runs the hook for (a role moved mid-run starts after the newest epoch begun)."""


@dataclass
class StageAdvisory:
    """The picks this rank is likely to be handed next (``[epoch, offset, size]`` ranges, most likely first), at
    epoch start and at each reduce, for its data plane to stage ahead (algorithms.md 5.10). Purely advisory."""

    KIND: ClassVar[Kind] = Kind.STAGE_ADVISORY
    segments: list[list[int]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@dataclass
class EpochAggregated:
    """Epoch ``epoch`` is complete on every rank: its cohort-level metrics (loss, times, global step)."""

    KIND: ClassVar[Kind] = Kind.EPOCH_AGGREGATED
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EpochFnResult:
    """The epoch-role rank ran ``experiment.epoch_fn`` before epoch ``epoch``."""

    KIND: ClassVar[Kind] = Kind.EPOCH_FN_RESULT
    epoch: int
    elapsed_ms: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None


INTENT_KINDS = ("eval", "checkpoint")
"""What a cooperative loop may ask for (Intent.kind)."""


@dataclass
class Intent:
    """The user's loop asks for an eval or a bundle (``w.request_eval()`` / ``w.request_checkpoint()``) in
    ``epoch``; the coordinator answers it at that epoch's boundary, once for all ranks (control/intents.py)."""

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
]
PAYLOADS: dict[str, type] = {t.KIND.value: t for t in typing.get_args(Payload)}
assert len(PAYLOADS) == len(Kind), "every kind has exactly one payload"


# ------------------------------------------------------------ encode / decode
def encode(p: Any) -> Message:
    """The message for payload ``p`` (tensors travel raw, everything else as JSON fields)."""
    fields: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if f.name == "tensors":
            tensors = v
        else:
            fields[f.name] = v
    return Message(p.KIND.value, fields, tensors)


_JSON_TYPES: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


def _check(kind: str, name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union:  # Optional[X]
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    if origin in (list, dict):
        if not isinstance(value, origin):
            raise ProtocolError(f"{kind}.{name}: expected a {origin.__name__}, got {type(value).__name__}")
        return value
    allowed = _JSON_TYPES.get(hint)
    if allowed is not None:
        if isinstance(value, bool) and hint is not bool or not isinstance(value, allowed):
            raise ProtocolError(f"{kind}.{name}: expected {hint.__name__}, got {value!r}")
        return float(typing.cast(float, value)) if hint is float else value
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _decode_batch(f: dict[str, Any]) -> Optional[Batch]:
    """The hot message (one per trained batch per rank) without the generic walk; None when anything is
    off the common shape (a missing field, a type to check or convert), so the generic path decides
    and words the error the same way."""
    try:
        ms, data_ms, chunk = f["ms"], f["data_ms"], f["chunk"]
    except KeyError:
        return None
    loss, lr = f.get("loss"), f.get("lr")
    if (type(ms) is float and type(data_ms) is float and type(chunk) is int
            and (loss is None or type(loss) is float) and (lr is None or type(lr) is float)):
        return Batch(ms, data_ms, chunk, loss, lr)
    return None


def decode(msg: Message) -> Optional[Payload]:
    """The payload of ``msg``; ``None`` for a kind this version does not know. Raises ProtocolError."""
    if msg.kind == "batch" and not msg.tensors:
        fast = _decode_batch(msg.fields)
        if fast is not None:
            return fast
    cls = PAYLOADS.get(msg.kind)
    if cls is None:
        return None
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "tensors":
            kwargs["tensors"] = msg.tensors
        elif f.name in msg.fields:
            kwargs[f.name] = _check(msg.kind, f.name, hints[f.name], msg.fields[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{msg.kind}: missing field {f.name!r}")
    return typing.cast(Payload, cls(**kwargs))
