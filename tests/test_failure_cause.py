"""flodl_exp/failure_cause.py: the user's innermost frame, the blamed rank and the one line a failed run prints."""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest

from flodl_exp import failure_cause as fc


def _user_module(tmp_path: Path, name: str, body: str) -> dict:
    """Compile ``body`` as a file of the user's (outside every framework root) and return its namespace."""
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    ns: dict = {"__name__": name}
    exec(compile(body, str(path), "exec"), ns)
    return ns


USER = '''\
def get_batch(ids):
    helper()


def helper():
    raise ValueError("bad sample 7\\nsecond line")
'''


def test_the_innermost_user_frame_is_named_not_the_frameworks(tmp_path: Path) -> None:
    ns = _user_module(tmp_path, "my_model", USER)
    from flodl_exp.experiment import fetch_batch  # a flodl_exp frame between the user's and the raise site

    class DS:
        def get_batch(self, ids: object) -> None:
            ns["get_batch"](ids)

    with pytest.raises(ValueError) as err:
        fetch_batch(DS(), [1])
    told = fc.user_error(err.value)
    assert told.error == "ValueError: bad sample 7"
    assert told.frame == "my_model.py:6 in helper"  # the innermost user frame, not the test's DS nor flodl_exp's


def test_a_framework_error_wrapping_the_users_is_told_as_the_users(tmp_path: Path) -> None:
    ns = _user_module(tmp_path, "my_data", USER)
    try:
        try:
            ns["get_batch"]([1])
        except ValueError as e:
            raise RuntimeError("the data pipeline failed") from e
    except RuntimeError as outer:
        told = fc.user_error(outer)
    assert told == fc.UserError("ValueError: bad sample 7", "my_data.py:6 in helper")


def test_an_error_that_never_touched_user_code_has_no_frame() -> None:
    import json as stdlib_json

    with pytest.raises(ValueError) as err:
        stdlib_json.loads("{")
    told = fc.user_error(err.value, roots=fc.framework_roots() + (os.path.join(os.path.dirname(__file__), ""),))
    assert told.frame is None and told.error.startswith("JSONDecodeError: ")


def test_framework_roots_cover_flodl_exp_torch_submitit_hydra_and_the_stdlib() -> None:
    import hydra
    import submitit
    import torch

    for mod in (fc, torch, submitit, hydra, traceback):
        assert fc.is_framework_file(str(mod.__file__)), mod
    assert fc.is_framework_file("<frozen importlib._bootstrap>")
    assert not fc.is_framework_file(__file__)  # the tests are nobody's framework: a user's file
    assert not fc.is_framework_file("/tmp/proj/my_model.py", roots=("/usr/lib/python3.11/",))


def test_a_chain_that_loops_ends() -> None:
    a, b = ValueError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert fc.user_error(a, roots=("/",)).frame is None


@pytest.mark.parametrize("failure,deaths,rank", [
    ("rank 1 was lost before training started: its process 9 on vm exited; after it, rank 2 failed: closed", [], 1),
    ("single_survivor: rank 1 connection closed: ValueError: bad sample 7", [{"rank": 0}], 1),
    ("ranks [1] did not connect within 60s", [], None),
    (None, [{"rank": 2}, {"rank": 0}], 2),
    ("coordinator crashed: KeyError: 'x'\nrank 3 later", [], None),  # only the first line names the cause
])
def test_the_blamed_rank_is_the_first_the_failure_names(failure: str, deaths: list, rank: int) -> None:
    assert fc.blamed_rank(failure, deaths) == rank


def test_the_headline_tells_the_blamed_ranks_own_record() -> None:
    records = {0: {"error": "ValueError: bad sample 7", "user_error": "ValueError: bad sample 7",
                   "user_frame": "my_model.py:31 in get_batch", "traceback_path": "/j/ranks/rank0.traceback"},
               1: {"error": "CoordinatorLost: closed"}}
    line = fc.headline("single_survivor: rank 0 connection closed: ValueError: bad sample 7", [], records, "x")
    assert line == ("rank 0 failed: ValueError: bad sample 7 at my_model.py:31 in get_batch "
                    "(full traceback: /j/ranks/rank0.traceback)")


