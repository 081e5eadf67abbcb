"""The coordinator's :class:`~.bundle_store.BundleStore`: bundle files beside the checkpoint stem, the preemption
mark in the job folder, artifacts through the tracking sink. The shell's side of the port: the core never imports
it."""
from __future__ import annotations

import os
from typing import Any

from flodl_exp.bundle_meta import BundleMeta
from flodl_exp.constants import PREEMPT_MARK
from flodl_exp.core.ports import Sink


class DiskBundles:
    """The coordinator's store: bundle files beside the checkpoint stem, the preemption mark in the job
    folder, artifacts through the tracking sink."""

    def __init__(self, job_dir: str, sink: Sink) -> None:
        self.job_dir = job_dir
        self._sink = sink

    def remove_bundle(self, stem: str) -> list[str]:
        from flodl_exp.checkpoint import remove_bundle

        return remove_bundle(stem)

    def save_outer(self, state: dict[str, Any], stem: str) -> str:
        from flodl_exp.checkpoint import atomic_torch_save, outer_path

        atomic_torch_save(state, outer_path(stem))
        return os.path.basename(outer_path(stem))

    def write_meta(self, stem: str, meta: BundleMeta) -> None:
        from flodl_exp.checkpoint import write_meta

        write_meta(stem, meta)

    def log_bundle(self, stem: str, artifact_path: str) -> None:
        from flodl_exp.checkpoint import BUNDLE_SUFFIXES

        d, name = os.path.dirname(stem), os.path.basename(stem)
        if not os.path.isdir(d):
            return
        for fn in sorted(os.listdir(d)):
            if fn.startswith(name + ".") and not fn.startswith(".tmp"):
                rest = fn[len(name):]
                if rest in BUNDLE_SUFFIXES or (rest.startswith(".optim.r") and rest.endswith(".pt")):
                    self._sink.log_artifact(os.path.join(d, fn), artifact_path)

    def write_deaths(self, stem: str, deaths: list[dict[str, Any]]) -> None:
        from flodl_exp.fsio import atomic_json

        path = stem + ".death.json"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_json({"deaths": deaths}, path)
        self._sink.log_artifact(path, "deaths")

    def mark_preempted(self, record: dict[str, Any]) -> None:
        from flodl_exp.fsio import atomic_json

        atomic_json(record, os.path.join(self.job_dir, PREEMPT_MARK))
