"""The typed values that cross a file or process boundary as JSON: the job spec, the rank's hello, the bundle meta.

Each round-trips through its JSON form, reads what older writers wrote, and refuses a missing or bad key with
one line naming it.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from control_fakes import SAMPLES, FakeSink, FakeTransport, Harness, make_config, make_spec

from flodl_exp import checkpoint as ck
from flodl_exp.bundle_meta import META_SCHEMA_VERSION, BundleMeta, MetaCoverage, Resume
from flodl_exp.coordinator.coordinator import Coordinator
from flodl_exp.core.lifecycle import Status
from flodl_exp.devices import RankDevice
from flodl_exp.job_spec import JobSpec
from flodl_exp.json_fields import FieldError
from flodl_exp.protocol.hello import Hello, HelloError
from flodl_exp.protocol.messages import EvalResult, SaveResult


def _json(d: Any) -> Any:
    return json.loads(json.dumps(d))


def _one_line(e: pytest.ExceptionInfo[BaseException], *words: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------- the job spec
META = BundleMeta(epoch=2, global_step=40, sync_round=7, world_size_at_save=2, save_reason="preempted",
                  unix_time=1.5, experiment="digits", total_picks=960, elche_state={"anchor": 3.0}, guard_kind="none",
                  guard_state={}, coverage=MetaCoverage(seed=42, algorithm="pcg64", batch_size=32,
                                                         per_epoch=({"epoch": 2, "total_samples": 960},)),
                  pieces=("final.pt", "final.optim.pt"))


def _spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = dict(config={"seed": 5, "cluster": {"executor": "local"}, "experiment": {"loop": None}},
                                run_id="abc123", tracking_uri="postgresql://user:***@db.invalid/ml", job_dir="/j",
                                checkpoint_stem="/j/checkpoints/final", shuffle_seed=5, import_paths=("/src",),
                                cuda_visible_devices="0,1")
    return JobSpec(**{**base, **kw})


def test_the_job_spec_round_trips_through_spec_json():
    for spec in (_spec(), _spec(resume=Resume("/b/final", META)).requeued(Resume("/b/pre", META))):
        assert JobSpec.from_dict(_json(spec.to_dict())) == spec
    fresh = _spec().to_dict()
    assert set(fresh) == {"config", "run_id", "tracking_uri", "job_dir", "checkpoint_stem", "shuffle_seed", "resume",
                          "import_paths", "cuda_visible_devices"}, "the keys the launcher always wrote"
    nxt = _spec().requeued(Resume("/b/pre", META))
    assert nxt.attempt == 1 and nxt.to_dict()["attempt"] == 1 and nxt.to_dict()["resume"]["meta"]["global_step"] == 40
    assert nxt.requeued(Resume("/b/pre2", META)).attempt == 2


def test_an_older_spec_json_reads():
    """Before shuffle_seed, attempt, import_paths and cuda_visible_devices were written: the config's seed, 0, none."""
    old = {"config": {"seed": 9, "cluster": {}}, "run_id": "r", "tracking_uri": "sqlite:///m.db", "job_dir": "/j",
           "checkpoint_stem": "/j/c", "resume": None}
    spec = JobSpec.from_dict(old)
    assert (spec.shuffle_seed, spec.attempt, spec.import_paths, spec.cuda_visible_devices, spec.resume) == (9, 0, (), None,
                                                                                                         None)
    assert spec.experiment_loop is None
    assert _spec(config={"seed": 1, "experiment": {"loop": "m.main"}}).experiment_loop == "m.main"


@pytest.mark.parametrize("key", ["config", "run_id", "tracking_uri", "job_dir", "checkpoint_stem"])
def test_a_spec_without_a_required_key_is_refused_naming_it(key):
    d = _spec().to_dict()
    del d[key]
    with pytest.raises(FieldError) as e:
        JobSpec.from_dict(d)
    _one_line(e, f"job spec {key} is missing")


@pytest.mark.parametrize(("key", "value", "words"), [
    pytest.param("attempt", "1", ["job spec attempt '1' is not a non-negative int"], id="attempt-str"),
    pytest.param("attempt", -1, ["job spec attempt -1"], id="attempt-negative"),
    pytest.param("run_id", 7, ["job spec run_id 7 is not a str"], id="run-id-int"),
    pytest.param("config", [], ["job spec config a list is not an object"], id="config-list"),
    pytest.param("import_paths", ["/a", 3], ["job spec import_paths[1] 3 is not a str"], id="import-path-int"),
    pytest.param("shuffle_seed", 1.5, ["job spec shuffle_seed 1.5"], id="seed-float"),
    pytest.param("resume", {"stem": "/b", "meta": {"schema_version": 1, "epoch": 1, "sync_round": 0}},
                 ["job spec resume /b: bundle meta global_step is missing"], id="resume-meta-key"),
    pytest.param("resume", {"meta": {}}, ["job spec resume stem is missing"], id="resume-stem"),
])
def test_a_spec_with_a_bad_value_is_refused_naming_the_key(key, value, words):
    d = dict(_spec().to_dict(), **{key: value})
    with pytest.raises(FieldError) as e:
        JobSpec.from_dict(d)
    _one_line(e, *words)