def test_a_killed_rank_is_told_by_the_coordinators_line_and_its_log() -> None:
    logs = {1: "/j/submitit/7_1_log.err"}
    lost = fc.headline("rank 1 was lost before training started: its process 9 on vm exited before it connected\nmore",
                       [], {2: {"error": "closed"}}, "submitit text", rank_logs=logs)
    assert lost == ("rank 1 was lost before training started: its process 9 on vm exited before it connected "
                    "(its log: /j/submitit/7_1_log.err)")
    mid = fc.headline("single_survivor: rank 1 connection closed", [{"rank": 1}], {}, "", rank_logs=logs)
    assert mid == "rank 1 was lost: single_survivor: rank 1 connection closed (its log: /j/submitit/7_1_log.err)"


SUBMITIT = '''FailedJobError: Job (task=0) failed during processing with trace:
----------------------
Traceback (most recent call last):
  File "/venv/site-packages/submitit/core/submission.py", line 55, in process_job
    result = delayed.result()
             ^^^^^^^^^^^^^^^^
  File "/src/flodl_exp/jobs/job.py", line 308, in _task0_outcome
RuntimeError: coordinator failed (exit code -9: killed by SIGKILL):
2026-12-05 07:58:30 coordinator INFO listening on 127.0.0.1:4000

----------------------
You can check full logs with 'job.stderr(0)' and 'job.stdout(0)'or at paths:
  - /j/submitit/1_0_log.err
'''


def test_without_a_coordinators_word_the_tasks_error_line_is_told_with_the_coordinators_log() -> None:
    line = fc.headline(None, [], {}, SUBMITIT, log_path="/j/coordinator.log")
    assert line == "coordinator failed (exit code -9: killed by SIGKILL); its log: /j/coordinator.log"
    assert fc.error_line("") == ""
    assert fc.headline(None, [], {}, "") == "the job ended without a result"


def test_a_ranks_record_gains_the_users_terms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's task adds the user's error, frame and traceback file to the death record it wrote, or writes one
    (phase ``task``) when it had none; the launcher reads this attempt's records."""
    from flodl_exp.jobs.job import keep_rank_traceback
    from flodl_exp.rendezvous import death_record_path, read_death_records, write_death_record

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    ns = _user_module(tmp_path, "my_model", USER)
    job = str(tmp_path / "job")
    write_death_record(job, 1, 2, "ValueError: bad sample 7", "tb", attempt=0)
    for rank in (0, 1):
        try:
            ns["get_batch"]([1])
        except ValueError as e:
            path = keep_rank_traceback(job, rank, 0, e)
        assert path is not None and "bad sample 7" in Path(path).read_text()
    recs = read_death_records(job, 3, 0)
    assert sorted(recs) == [0, 1]
    assert recs[1]["phase"] == "training" and recs[0]["phase"] == "task"
    for rec in recs.values():
        assert rec["user_frame"] == "my_model.py:6 in helper" and rec["user_error"] == "ValueError: bad sample 7"
    assert read_death_records(job, 3, 1) == {}  # another attempt's records are not this one's
    rec = json.loads(Path(death_record_path(job, 1)).read_text())
    assert rec["traceback"] == "tb"  # the rank's own record otherwise unchanged


def test_keeping_a_traceback_never_raises(tmp_path: Path) -> None:
    from flodl_exp.jobs.job import keep_rank_traceback

    blocker = tmp_path / "job"
    blocker.write_text("a file where the job folder should be")
    assert keep_rank_traceback(str(blocker), 0, 0, ValueError("x")) is None


def test_ranks_that_could_not_set_up_are_one_line_naming_the_first() -> None:
    lines = ["rank 1 could not set up: ValueError: x at my_model.py:3 in __init__ (full traceback: /j/r1)",
             "rank 0 could not set up: ValueError: x at my_model.py:3 in __init__ (full traceback: /j/r0)",
             "rank 2 could not set up: ValueError: x (full traceback: /j/r2)"]
    assert fc.setup_headline(lines) == lines[0] + "; ranks 0, 2 could not set up either"
    blamed = fc.setup_headline(lines, "rank 0 could not set up: ValueError: x; after it, rank 1 failed: closed")
    assert blamed == lines[1] + "; ranks 1, 2 could not set up either"
    assert fc.setup_headline(lines[2:]) == lines[2]
    assert fc.setup_headline(lines[:2]) == lines[0] + "; rank 0 could not set up either"
