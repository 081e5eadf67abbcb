"""Issue 14 item 7: a failed save fails its bundle (no meta, recorded, the run not FINISHED on it), stale pieces
never mix with new ones, resume refuses a bundle with a missing piece, and a full disk never crashes the
event / record logs."""
from __future__ import annotations

import errno
import json
import os
from typing import Any

import pytest
import torch
from control_fakes import Harness, make_config, make_spec
from omegaconf import OmegaConf

from flodl_exp import checkpoint as ck
from flodl_exp.bundle_meta import BundleMeta
from flodl_exp.coordinator.event_log import EventLog
from flodl_exp.coordinator.records import RecordLog, RingLog
from flodl_exp.core.lifecycle import Phase, Status
from flodl_exp.events import Epoch
from flodl_exp.protocol.messages import EvalResult, SaveResult

ENOSPC = f"OSError: [Errno {errno.ENOSPC}] No space left on device"


def _stale_bundle(stem: str) -> None:
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    for path in (ck.model_path(stem), ck.optim_path(stem, 0, True), ck.optim_path(stem, 1, False), ck.meta_path(stem)):
        with open(path, "w") as fh:
            fh.write("old")


def test_an_enospc_on_a_rank_fails_the_final_bundle_no_meta_and_stale_pieces_are_gone(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    stem = h.co.core.writer.stem
    _stale_bundle(stem)  # a reused save_path: an earlier run's bundle sits there
    evals, saves = h.final_saves()
    assert saves and not any(os.path.exists(p) for p in ck.bundle_files(stem)), "stale pieces removed before the save"
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem, error=None if p.model else ENOSPC))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.phase is not Phase.FINISHING
    assert not os.path.exists(ck.meta_path(stem)), "a failed bundle gets no meta"
    assert "No space left" in h.co.core.writer.failed[stem]
    assert "No space left" in h.sink.tags["bundle_failed.final"]
    assert not [a for a in h.sink.artifacts if a[0].startswith(stem + ".")]


def test_a_failed_meta_write_fails_the_bundle(tmp_path, monkeypatch):
    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    stem = h.co.core.writer.stem
    evals, saves = h.final_saves()

    def full(*a: Any, **k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "write_meta", full)
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert "meta could not be written" in h.co.core.writer.failed[stem]
    assert stem not in h.co.core.writer.completed


def test_a_complete_bundle_lists_its_pieces(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    stem = h.co.core.writer.stem
    evals, saves = h.final_saves()
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.status is Status.FINISHED
    meta = json.loads(open(ck.meta_path(stem)).read())
    assert sorted(meta["pieces"]) == ["final.optim.pt", "final.optim.r1.pt", "final.pt"]


class _Closable:
    def __init__(self, sink: Any) -> None:
        self.sink, self.lost, self.status = sink, 0, None

    def __getattr__(self, k: str) -> Any:
        return getattr(self.sink, k)

    def close(self, status: Any = None, timeout: float = 0) -> None:
        self.status = status


class _Server:
    def close(self) -> None:
        pass


def test_a_failed_final_bundle_ends_the_run_failed_with_the_reason(tmp_path):
    from flodl_exp.config import load_config
    from flodl_exp.coordinator.main import _close

    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    evals, saves = h.final_saves()
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem, error=None if p.model else ENOSPC))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    spec = make_spec(make_config("cpu_sync", 2, 1), tmp_path)
    sink = _Closable(h.sink)
    rc = _close(h.co, spec, load_config(spec.config), str(tmp_path), sink, _Server(), "FINISHED", False)
    res = json.loads((tmp_path / "result.json").read_text())
    assert rc == 1 and sink.status == "FAILED"
    assert res["status"] == "FAILED" and "bundle" in res["failure"] and "No space left" in res["failure"]
    assert "No space left" in res["failed_bundles"][h.co.core.writer.stem]
    assert "No space left" in h.sink.tags["error"]


def test_save_rank_pieces_on_a_full_disk_leaves_no_piece(tmp_path, monkeypatch):
    def full(obj: Any, fh: Any) -> None:
        fh.write(b"PK\x03\x04partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OSError):
        ck.save_rank_pieces(str(tmp_path / "b"), model, opt, rank=0, primary=True, write_model=True)
    assert os.listdir(tmp_path) == []


def _real_bundle(stem: str) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck.save_rank_pieces(stem, model, opt, rank=0, primary=True, write_model=True)
    ck.save_rank_pieces(stem, model, opt, rank=1, primary=False, write_model=False)
    ck.write_meta(stem, BundleMeta(epoch=1, global_step=3, sync_round=1, world_size_at_save=2,
                                   pieces=("b.pt", "b.optim.pt", "b.optim.r1.pt")))


def test_resume_refuses_a_bundle_with_a_missing_optimizer_piece(tmp_path):
    from flodl_exp.config import Config, ConfigError

    stem = str(tmp_path / "b")
    _real_bundle(stem)
    assert ck.check_pieces(stem, ck.load_meta(stem)) is None
    os.unlink(ck.optim_path(stem, 1, False))
    assert "b.optim.r1.pt does not exist" in (ck.check_pieces(stem, ck.load_meta(stem)) or "")
    cfg = OmegaConf.structured(Config)
    cfg.cluster.ranks_per_node = 2
    cfg.checkpoint.resume_from = stem
    with pytest.raises(ConfigError, match=r"b\.optim\.r1\.pt does not exist") as e:
        ck.validate_resume(cfg)
    assert "\n" not in str(e.value)
    with open(ck.optim_path(stem, 0, True), "wb") as fh:
        fh.write(b"trunc")
    os.unlink(ck.meta_path(stem))
    ck.write_meta(stem, BundleMeta(epoch=1, global_step=3, sync_round=1, pieces=("b.pt", "b.optim.pt")))
    assert "b.optim.pt is unreadable" in (ck.check_pieces(stem, ck.load_meta(stem)) or "")


def test_the_requeue_path_refuses_a_bundle_with_a_missing_piece(tmp_path, monkeypatch):
    from flodl_exp.jobs import job

    stem = str(tmp_path / "b")
    _real_bundle(stem)
    os.unlink(ck.optim_path(stem, 1, False))
    failed: list[tuple[str, Any]] = []
    monkeypatch.setattr(job, "fail_run_if_running", lambda uri, run_id, why, tags=None: failed.append((why, tags)))
    live = {"spec": make_spec(make_config("cpu_sync", 2, 1), tmp_path), "job_dir": str(tmp_path), "attempt": 0}
    assert job.RunTask()._requeue_spec(live, {"stem": stem}, 1.0) is None
    assert len(failed) == 1 and "b.optim.r1.pt does not exist" in failed[0][0]
    assert not (tmp_path / "spec.attempt1.json").exists()


def test_event_and_record_logs_survive_a_full_disk(tmp_path, caplog):
    (tmp_path / "events.jsonl").mkdir()  # every append fails with an OSError, as on a full disk
    rec = RecordLog(str(tmp_path / "rl"), 1000)
    os.makedirs(tmp_path / "rl" / "root.log")
    log = EventLog(str(tmp_path), rec, lambda: 0.0)
    for i in range(3):
        log.emit(Epoch(epoch=i))
    assert log.dropped == 3 and rec.write_errors == 3
    ring = RingLog(str(tmp_path / "rl" / "root.log"), 100)
    ring.append({"x": "y" * 3})
    ring.append({"x": "y" * 3})
    assert ring.write_errors == 2
    assert sum("write failed" in r.getMessage() for r in caplog.records) == 3  # once per file