def test_a_spec_never_holds_credentials():
    with pytest.raises(ValueError, match="job spec tracking_uri holds credentials"):
        _spec(tracking_uri="postgresql://user:hunter2@db.invalid/ml")
    with pytest.raises(ValueError, match=r"job spec config\.tracking\.uri holds credentials"):
        _spec(config={"seed": 1, "tracking": {"uri": "https://h.invalid/?token=s3cret"}})
    assert _spec(tracking_uri="postgresql://user:***@db.invalid/ml").tracking_uri.endswith("/ml")


def test_load_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({k: v for k, v in _spec().to_dict().items() if k != "run_id"}))
    with pytest.raises(ValueError) as e:
        JobSpec.load(str(path))
    _one_line(e, str(path), "job spec run_id is missing")
    path.write_text("{not json")
    with pytest.raises(ValueError) as e:
        JobSpec.load(str(path))
    _one_line(e, str(path), "not a readable job spec")
    path.write_text(json.dumps(_spec().to_dict()))
    assert JobSpec.load(str(path)) == _spec()


# ---------------------------------------------------------------- the hello
def test_the_hello_round_trips_through_the_handshake_fields():
    hello = Hello(rank=1, host="n1", pid=42, device="cuda:0", device_uuid="GPU-1", device_score=92.0, model_bytes=10,
                  samples=60000, inputs=({"name": "training", "digest": "ab"},))
    assert Hello.from_dict(_json(hello.to_dict()), world_size=2) == hello
    assert Hello.from_dict(_json(Hello(rank=0).to_dict())) == Hello(rank=0)
    assert Hello.from_dict({"rank": 0, "samples": 3, "device_score": 7}).device_score == 7.0  # JSON: one number type
    assert RankDevice.of(1, hello) == RankDevice(rank=1, host="n1", device="cuda:0", uuid="GPU-1", score=92.0)
    assert RankDevice.of(0, Hello(rank=0)) == RankDevice(rank=0, host="unknown", device="cpu")


@pytest.mark.parametrize(("fields", "words"), [
    pytest.param({}, ["hello rank is missing"], id="rank-missing"),
    pytest.param({"rank": 3}, ["hello rank 3 is not an int in [0, 2)"], id="rank-range"),
    pytest.param({"rank": 0, "samples": -2}, ["hello samples -2 is not a non-negative int"], id="samples"),
    pytest.param({"rank": 0, "device_score": "fast"}, ["hello device_score 'fast' is not a finite number"], id="score"),
    pytest.param({"rank": 0, "inputs": [{}, 2]}, ["hello inputs[1] 2 is not an object"], id="inputs"),
    pytest.param([0], ["hello is not an object"], id="not-an-object"),
])
def test_a_bad_hello_is_refused_naming_the_key(fields, words):
    with pytest.raises(HelloError) as e:
        Hello.from_dict(fields, world_size=2)
    _one_line(e, *words)


def test_the_coordinator_reads_the_typed_hello(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=2)
    h.co.on_event(("join", 0, Hello(rank=0, host="n0", pid=5, samples=SAMPLES, inputs=({"name": "training"},))))
    assert h.co.total_picks == SAMPLES and h.co.records.hosts[0] == "n0" and h.co.devices[0].device == "cpu"
    assert h.sink.inputs == [{"name": "training"}]
    with open(h.co.events.path) as fh:
        joined = [e for e in map(json.loads, fh) if e.get("event") == "joined"]
    assert [(e["rank"], e["pid"], e["host"], e["device"]) for e in joined] == [(0, 5, "n0", None)]


# ---------------------------------------------------------------- the bundle meta
def test_the_meta_round_trips():
    assert BundleMeta.from_dict(_json(META.to_dict())) == META
    m = BundleMeta(epoch=0, global_step=0, sync_round=0)
    assert m.to_dict() == {"epoch": 0, "global_step": 0, "sync_round": 0, "schema_version": META_SCHEMA_VERSION}
    assert BundleMeta.from_dict(m.to_dict()) == m and m.coverage_seed is None and META.coverage_seed == 42
    assert Resume.from_dict(_json(Resume("/b", META).to_dict())) == Resume("/b", META)


