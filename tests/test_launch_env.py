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
