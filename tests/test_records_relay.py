"""The records journal (records_journal.py): the coordinator writes its MLflow records to the job folder and the
launcher delivers them (records_relay.py) into a real SQLite store; a launcher that stops beating, or stops relaying,
or a journal that cannot be written, hands the delivery to the job's own sink process, and nothing is lost."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from flodl_exp import journal_sink, tracking
from flodl_exp.job_spec import JobSpec, publish_run_id
from flodl_exp.journal_sink import JournalSink, relayed_by_launcher
from flodl_exp.records_journal import JOURNAL_FILE, LEASE_FILE, TAKEN_FILE, read_lease, read_lines
from flodl_exp.records_relay import RecordsRelay

from conftest import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path) -> tuple[str, str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, "relay", str(tmp_path / "art"), "r", {"a": 1}, {})
    job = tmp_path / "job"
    job.mkdir()
    publish_run_id(str(job), run_id)
    return uri, run_id, str(job)


def _relayed(tmp_path, stale_s: float) -> tuple[str, str, str, RecordsRelay, JournalSink]:
    """A run with a launcher's relay beating (every 0.05 s) and the job's journal sink watching it."""
    uri, run_id, job = _run(tmp_path)
    return uri, run_id, job, RecordsRelay(job, uri, run_id, beat_s=0.05), JournalSink(uri, run_id, job, stale_s=stale_s)


def _freeze(relay: RecordsRelay) -> None:
    """The launcher stops (SIGSTOP, a crash): its relay's thread ends without a word in its lease."""
    relay._stop.set()
    assert relay._thread is not None
    relay._thread.join(10)


def _finished_journal(tmp_path) -> tuple[str, str, str, RecordsRelay]:
    """A job that logged one loss (2.0 at step 0) and closed FINISHED with a launcher beating (so the job left the
    delivery to it), and a relay without its thread that has delivered nothing yet."""
    uri, run_id, job = _run(tmp_path)
    sink = JournalSink(uri, run_id, job, stale_s=600.0)
    sink._beat_seen = time.monotonic() + 600
    sink.log_metrics({"loss": 2.0}, step=0)
    sink.close("FINISHED")
    return uri, run_id, job, RecordsRelay(job, uri, run_id, thread=False)


def _losses(uri: str, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in tracking.client(uri).get_metric_history(run_id, "loss"))


