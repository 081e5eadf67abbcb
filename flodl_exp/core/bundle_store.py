"""Where bundles meet the disk: the control core's :class:`BundleStore` port, and an in-memory store for the
simulator and the core's tests (the coordinator's disk store is the shell's: ``coordinator/disk_bundles.py``).

The core decides which bundle is written when, by whom, and what its meta says; the store only writes
(and removes) files and logs them to MLflow. A write that fails raises ``OSError``: the core records the
bundle as failed, never the store.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from flodl_exp.bundle_meta import BundleMeta
from flodl_exp.bundle_names import file_name, outer_path


class BundleStore(Protocol):
    def remove_bundle(self, stem: str) -> list[str]:
        """Delete the pieces of an earlier save of ``stem`` (before any new piece is written); what went."""
        ...

    def save_outer(self, state: dict[str, Any], stem: str) -> str:
        """The cpu backend's outer optimizer sidecar; the file name written."""
        ...

    def write_meta(self, stem: str, meta: BundleMeta) -> None: ...

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        """Log every written piece of ``stem`` to the tracking run."""
        ...

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        """``<stem>.death.json``: every death so far."""
        ...

    def mark_preempted(self, record: dict[str, Any]) -> None:
        """The job folder's preemption mark (the launcher requeues on it)."""
        ...


class MemoryBundles:
    """Bundles kept in memory (the simulator; the core's tests): what was written, removed and logged."""

    def __init__(self, fail_meta: Optional[set[str]] = None) -> None:
        self.metas: dict[str, BundleMeta] = {}
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
        return file_name(outer_path(stem))

    def write_meta(self, stem: str, meta: BundleMeta) -> None:
        if stem in self.fail_meta:
            raise OSError(28, "No space left on device")
        self.metas[stem] = meta

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        self.logged.append((stem, artifact_path))

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        self.deaths = list(deaths)

    def mark_preempted(self, record: dict[str, Any]) -> None:
        self.preempted = dict(record)
