"""Where bundles meet the disk: the control core's :class:`BundleStore` port, its disk implementation for
the coordinator and an in-memory one for the simulator and the core's tests.

The core decides which bundle is written when, by whom, and what its meta says; the store only writes
(and removes) files and logs them to MLflow. A write that fails raises ``OSError``: the core records the
bundle as failed, never the store.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Protocol

from ..constants import PREEMPT_MARK
from .ports import Sink


class BundleStore(Protocol):
    def remove_bundle(self, stem: str) -> list[str]:
        """Delete the pieces of an earlier save of ``stem`` (before any new piece is written); what went."""
        ...

    def save_outer(self, state: dict[str, Any], stem: str) -> str:
        """The cpu backend's outer optimizer sidecar; the file name written."""
        ...

    def write_meta(self, stem: str, meta: dict[str, Any]) -> None: ...

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        """Log every written piece of ``stem`` to the tracking run."""
        ...

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        """``<stem>.death.json``: every death so far."""
        ...

    def mark_preempted(self, record: dict[str, Any]) -> None:
        """The job folder's preemption mark (the launcher requeues on it)."""
        ...


class DiskBundles:
    """The coordinator's store: bundle files beside the checkpoint stem, the preemption mark in the job
    folder, artifacts through the tracking sink."""

    def __init__(self, job_dir: str, sink: Sink) -> None:
        self.job_dir = job_dir
        self._sink = sink

    def remove_bundle(self, stem: str) -> list[str]:
        from ..checkpoint import remove_bundle

        return remove_bundle(stem)

    def save_outer(self, state: dict[str, Any], stem: str) -> str:
        from ..checkpoint import atomic_torch_save, outer_path

        atomic_torch_save(state, outer_path(stem))
        return os.path.basename(outer_path(stem))

    def write_meta(self, stem: str, meta: dict[str, Any]) -> None:
        from ..checkpoint import write_meta

        write_meta(stem, meta)

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        from ..checkpoint import BUNDLE_SUFFIXES

        d, name = os.path.dirname(stem), os.path.basename(stem)
        if not os.path.isdir(d):
            return
        for fn in sorted(os.listdir(d)):
            if fn.startswith(name + ".") and not fn.startswith(".tmp"):
                rest = fn[len(name):]
                if rest in BUNDLE_SUFFIXES or (rest.startswith(".optim.r") and rest.endswith(".pt")):
                    self._sink.log_artifact(os.path.join(d, fn), artifact_path)

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        from ..fsio import atomic_json

        path = stem + ".death.json"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_json({"deaths": deaths}, path)
        self._sink.log_artifact(path, "deaths")

    def mark_preempted(self, record: dict[str, Any]) -> None:
        from ..fsio import atomic_json

        atomic_json(record, os.path.join(self.job_dir, PREEMPT_MARK))


class MemoryBundles:
    """Bundles kept in memory (the simulator; the core's tests): what was written, removed and logged."""

    def __init__(self, fail_meta: Optional[set[str]] = None) -> None:
        self.metas: dict[str, dict[str, Any]] = {}
        self.removed: list[str] = []
        self.logged: list[tuple[str, str]] = []
        self.deaths: list[dict[str, Any]] = []
        self.preempted: Optional[dict[str, Any]] = None
        self.fail_meta = fail_meta or set()
        """Stems whose meta write fails (a full disk)."""

    def remove_bundle(self, stem: str) -> list[str]:
        self.removed.append(stem)
        return []

    def save_outer(self, state: dict[str, Any], stem: str) -> str:
        return os.path.basename(stem) + ".outer.pt"

    def write_meta(self, stem: str, meta: dict[str, Any]) -> None:
        if stem in self.fail_meta:
            raise OSError(28, "No space left on device")
        self.metas[stem] = meta

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        self.logged.append((stem, artifact_path))

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        self.deaths = list(deaths)

    def mark_preempted(self, record: dict[str, Any]) -> None:
        self.preempted = dict(record)
