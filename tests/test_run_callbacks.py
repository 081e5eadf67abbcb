"""The launcher's user callbacks (the reference's builder hooks ``metrics_fn`` / ``eval_result_fn``): called in the
launching process as the run's events arrive, in order, once each; a callback that raises is called again for the
next event (as the reference's are), its error printed once and counted at the end, and the run goes on."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from flodl_exp.jobs.launcher import RunHandle


class _Job:
    job_id = "1"
    num_tasks = 1

    def done(self) -> bool:
        return False


def _handle(tmp_path: Path, **callbacks: Any) -> RunHandle:
    cfg = OmegaConf.create({"cluster": {"executor": "local"}})
    return RunHandle(cfg=cfg, run_id="r", tracking_uri="sqlite:///x.db", job_dir=str(tmp_path), job=_Job(),
                     stem=str(tmp_path / "final"), **callbacks)


def _append(tmp_path: Path, *events: dict[str, Any]) -> None:
    with open(tmp_path / "events.jsonl", "a") as fh:
        for ev in events:
            fh.write(json.dumps(ev) + "\n")


def test_metrics_and_eval_callbacks_see_each_epoch_and_eval_once_in_order(tmp_path: Path) -> None:
    epochs: list[tuple[int, dict[str, float]]] = []
    evals: list[tuple[int, dict[str, float]]] = []
    h = _handle(tmp_path, metrics_fn=lambda e, m: epochs.append((e, m)), eval_result_fn=lambda e, m: evals.append((e, m)))
    _append(tmp_path, {"event": "started", "world_size": 2, "t": 0.1},
            {"event": "epoch", "epoch": 0, "loss": 0.9, "samples": 1408.0, "t": 1.0, "wall": 5.0},
            {"event": "eval", "epoch": 0, "final": False, "eval/accuracy": 0.8, "t": 1.2})
    assert [e["event"] for e in h.poll_events()] == ["started", "epoch", "eval"]
    _append(tmp_path, {"event": "epoch", "epoch": 1, "loss": 0.5, "samples": 1408.0, "t": 2.0},
            {"event": "eval", "epoch": 1, "final": True, "eval/accuracy": 0.9, "t": 2.5})
    assert h.next_metrics(timeout=1.0) is not None
    h.poll_events()
    assert epochs == [(0, {"loss": 0.9, "samples": 1408.0}), (1, {"loss": 0.5, "samples": 1408.0})]
    assert evals == [(0, {"eval/accuracy": 0.8}), (1, {"eval/accuracy": 0.9, "final": 1.0})]


def test_a_callback_that_raises_is_called_again_and_its_error_reported_once(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []

    def boom(e: int, m: dict[str, float]) -> None:
        calls.append(e)
        raise ValueError("bad plot")

    h = _handle(tmp_path, metrics_fn=boom)
    _append(tmp_path, {"event": "epoch", "epoch": 0, "loss": 0.9}, {"event": "epoch", "epoch": 1, "loss": 0.5})
    assert len(h.poll_metrics()) == 2
    err = capsys.readouterr().err
    assert calls == [0, 1], "called again for the next epoch"
    assert err.count("metrics_fn raised ValueError: bad plot (epoch 0") == 1 and "(epoch 1" not in err
