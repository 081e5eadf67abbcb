"""Hydra sweeps as MLflow parent/child runs.

``python -m flodl_exp -m ...`` runs this callback (registered in conf/config.yaml):
on_multirun_start creates one parent run (tags: sweep dir, overrides) and
exports its id; every job's run is created as a child (``mlflow.parentRunId``);
on_multirun_end ends the parent (FAILED when a child failed) and logs the
mode-comparison report as its artifact. A single run stays top-level.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .constants import PARENT_ENV

log = logging.getLogger(__name__)



class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_id: str | None = None
        self.uri: str | None = None
        self.experiment: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from .tracking import client, get_or_create_experiment, resolve_tracking

        uri, art = resolve_tracking(config.tracking, os.getcwd())
        c = client(uri)
        exp_id = get_or_create_experiment(c, config.tracking.experiment_name, art)
        from .tracking import redact_uri

        overrides = [f"tracking.uri={redact_uri(o.split('=', 1)[1])}" if o.startswith("tracking.uri=") else o
                     for o in config.hydra.overrides.task]
        run = c.create_run(exp_id, run_name=f"sweep {' '.join(overrides)}"[:250],
                           tags={"sweep_dir": str(config.hydra.sweep.dir), "overrides": " ".join(overrides)[:5000],
                                 "flodl.sweep": "parent"})
        self.parent_id, self.uri, self.experiment = run.info.run_id, uri, config.tracking.experiment_name
        os.environ[PARENT_ENV] = self.parent_id
        print(f"MLflow sweep parent run {self.parent_id}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ.pop(PARENT_ENV, None)
        if not self.parent_id or self.uri is None or self.experiment is None:  # all three are set together
            return
        from .tracking import client

        c = client(self.uri)
        exp = c.get_experiment_by_name(self.experiment)  # None: deleted while the sweep ran (no children then)
        children = [] if exp is None else c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_id}'")
        failed = [r for r in children if r.info.status != "FINISHED"]
        try:
            from .report import generate_report

            out = os.path.join(str(config.hydra.sweep.dir), "report")
            path = generate_report(self.experiment, self.uri, out, parent_run_id=self.parent_id)
            print(f"sweep report: {path}", flush=True)
        except Exception as e:  # a report problem must not hide the sweep's result
            log.warning("sweep report not written: %s", e)
        c.set_tag(self.parent_id, "children", str(len(children)))
        c.set_terminated(self.parent_id, status="FAILED" if failed or not children else "FINISHED")