def test_the_writers_meta_reads_back_as_written_and_resumes_a_coordinator(tmp_path):
    """The bundle writer's BundleMeta (core/checkpoints.py, through checkpoint.write_meta) is what load_meta reads;
    a coordinator built on a spec resuming from it restores its counters."""
    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    stem = h.co.core.writer.stem
    evals, saves = h.final_saves()
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.status is Status.FINISHED
    with open(ck.meta_path(stem)) as fh:
        raw = json.load(fh)
    meta = ck.load_meta(stem)
    assert meta.extra == {}, "every key the writer writes has a field"
    assert meta.to_dict() == {k: v for k, v in raw.items() if v is not None}
    assert (meta.epoch, meta.world_size_at_save, meta.save_reason, meta.coverage_seed) == (1, 2, "completed", 42)
    assert meta.pieces is not None and meta.total_picks == SAMPLES
    spec = make_spec(make_config("cpu_sync", 2, 2), tmp_path / "next", attempt=1, resume=Resume(stem, meta))
    co = Coordinator(spec, FakeTransport(), None, FakeSink(), str(tmp_path), clock=h.clock)  # type: ignore[arg-type]
    assert co.core.cycle.global_step == meta.global_step and co.result()["resumed_from"] == stem


def test_an_old_meta_reads_and_a_newer_schema_does_not(tmp_path):
    """The first metas: the experiment under ``model``, no pieces, picks, guard kind or time."""
    old = {"schema_version": 1, "epoch": 1, "global_step": 12, "sync_round": 3, "world_size_at_save": 2,
           "save_reason": "at_epoch", "model": "digits", "elche_state": None, "guard_state": {"trend_history": []},
           "coverage": {"seed": 42, "algorithm": "pcg64", "batch_size": 32, "per_epoch": []}}
    meta = BundleMeta.from_dict(old)
    assert meta.extra == {"model": "digits"} and meta.pieces is None and meta.total_picks is None
    assert meta.to_dict() == {k: v for k, v in old.items() if v is not None}
    stem = str(tmp_path / "b")
    with open(ck.model_path(stem), "wb") as fh:
        fh.write(b"PK\x03\x04rest")
    assert ck.check_pieces(stem, meta) is None, "a meta without pieces: only the model piece is checked"
    with pytest.raises(FieldError) as e:
        BundleMeta.from_dict(dict(old, schema_version=META_SCHEMA_VERSION + 1))
    _one_line(e, f"schema_version {META_SCHEMA_VERSION + 1} is newer than supported ({META_SCHEMA_VERSION})")
    with pytest.raises(FieldError) as e:
        BundleMeta.from_dict({k: v for k, v in old.items() if k != "schema_version"})
    _one_line(e, "not a flodl_exp bundle meta")


@pytest.mark.parametrize(("change", "words"), [
    pytest.param({"global_step": None}, ["bundle meta global_step is missing"], id="global-step-missing"),
    pytest.param({"sync_round": None}, ["bundle meta sync_round is missing"], id="sync-round-missing"),
    pytest.param({"epoch": "1"}, ["bundle meta epoch '1' is not a non-negative int"], id="epoch-str"),
    pytest.param({"pieces": ["a.pt", 2]}, ["bundle meta pieces[1] 2 is not a str"], id="pieces"),
    pytest.param({"coverage": {"seed": "x"}}, ["bundle meta coverage seed 'x'"], id="coverage-seed"),
    pytest.param({"elche_state": [1]}, ["bundle meta elche_state a list is not an object"], id="elche-state"),
    pytest.param({"world_size_at_save": 0}, ["bundle meta world_size_at_save 0"], id="world-size"),
])
def test_a_bad_meta_is_refused_naming_the_key(change, words, tmp_path):
    d = {k: v for k, v in dict(META.to_dict(), **change).items() if v is not None}
    with pytest.raises(FieldError) as e:
        BundleMeta.from_dict(d)
    _one_line(e, *words)
    stem = str(tmp_path / "b")
    with open(ck.meta_path(stem), "w") as fh:
        json.dump(d, fh)
    with pytest.raises(ValueError) as loaded:
        ck.load_meta(stem)
    _one_line(loaded, f"checkpoint.resume_from={stem!r}", ck.meta_path(stem), *words)


def test_a_resume_adopts_the_bundles_shuffle_seed() -> None:
    """The reference's resolve_shuffle_seed: the resumed epochs see the permutation the bundle's coverage was
    recorded in, whatever this run's ``seed``; a line says so when they differ."""
    from flodl_exp.bundle_meta import resolve_shuffle_seed

    meta = BundleMeta.from_dict({"epoch": 1, "global_step": 10, "sync_round": 2, "schema_version": META_SCHEMA_VERSION,
                                 "coverage": {"seed": 7, "algorithm": "x", "batch_size": 32, "per_epoch": []}})
    assert resolve_shuffle_seed(7, meta) == (7, None)
    seed, line = resolve_shuffle_seed(8, meta)
    assert seed == 7 and line is not None and "seed=7" in line and "seed=8" in line
    assert resolve_shuffle_seed(8, None) == (8, None)
