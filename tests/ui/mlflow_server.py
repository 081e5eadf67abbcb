"""Start a real ``mlflow server`` on loopback for a test, and its small REST client (stdlib only)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ui.cdp import group_alive, kill_group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server --workers 1`` over a SQLite store, in its own process group.

    Started with ``start_new_session=True``: the CLI spawns uvicorn (and, without
    ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``, a job runner), so ``stop()`` ends the whole group.
    """

    def __init__(self, backend_uri: str, workdir: Path, health_timeout: float = 90, attempts: int = 3) -> None:
        self.backend_uri, self.workdir = backend_uri, workdir
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mlflow-server.log"
        self.startup_s = 0.0
        errors = []
        for _ in range(attempts):  # a free port can be taken between probe and bind: retry on a new one
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            t0 = time.monotonic()
            self._start()
            err = self._wait_healthy(health_timeout)
            if err is None:
                self.startup_s = time.monotonic() - t0
                return
            self.stop()
            errors.append(err)
            if "did not answer" in err:  # a slow server, not a port clash: retrying would only double the wait
                break
        raise RuntimeError("mlflow server did not start:\n" + "\n".join(errors))

    def _start(self) -> None:
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true",
                   DO_NOT_TRACK="true")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend_uri,
                 "--default-artifact-root", str(self.workdir / "server-artifacts"),
                 "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        finally:
            log.close()

    def _wait_healthy(self, timeout: float) -> str | None:
        assert self.proc is not None, "started first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode} on port {self.port}; log tail:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return f"/health did not answer within {timeout:.0f} s on port {self.port}; log tail:\n{self.log_tail()}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)

    def alive(self) -> bool:
        return self.proc is not None and (self.proc.poll() is None or group_alive(self.proc.pid))

    # -- REST ----------------------------------------------------------------------------------------
    def get(self, path: str, **params: Any) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=30) as r:
            return json.load(r)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)

    def search_runs(self, experiment_id: str) -> list[dict]:
        runs, token = [], None
        while True:
            body: dict[str, Any] = {"experiment_ids": [experiment_id], "max_results": 1000}
            if token:
                body["page_token"] = token
            page = self.post("/api/2.0/mlflow/runs/search", body)
            runs += page.get("runs", [])
            token = page.get("next_page_token")
            if not token:
                return runs

    def metric_history(self, run_id: str, key: str) -> list[dict]:
        return self.get("/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])


def tags_of(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run.get("data", {}).get("tags", [])}
