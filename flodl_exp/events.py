"""What a run's ``events.jsonl`` records: one frozen dataclass per kind of event.

Every line of the event log is a JSON object ``{"event": <kind>, ...fields, "t", "wall"}`` (the log adds the
times). Writers build one of these records instead of a dict, so a misspelt or missing field is a type error
where the event is made, not a silent gap in a report, a timeline or a test that reads the log later. The
readers (report, timeline, bench, tests) keep reading plain JSON: :meth:`EventRecord.record` is that JSON.

Fields marked with :func:`flat` hold a mapping whose items become top-level keys (an epoch's metrics, an eval's
results); fields marked with :func:`optional` are left out while they are None, so a record keeps the shape the
log had before these types existed.

Pure data, no I/O: the event log (coordinator/event_log.py) writes records, the simulator reads them in memory.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


def flat() -> Any:
    """A mapping field whose items are written as top-level keys of the record."""
    return field(default_factory=dict, metadata={"flat": True})


def optional() -> Any:
    """A field left out of the record while it is None."""
    return field(default=None, metadata={"optional": True})


@dataclass(frozen=True)
class EventRecord:
    """One line of ``events.jsonl``; subclasses name their kind in ``EVENT``."""

    EVENT: ClassVar[str] = ""

    def record(self) -> dict[str, Any]:
        """The JSON object of this event (without the log's ``t`` and ``wall``)."""
        out: dict[str, Any] = {"event": self.EVENT}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("flat"):
                out.update(v)
            elif not (f.metadata.get("optional") and v is None):
                out[f.name] = v
        return out


# -- start-up ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Joined(EventRecord):
    EVENT = "joined"
    rank: int
    pid: Optional[int]
    host: Optional[str]
    device: Optional[str]
    device_uuid: Optional[str]


@dataclass(frozen=True)
class Started(EventRecord):
    EVENT = "started"
    world_size: int
    epochs: int


@dataclass(frozen=True)
class Resumed(EventRecord):
    EVENT = "resumed"
    attempt: int
    stem: str
    epoch: int
    global_step: int


@dataclass(frozen=True)
class OuterRestored(EventRecord):
    EVENT = "outer_restored"
    stem: str
    momentum_norm: Optional[float]


@dataclass(frozen=True)
class SpecPrior(EventRecord):
    EVENT = "spec_prior"
    anchor_rank: int
    scores: Mapping[int, Optional[float]]


@dataclass(frozen=True)
class Collective(EventRecord):
    EVENT = "collective"
    backend: str
    reason: str


@dataclass(frozen=True)
class NodeGroups(EventRecord):
    """``cluster.node_reduce``: each node leader and the ranks it averages first (leader -> ranks)."""

    EVENT = "node_groups"
    groups: Mapping[int, list[int]]


@dataclass(frozen=True)
class AutoMode(EventRecord):
    """mode=auto's choice: every candidate's prediction, and how long the probe and the simulations took."""

    EVENT = "auto_mode"
    mode: str
    reason: str
    candidates: list[dict[str, Any]]
    timing: Mapping[str, Any] = flat()


@dataclass(frozen=True)
class FirstBatch(EventRecord):
    EVENT = "first_batch"
    rank: int


@dataclass(frozen=True)
class Probe(EventRecord):
    """The cold-start probe re-sized the first window from each rank's first timed steps."""

    EVENT = "probe"
    ms_per_batch: list[float]
    counts: list[int]


# -- training ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window(EventRecord):
    EVENT = "window"
    step: int
    values: Mapping[str, float] = flat()


@dataclass(frozen=True)
class Epoch(EventRecord):
    EVENT = "epoch"
    epoch: int
    metrics: Mapping[str, float] = flat()


@dataclass(frozen=True)
class Eval(EventRecord):
    EVENT = "eval"
    epoch: int
    final: bool
    metrics: Mapping[str, float] = flat()


@dataclass(frozen=True)
class CallbackSlack(EventRecord):
    EVENT = "callback_slack"
    rank: int
    epoch: Optional[int]
    ms: float


@dataclass(frozen=True)
class EpochFn(EventRecord):
    EVENT = "epoch_fn"
    rank: int
    epoch: int
    elapsed_ms: float
    error: Optional[str]
    metrics: Mapping[str, float] = flat()


@dataclass(frozen=True)
class IntentEvent(EventRecord):
    """A cooperative loop's ``w.request_eval()`` / ``request_checkpoint()`` / ``request_stop()``."""

    EVENT = "intent"
    rank: int
    kind: str
    epoch: int


@dataclass(frozen=True)
class Stop(EventRecord):
    EVENT = "stop"
    rank: int
    asked_epoch: int
    last_epoch: int


@dataclass(frozen=True)
class LoopStalled(EventRecord):
    EVENT = "loop_stalled"
    rank: int
    held_s: float
    message: str


@dataclass(frozen=True)
class Stall(EventRecord):
    EVENT = "stall"
    global_step: int
    dump: str


# -- bundles -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointArmed(EventRecord):
    EVENT = "checkpoint_armed"
    stem: str
    epoch: int
    reason: str


@dataclass(frozen=True)
class Checkpoint(EventRecord):
    EVENT = "checkpoint"
    stem: str
    epoch: Optional[int]
    reason: Optional[str] = optional()


@dataclass(frozen=True)
class CheckpointFn(EventRecord):
    """``experiment.checkpoint_fn``'s result on a rank, or the end of its failover (``gave_up``)."""

    EVENT = "checkpoint_fn"
    version: int
    rank: Optional[int]
    error: Optional[str]
    elapsed_ms: Optional[float] = optional()
    gave_up: Optional[bool] = optional()
    tried: Optional[list[int]] = optional()


# -- faults and the end --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankDead(EventRecord):
    EVENT = "rank_dead"
    rank: int
    reason: str


@dataclass(frozen=True)
class Retrain(EventRecord):
    """Trained picks no consensus holds, handed to the survivors to train again."""

    EVENT = "retrain"
    rank: int
    picks: int
    why: Optional[str] = optional()


@dataclass(frozen=True)
class LostPicks(EventRecord):
    EVENT = "lost_picks"
    rank: int
    picks: int


@dataclass(frozen=True)
class Regroup(EventRecord):
    EVENT = "regroup"
    generation: int
    ranks: list[int]
    generator: int


@dataclass(frozen=True)
class ShutdownWithSave(EventRecord):
    EVENT = "shutdown_with_save"
    reason: str
    stem: str


@dataclass(frozen=True)
class PreemptRequested(EventRecord):
    EVENT = "preempt_requested"
    stem: str
    attempt: int


@dataclass(frozen=True)
class PreemptIgnored(EventRecord):
    EVENT = "preempt_ignored"
    phase: str


@dataclass(frozen=True)
class Preempted(EventRecord):
    EVENT = "preempted"
    stem: str
    epoch: int
    attempt: int
    global_step: int


@dataclass(frozen=True)
class Terminated(EventRecord):
    EVENT = "terminated"
    status: str
    reason: str


@dataclass(frozen=True)
class End(EventRecord):
    EVENT = "end"
    status: str
    failure: Optional[str]


KINDS: dict[str, type[EventRecord]] = {c.EVENT: c for c in EventRecord.__subclasses__()}
"""Every kind of event, by its ``event`` name."""
