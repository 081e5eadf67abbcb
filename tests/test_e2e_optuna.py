"""An Optuna study end to end (make test-package): ``python -m flodl_exp -m hydra/sweeper=optuna``, 3 real trials.

The brief's command with a mode the validation refuses among the choices: ``nccl_async`` trials fail, and the
study must go on past them. The default (TPE) sampler's seed makes it repeatable: with seed 11 its random start
picks cpu_async, nccl_async, nccl_cadence (optuna 2.10), so the failed trial sits between two that train. (Not the
grid sampler: with hydra-optuna-sweeper 1.3.0 a failed trial on the grid's last point ends the sweep with
optuna's ``Study.stop`` RuntimeError.) About 45 s on 2 cores (two 2-rank digits runs of one epoch)."""
from __future__ import annotations

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.package, pytest.mark.e2e, pytest.mark.timeout(300)]

MODES = ("nccl_cadence", "nccl_async", "cpu_async")
SEED = 11


def test_a_study_runs_its_trials_as_children_ranks_them_and_survives_a_failed_trial(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    r = run_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", f"hydra.sweeper.sampler.seed={SEED}",
                 f"mode=choice({','.join(MODES)})", "experiment.optimizer.lr=interval(1e-3,1e-2)",
                 "experiment.epochs=1", "run.progress=off", "tracking.log_model=false", "tracking.predict=false",
                 f"tracking.uri={uri}", "tracking.experiment_name=optuna_e2e", f"run.job_root={tmp_path}/jobs",
                 "run.timeout_min=5", f"hydra.sweep.dir={tmp_path}/sweep"], timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "config error: mode=nccl_async" in r.stderr  # the failed trial said why, in one line

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("optuna_e2e")
    assert exp is not None
    runs = c.search_runs([exp.experiment_id])
    parents = [x for x in runs if x.data.tags.get("flodl.sweep") == "parent"]
    assert len(parents) == 1
    parent = parents[0]
    pid = parent.info.run_id
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == pid]
    assert len(children) == 3 and len(runs) == 4
    assert sorted(int(x.data.tags["sweep.trial"]) for x in children) == [0, 1, 2]

    def mode(run):
        return next(o.split("=", 1)[1] for o in run.data.tags["sweep.overrides"].split() if o.startswith("mode="))

    refused = sorted((x for x in children if mode(x) == "nccl_async"), key=lambda x: int(x.data.tags["sweep.trial"]))
    done = [x for x in children if mode(x) != "nccl_async"]
    assert refused and done, f"seed {SEED} no longer gives both a refused and a trained trial: {[mode(x) for x in children]}"
    for run in refused:
        assert run.info.status == "FAILED" and run.data.tags["error"].startswith("config error: mode=nccl_async")
        assert "objective" not in run.data.metrics
    for run in done:  # the study went on past the failed trial
        assert run.info.status == "FINISHED", mode(run)
        assert run.data.metrics["objective"] == pytest.approx(run.data.metrics["eval/accuracy"])
        assert float(run.data.params["experiment.optimizer.lr"]) == pytest.approx(
            float(next(o.split("=", 1)[1] for o in run.data.tags["sweep.overrides"].split()
                       if o.startswith("experiment.optimizer.lr="))))
        assert 1e-3 <= float(run.data.params["experiment.optimizer.lr"]) <= 1e-2
        assert f"trial {run.data.tags['sweep.trial']}: eval/accuracy = " in r.stdout

    done.sort(key=lambda x: (-x.data.metrics["objective"], int(x.data.tags["sweep.trial"])))
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.sweeper"] == "optuna" and parent.data.tags["sweep.direction"] == "maximize"
    assert parent.data.tags["sweep.failed_trials"] == str(len(refused)) and parent.data.tags["children"] == "3"
    assert parent.data.tags["sweep.best_trial"] == done[0].data.tags["sweep.trial"]
    assert parent.data.metrics["best_objective"] == pytest.approx(done[0].data.metrics["objective"])

    ranking = tmp_path / "sweep" / "report" / "trials.md"
    assert ranking.exists()
    assert "report/trials.md" in {a.path for a in c.list_artifacts(pid, "report")}
    rows = [ln for ln in ranking.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| Rank")]
    assert [ln.split(" | ")[1] for ln in rows] == [x.data.tags["sweep.trial"] for x in [*done, *refused]]
    assert rows[0].startswith("| 1 | ") and " COMPLETE " in rows[0] and "FAIL: run FAILED: config error" in rows[-1]
    assert (tmp_path / "sweep" / "optimization_results.yaml").exists()  # the sweeper finished the study