def test_only_complete_lines_are_read_and_an_unreadable_one_is_marked(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"kind": "tags", "payload": {"a": "1"}}\nnot json\n{"kind": "tags", "pay')
    lines, after = read_lines(str(path), 0)
    assert [line for _, line in lines] == [{"kind": "tags", "payload": {"a": "1"}}, None]
    assert after == lines[-1][0] == len(b'{"kind": "tags", "payload": {"a": "1"}}\nnot json\n')
    assert read_lines(str(path), after) == ([], after)  # the torn last line waits for its newline
    assert read_lines(str(tmp_path / "missing"), 7) == ([], 7)


def test_the_coordinator_relays_only_for_a_waiting_launcher_of_a_spec_that_knows_relays():
    assert relayed_by_launcher({"run": {"wait": True}, "tracking": {"relay": True}})
    assert not relayed_by_launcher({"run": {"wait": False}, "tracking": {"relay": True}})
    assert not relayed_by_launcher({"run": {"wait": True}, "tracking": {"relay": False}})
    assert not relayed_by_launcher({"run": {"wait": True}, "tracking": {}})  # an older launcher's spec


@pytest.mark.timeout(120)
def test_the_launcher_delivers_the_journal_and_the_job_waits_for_no_store(tmp_path):
    uri, run_id, job = _run(tmp_path)
    note = os.path.join(job, "note.txt")
    with open(note, "w") as fh:
        fh.write("hello")
    relay = RecordsRelay(job, uri, beat_s=0.05)  # started before the run exists, as the launcher does
    sink = JournalSink(uri, "", job, stale_s=60.0)
    sink.log_metrics({"loss": 2.0, "nan_metric": float("nan")}, step=0)
    sink.set_tags({"auto.choice": "cpu_async"})
    sink.log_artifact(note, "run")
    relay.set_run(run_id)
    wait_for(lambda: _losses(uri, run_id) == [(0, 2.0)], 60, "the first record delivered by the relay")
    sink.log_metrics({"loss": 1.0}, step=1)
    t0 = time.monotonic()
    sink.close("FINISHED", timeout=60)
    assert time.monotonic() - t0 < 2.0 and sink.relayed and sink.lost == 0
    assert not os.path.exists(os.path.join(job, TAKEN_FILE))
    relay.finish(60)
    assert relay.lost == 0 and relay.skipped == 0 and relay.delivered == 5 and not relay.taken
    c = tracking.client(uri)
    assert _losses(uri, run_id) == [(0, 2.0), (1, 1.0)]
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["auto.choice"] == "cpu_async"
    assert [a.path for a in c.list_artifacts(run_id, "run")] == ["run/note.txt"]
    lease = read_lease(job)
    assert lease is not None and lease["stopped"] and lease["offset"] == os.path.getsize(os.path.join(job, JOURNAL_FILE))


@pytest.mark.timeout(120)
def test_a_close_status_ends_the_run_once_what_came_before_is_delivered(tmp_path):
    """A launcher that never calls finish (a user's program that does not wait) still sees its run ended."""
    uri, run_id, job, relay, sink = _relayed(tmp_path, stale_s=60.0)
    sink.log_metrics({"loss": 3.0}, step=0)
    sink.close("KILLED")
    wait_for(lambda: tracking.client(uri).get_run(run_id).info.status == "KILLED", 60, "the run KILLED by the relay")
    assert _losses(uri, run_id) == [(0, 3.0)]
    relay.finish(30)


@pytest.mark.timeout(180)
def test_a_launcher_that_stops_beating_hands_the_delivery_to_the_job(tmp_path):
    """No beat for stale_s: the job claims the delivery and its sink process delivers the journal from where the
    relay stopped, then every record as it comes; the relay, back, delivers nothing more."""
    uri, run_id, job, relay, sink = _relayed(tmp_path, stale_s=1.0)
    sink.log_metrics({"loss": 3.0}, step=0)
    wait_for(lambda: _losses(uri, run_id) == [(0, 3.0)], 60, "the relay's delivery")
    wait_for(lambda: (read_lease(job) or {}).get("offset", 0) > 0, 30, "the lease to carry the delivered offset")
    _freeze(relay)  # the launcher frozen: no more beats, no more deliveries
    sink.log_metrics({"loss": 2.0}, step=1)
    wait_for(lambda: not sink.relayed, 60, "the job to take the delivery over")
    assert json.loads(open(os.path.join(job, TAKEN_FILE)).read())["from_offset"] > 0
    sink.log_metrics({"loss": 1.0}, step=2)
    relay.pump()  # the launcher back: it sees the claim and hands nothing on
    assert relay.taken
    sink.close("FINISHED", timeout=60)
    assert sink.lost == 0 and not sink.relayed
    assert _losses(uri, run_id) == [(0, 3.0), (1, 2.0), (2, 1.0)]  # the delivered prefix was not replayed
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"
    relay.finish(30)
    # a requeued attempt finds the claim: its sink delivers from the start, no relay waited for
    again = JournalSink(uri, run_id, job, stale_s=600.0)
    assert not again.relayed
    again.close(None, timeout=60)


@pytest.mark.timeout(180)
def test_a_close_without_a_recent_beat_delivers_through_the_job(tmp_path, monkeypatch):
    """The launcher died between two lease checks: the close sees no beat within CLOSE_FRESH_S and delivers itself."""
    monkeypatch.setattr(journal_sink, "BEAT_FRESH_S", 0.2)
    monkeypatch.setattr(journal_sink, "CLOSE_FRESH_S", 0.5)
    uri, run_id, job, relay, sink = _relayed(tmp_path, stale_s=600.0)
    wait_for(lambda: (read_lease(job) or {}).get("beat", 0) >= 3, 30, "the relay's beats")
    _freeze(relay)
    last = (read_lease(job) or {}).get("beat")
    wait_for(lambda: sink._beat == last, 30, "the sink to see the relay's last beat")
    time.sleep(0.3)  # now that beat is older than BEAT_FRESH_S (the relay is stopped: none comes)
    sink.log_metrics({"loss": 5.0}, step=0)
    assert sink.settle_delivery() is False  # the coordinator asks before it writes a model export request
    sink.close("FINISHED", timeout=60)
    assert sink.lost == 0 and _losses(uri, run_id) == [(0, 5.0)]
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"


@pytest.mark.timeout(180)
def test_a_relay_that_stops_hands_the_rest_to_the_job_at_once(tmp_path):
    uri, run_id, job, relay, sink = _relayed(tmp_path, stale_s=600.0)
    sink.log_metrics({"loss": 3.0}, step=0)
    wait_for(lambda: _losses(uri, run_id) == [(0, 3.0)], 60, "the relay's delivery")
    relay.finish(30, stopped=True)  # a launcher giving up on a job that goes on
    wait_for(lambda: not sink.relayed, 30, "the job to take the delivery over")
    sink.log_metrics({"loss": 2.0}, step=1)
    sink.close("FINISHED", timeout=60)
    assert _losses(uri, run_id) == [(0, 3.0), (1, 2.0)]


@pytest.mark.timeout(180)
def test_a_journal_that_cannot_be_written_hands_its_records_to_the_sink_process(tmp_path):
    uri, run_id, job = _run(tmp_path)
    os.mkdir(os.path.join(job, JOURNAL_FILE))  # opening it for appending fails, as a full disk's write would
    sink = JournalSink(uri, run_id, job, stale_s=600.0)
    sink.log_metrics({"loss": 4.0}, step=0)
    wait_for(lambda: not sink.relayed, 30, "the job to take the delivery over")
    sink.log_metrics({"loss": 3.0}, step=1)
    sink.close("FINISHED", timeout=60)
    assert sink.lost == 0 and _losses(uri, run_id) == [(0, 4.0), (1, 3.0)]


@pytest.mark.timeout(180)
def test_the_recovery_command_delivers_what_a_killed_launcher_left(tmp_path):
    uri, run_id, job = _run(tmp_path)
    spec = JobSpec(config={"seed": 0}, run_id="", tracking_uri=uri, job_dir=job, checkpoint_stem=os.path.join(job, "x"),
                   shuffle_seed=0)
    with open(os.path.join(job, "spec.json"), "w") as fh:
        json.dump(spec.to_dict(), fh)
    sink = JournalSink(uri, run_id, job, stale_s=600.0)
    sink._beat_seen = time.monotonic() + 600  # as if a launcher had just beaten (then was SIGKILLed)
    sink.log_metrics({"loss": 6.0}, step=0)
    sink.close("FINISHED", timeout=60)
    assert sink.relayed and _losses(uri, run_id) == []
    with open(os.path.join(job, LEASE_FILE), "w") as fh:
        json.dump({"beat": 9, "offset": 0, "stopped": False}, fh)
    out = subprocess.run([sys.executable, "-m", "flodl_exp.records_relay", job], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "delivered 1 record(s)" in out.stdout
    assert _losses(uri, run_id) == [(0, 6.0)]
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"


@pytest.mark.timeout(120)
def test_a_torn_last_line_of_a_killed_attempt_does_not_swallow_the_next_attempts_first_record(tmp_path):
    uri, run_id, job = _run(tmp_path)
    with open(os.path.join(job, JOURNAL_FILE), "wb") as fh:
        fh.write(b'{"kind": "metrics", "payload": [["loss", 9.0, 1, 0]]}\n{"kind": "tags", "pay')  # killed mid-write
    sink = JournalSink(uri, run_id, job, stale_s=600.0)
    sink._beat_seen = time.monotonic() + 600  # a launcher that beats (its relay reads the journal below)
    sink.log_metrics({"loss": 1.0}, step=1)
    sink.close(None)
    lines, _ = read_lines(os.path.join(job, JOURNAL_FILE), 0)
    assert [line is None for _, line in lines] == [False, True, False, False]  # record, fragment, record, close
    assert lines[2][1] is not None and lines[2][1]["payload"][0][:2] == ["loss", 1.0]


@pytest.mark.timeout(120)
def test_a_finish_cut_short_by_ctrl_c_is_completed_by_the_next_call(tmp_path):
    """Ctrl-C while the relay delivers its last records: the launcher's shutdown calls finish again, which
    delivers them and applies the coordinator's status (the run must not be marked KILLED for it)."""
    uri, run_id, job, relay = _finished_journal(tmp_path)
    relay.pump()
    real_close = relay._sink.close
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_close(*a, **k)

    relay._sink.close = interrupted
    relay._status = "FINISHED"  # the close line's status, not yet applied when Ctrl-C came
    with pytest.raises(KeyboardInterrupt):
        relay.finish(30)
    relay.finish(30)
    assert _losses(uri, run_id) == [(0, 2.0)]
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"
    assert (read_lease(job) or {}).get("stopped") is True


@pytest.mark.timeout(120)
def test_the_lease_keeps_a_close_line_whose_status_is_not_applied_yet(tmp_path, monkeypatch):
    """The store refuses the run's end: the lease's offset stays before the close line, so a recovery from it still
    ends the run."""
    uri, run_id, job, relay = _finished_journal(tmp_path)
    import flodl_exp.tracking as tr

    real = tr.client

    class Refusing:
        def __init__(self, c):
            self.c = c

        def set_terminated(self, *a, **k):
            raise RuntimeError("store down")

        def __getattr__(self, name):
            return getattr(self.c, name)

    monkeypatch.setattr(tr, "client", lambda u: Refusing(real(u)))
    with pytest.raises(RuntimeError):
        for _ in range(600):
            relay.pump()
            time.sleep(0.05)
    size = os.path.getsize(os.path.join(job, JOURNAL_FILE))
    close_len = len(b'{"close": {"status": "FINISHED"}}\n')
    assert relay._delivered_offset == size - close_len
    monkeypatch.setattr(tr, "client", real)
    relay.finish(30)
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"
