"""pytest plugin of the GPU check (tests/gpu/check.sh loads it: ``-p gpu_check``): time by design, said plainly.

* Each test's ``timeout`` mark (pytest-timeout) is its budget: the estimate of what it needs on one GPU, with
  room for a cold start. At collection the plugin prints how many tests run and what their budgets add up to.
* After each test, one line: the seconds it took against its budget, and its outcome.
* ``GPU_CHECK_LIMIT_S`` (default: the budgets' sum) caps the whole run: once it is spent, the remaining tests
  are skipped with that reason instead of being cut off mid-run.
* At the end, one line a human can read (``GPU check: 21 passed, 0 failed, 6 skipped in 312 s on 1 x NVIDIA
  H200, torch 2.6.0``), also written to ``$GPU_CHECK_SUMMARY`` when set (check.sh prints it last).

Not a conftest.py: tests/conftest.py's helpers are imported as ``conftest``, and a second conftest.py here
would take that name.
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest

LIMIT_ENV = "GPU_CHECK_LIMIT_S"
SUMMARY_ENV = "GPU_CHECK_SUMMARY"
DEFAULT_BUDGET_S = 300.0
"""A test without a ``timeout`` mark: pyproject's pytest-timeout default."""

_state: dict[str, Any] = {"t0": time.monotonic(), "budgets": {}, "limit": None}


def _budget(item: pytest.Item) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0])
    try:
        return float(item.config.getini("timeout") or DEFAULT_BUDGET_S)
    except ValueError:
        return DEFAULT_BUDGET_S


def _device() -> str:
    try:
        import torch

        if not torch.cuda.is_available():
            return f"no CUDA device, torch {torch.__version__}"
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    except Exception as e:
        return f"device unknown ({type(e).__name__})"


def pytest_sessionstart(session: pytest.Session) -> None:
    _state["t0"] = time.monotonic()


def pytest_collection_finish(session: pytest.Session) -> None:
    items, config = session.items, session.config  # after -k / -m deselection
    budgets = {it.nodeid: _budget(it) for it in items}
    _state["budgets"] = budgets
    total = sum(budgets.values())
    env = os.environ.get(LIMIT_ENV, "").strip()
    _state["limit"] = float(env) if env else total
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"GPU check: {len(items)} tests, their budgets (timeout marks) add up to {total:.0f} s; "
                      f"overall limit {_state['limit']:.0f} s ({LIMIT_ENV})")


def pytest_runtest_setup(item: pytest.Item) -> None:
    spent = time.monotonic() - _state["t0"]
    limit = _state["limit"]
    if limit is not None and spent > limit:
        pytest.skip(f"the GPU check's overall limit ({limit:.0f} s, {LIMIT_ENV}) is spent")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    done = report.when == "call" or (report.when == "setup" and not report.passed)
    if not done:
        return
    budget = _state["budgets"].get(report.nodeid, DEFAULT_BUDGET_S)
    line = f"  {report.duration:6.1f} s of {budget:4.0f} s  {report.outcome:7s} {report.nodeid}"
    print(("\n" if report.when == "call" else "") + line, flush=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    stats = terminalreporter.stats

    def count(key: str) -> int:
        return len([r for r in stats.get(key, []) if key != "passed" or getattr(r, "when", "call") == "call"])

    elapsed = time.monotonic() - _state["t0"]
    line = (f"GPU check: {count('passed')} passed, {count('failed')} failed, {count('skipped')} skipped"
            + (f", {count('error')} errors" if count("error") else "")
            + f" in {elapsed:.0f} s on {_device()}")
    terminalreporter.write_line(line)
    path = os.environ.get(SUMMARY_ENV)
    if path:
        try:
            with open(path, "w") as fh:
                fh.write(line + "\n")
        except OSError:
            pass
