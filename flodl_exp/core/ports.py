"""The control core's observer port and the tracking sink the coordinator records through.

The core never reads back from either: what it decides does not depend on what was recorded."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

from flodl_exp.core.cycle import Reduce, ReduceOutcome
from flodl_exp.events import EventRecord
from flodl_exp.protocol.messages import Batch


class Sink(Protocol):
    """A tracking run (``tracking.MlflowSink``; the tests' fakes)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None: ...
    def log_inputs(self, inputs: list[dict[str, Any]]) -> None: ...


class CoreObserver(Protocol):
    """What the shell records of the core's decisions (timeline spans, window records, MLflow, events.jsonl).

    Write-only: nothing the core decides depends on it."""

    def on_batch(self, r: int, b: Batch, epoch: Optional[int], window: int) -> None: ...
    def on_answer(self, r: int, started: float) -> None: ...
    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None: ...
    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None: ...
    def on_eval_result(self, r: int, epoch: int, final: bool) -> None: ...
    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def emit(self, event: EventRecord) -> None: ...
    def log_artifact(self, path: str, artifact_path: str) -> None: ...


class NullObserver:
    """Records nothing (the simulator keeps its own statistics through :meth:`emit` and the reduce hook)."""

    def on_batch(self, r: int, b: Batch, epoch: Optional[int], window: int) -> None:
        pass

    def on_answer(self, r: int, started: float) -> None:
        pass

    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None:
        pass

    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None:
        pass

    def on_eval_result(self, r: int, epoch: int, final: bool) -> None:
        pass

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, Any]) -> None:
        pass

    def emit(self, event: EventRecord) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str) -> None:
        pass


