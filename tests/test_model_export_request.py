"""The model export's request: written by the coordinator, found from a job folder (claimed or not) when it is run by
hand, and the store it logs to (the launcher's URI, MLflow's variable, else the job's own spec)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flodl_exp.model_export import EXPORT_REQUEST, URI_ENV, request_of, store_of, write_export_request


def test_the_request_is_owner_only_and_found_from_its_job_folder(tmp_path: Path) -> None:
    path = write_export_request(str(tmp_path), "run1", "/x/final", {"model": {"_target_": "m.Net"}}, ["/proj"])
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert json.loads(Path(path).read_text()) == {"run_id": "run1", "stem": "/x/final",
                                                  "experiment": {"model": {"_target_": "m.Net"}}, "import_paths": ["/proj"]}
    assert request_of(str(tmp_path)) == path and request_of(path) == path
    os.replace(path, path + ".claimed")  # the launcher claimed it and its export failed: run again by hand
    assert request_of(str(tmp_path)) == path + ".claimed"


def test_a_job_folder_without_a_request_says_why(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=EXPORT_REQUEST):
        request_of(str(tmp_path))


def test_the_store_is_the_launchers_then_mlflows_then_the_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    req = write_export_request(str(tmp_path), "r", "/s", {}, [])
    (tmp_path / "spec.json").write_text(json.dumps({"tracking_uri": "sqlite:///spec.db"}))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(URI_ENV, "http://u:pw@host")
    assert store_of(req) == "http://u:pw@host" and URI_ENV not in os.environ  # taken out of the environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert store_of(req) == "sqlite:///env.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert store_of(req) == "sqlite:///spec.db"
