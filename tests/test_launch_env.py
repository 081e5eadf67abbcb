"""``launch()`` leaves the caller's ``os.environ`` and ``sys.path`` as they were (issue 27): the tasks get the
credentialed tracking URI in the environment of the submission only and the import paths through the spec, and
the launching process connects through the handle. The store and the executor are fakes: no MLflow, no process."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

import flodl_exp.checkpoint
import flodl_exp.jobs.executor
import flodl_exp.tracking
from flodl_exp.bundle_meta import BundleMeta, Resume
from flodl_exp.jobs.launcher import launch
from flodl_exp.tracking import URI_ENV

from conftest import compose

SECRET = "s3cr3t-pw"
FULL_URI = f"postgresql://user:{SECRET}@db.invalid:5432/ml"


class FakeClient:
    def __init__(self, uri: str, calls: list) -> None:
        self.uri, self.calls = uri, calls

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: self.calls.append((self.uri, name))


class FakeExecutor:
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def submit(self, fn: Any, spec_path: str) -> Any:
        self.seen = {"env": os.environ.get(URI_ENV), "spec_path": spec_path}
        return SimpleNamespace(job_id="4242")


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    calls: list = []
    ex = FakeExecutor()
    resumes: list[list[str]] = []
    monkeypatch.setattr(flodl_exp.tracking, "client", lambda uri: FakeClient(flodl_exp.tracking.live_uri(uri), calls))

    def create_run(uri: str, *a: Any, **k: Any) -> str:
        calls.append((uri, "create_run"))
        return "run0123456789"

    def validate_resume(cfg: Any) -> Resume:
        resumes.append(list(sys.path))
        return Resume(stem="/b/final", meta=BundleMeta(epoch=0, global_step=0, sync_round=0))

    monkeypatch.setattr(flodl_exp.tracking, "create_run", create_run)
    monkeypatch.setattr(flodl_exp.jobs.executor, "make_executor", lambda *a, **k: ex)
    monkeypatch.setattr(flodl_exp.checkpoint, "validate_resume", validate_resume)
    monkeypatch.delenv(URI_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lib = tmp_path / "mylib"  # an experiment path of the caller's PYTHONPATH: the resume check imports from it
    monkeypatch.setenv("PYTHONPATH", str(lib))
    return SimpleNamespace(calls=calls, ex=ex, resumes=resumes, lib=str(lib), jobs=str(tmp_path / "jobs"))


def test_launch_leaves_the_callers_environment_and_sys_path_as_they_were(fakes, tmp_path):
    cfg = compose([f"tracking.uri={FULL_URI}", f"run.job_root={fakes.jobs}", "checkpoint.resume_from=/b/final"])
    env_before, path_before = dict(os.environ), list(sys.path)
    h = launch(cfg, root=str(tmp_path))
    assert dict(os.environ) == env_before
    assert sys.path == path_before

    # the tasks: the credentialed URI in the submission's environment, the import paths in the spec, no secret in it
    assert fakes.ex.seen["env"] == FULL_URI
    text = open(fakes.ex.seen["spec_path"]).read()
    assert SECRET not in text
    spec = json.loads(text)
    assert spec["tracking_uri"] == "postgresql://user:***@db.invalid:5432/ml" == h.tracking_uri
    assert spec["import_paths"] == [str(tmp_path), fakes.lib]
    # the resume check ran with them importable, first
    assert fakes.resumes and fakes.resumes[0][:2] == [str(tmp_path), fakes.lib]
    # this process connects with the credentials, through the handle only
    assert fakes.calls and all(uri == FULL_URI for uri, _ in fakes.calls)
    h.client().set_tag(h.run_id, "k", "v")
    assert fakes.calls[-1] == (FULL_URI, "set_tag")
    for root, _, files in os.walk(h.job_dir):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert SECRET.encode() not in fh.read(), f


def test_a_uri_without_credentials_sets_no_variable(fakes, tmp_path):
    cfg = compose([f"tracking.uri=sqlite:///{tmp_path}/m.db", f"run.job_root={fakes.jobs}"])
    env_before, path_before = dict(os.environ), list(sys.path)
    launch(cfg, root=str(tmp_path))
    assert (dict(os.environ), sys.path) == (env_before, path_before)
    assert fakes.ex.seen["env"] is None and fakes.resumes == []


def test_a_caller_variable_is_restored_after_the_submission(fakes, tmp_path, monkeypatch):
    monkeypatch.setenv(URI_ENV, "postgresql://other:pw2@db2.invalid/x")
    cfg = compose([f"tracking.uri={FULL_URI}", f"run.job_root={fakes.jobs}"])
    launch(cfg, root=str(tmp_path))
    assert fakes.ex.seen["env"] == FULL_URI
    assert os.environ[URI_ENV] == "postgresql://other:pw2@db2.invalid/x"


# -- issue 30 item 1: the job is submitted before the MLflow run is created (the run's id follows in the job folder)


def test_the_job_is_submitted_before_the_run_is_created_and_its_id_follows_in_the_job_folder(fakes, tmp_path, monkeypatch):
    order: list[str] = []
    submit = fakes.ex.submit
    def submit_in_order(fn: Any, spec_path: str) -> Any:
        order.append("submit")
        return submit(fn, spec_path)

    monkeypatch.setattr(fakes.ex, "submit", submit_in_order)
    seen: dict[str, Any] = {}

    def create_run(uri: str, experiment: str, art: Any, name: str, params: Any, tags: dict, parent: Any) -> str:
        order.append("create_run")
        seen.update(tags=dict(tags), params=params, name=name, parent=parent)
        return "run0123456789"

    monkeypatch.setattr(flodl_exp.tracking, "create_run", create_run)
    cfg = compose([f"tracking.uri=sqlite:///{tmp_path}/m.db", f"run.job_root={fakes.jobs}"])
    h = launch(cfg, root=str(tmp_path), parent_run_id="parent42")
    assert order == ["submit", "create_run"]
    assert h.run_id == "run0123456789"
    # the submitted spec has no run id yet; the launcher published it beside it, where the tasks read it
    from flodl_exp.job_spec import JobSpec, read_run_id

    spec = JobSpec.load(os.path.join(h.job_dir, "spec.json"))
    assert spec.run_id == "" and read_run_id(h.job_dir) == "run0123456789"
    assert spec.with_run_id(0).run_id == "run0123456789"
    # every tag of the run at once: the config's, the job's (job_id, job_dir), the sweep's parent
    assert {"mode", "policy", "backend", "guard", "cluster", "world_size", "experiment", "outer"} <= set(seen["tags"])
    assert seen["tags"]["job_id"] == "4242" and seen["tags"]["job_dir"] == h.job_dir
    assert seen["parent"] == "parent42" and seen["params"]["seed"] == cfg.seed
    assert fakes.calls[-1][1] == "log_artifact"  # config.yaml, into the run once it exists


def test_a_run_that_cannot_be_created_after_the_submission_cancels_the_job_and_says_why(fakes, tmp_path, monkeypatch):
    from flodl_exp.job_spec import JobSpec, RunIdMissing

    def create_run(*a: Any, **k: Any) -> str:
        raise RuntimeError("the store is read-only")

    monkeypatch.setattr(flodl_exp.tracking, "create_run", create_run)
    cfg = compose([f"tracking.uri=sqlite:///{tmp_path}/m.db", f"run.job_root={fakes.jobs}"])
    with pytest.raises(RuntimeError, match="read-only"):
        launch(cfg, root=str(tmp_path))
    (job_dir,) = [os.path.join(fakes.jobs, d) for d in os.listdir(fakes.jobs)]
    spec = JobSpec.load(os.path.join(job_dir, "spec.json"))
    with pytest.raises(RunIdMissing, match="could not create the MLflow run: RuntimeError: the store is read-only"):
        spec.with_run_id(30)  # answered at once: the launcher said why, nobody waits out the timeout


def test_a_spec_without_a_run_id_waits_for_the_launchers(tmp_path):
    import threading

    from flodl_exp.job_spec import JobSpec, RunIdMissing, publish_run_id

    spec = JobSpec(config={"seed": 0}, run_id="", tracking_uri="sqlite:///x.db", job_dir=str(tmp_path),
                   checkpoint_stem=str(tmp_path / "final"), shuffle_seed=0)
    with pytest.raises(RunIdMissing, match="no MLflow run id"):
        spec.with_run_id(0)
    go = threading.Event()
    def publish_when_told() -> None:
        go.wait(30)
        publish_run_id(str(tmp_path), "abc")

    t = threading.Thread(target=publish_when_told)
    t.start()
    go.set()
    assert spec.with_run_id(60).run_id == "abc"  # waits for it, however long the publish takes (within the bound)
    t.join()
    assert JobSpec.from_dict(spec.to_dict()).run_id == ""  # spec.json keeps "" (the requeue's spec carries the id)
    assert spec.with_run_id(0).requeued(Resume(stem="/b", meta=BundleMeta(epoch=0, global_step=0, sync_round=0))).run_id == "abc"


def test_the_sink_keeps_records_until_the_run_id_is_there(monkeypatch):
    import threading

    calls: list = []
    monkeypatch.setattr(flodl_exp.tracking, "client", lambda uri: FakeRunClient(calls))
    go = threading.Event()

    def resolve() -> str:
        go.wait(60)
        return "late-run"

    sink = flodl_exp.tracking.MlflowSink("sqlite:///x.db", resolve)
    sink.set_tags({"a": 1})
    sink.log_metrics({"loss": 1.0}, step=0)
    assert sink.run_id == "" and not [c for c in calls if c[0] == "log_batch"]
    go.set()
    sink.close("FINISHED", timeout=60)
    assert sink.run_id == "late-run" and sink.lost == 0
    assert [c[1] for c in calls if c[0] == "log_batch"] == ["late-run", "late-run"]
    assert ("set_terminated", "late-run") in calls


class FakeRunClient:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        return lambda run_id, *a, **k: self.calls.append((name, run_id))


def test_a_task_leaves_without_the_interpreters_teardown_only_after_submitits_success(tmp_path, monkeypatch):
    """Issue 30 item 1: a task process ends with os._exit(0) once submitit pickled its success (skipping torch's
    teardown); an error pickle, an old pickle or a call in another program (here: pytest) keep the normal exit."""
    import pickle
    import time

    from flodl_exp.jobs import job

    registered: list = []
    monkeypatch.setattr(job.atexit, "register", registered.append)
    env = SimpleNamespace(paths=SimpleNamespace(result_pickle=tmp_path / "0_result.pkl"))
    assert job._leave_fast_after_success(env) == [] and registered == []  # not submitit's entry point: no hook
    p = str(tmp_path / "0_result.pkl")
    now = time.time()
    assert not job.submitit_succeeded(p, now)  # no pickle (the call raised, or the dump failed before the rename)
    with open(p, "wb") as fh:
        pickle.dump(("error", "Traceback ..."), fh)
    assert not job.submitit_succeeded(p, now)
    with open(p, "wb") as fh:
        pickle.dump(("success", {"rank": 0}), fh)
    assert job.submitit_succeeded(p, now)
    os.utime(p, (now - 3600, now - 3600))
    assert not job.submitit_succeeded(p, now)  # an earlier attempt's
