"""A rank's own death record (the reference's: rank, world size, error, time, a schema number), written in the job
folder before the rank tells the coordinator, so a cause whose error frame never arrives is still on disk."""
from __future__ import annotations

import json
import os
from pathlib import Path

from flodl_exp.rendezvous import DEATH_RECORD_SCHEMA, death_record_path, write_death_record


def test_the_record_names_the_rank_its_error_and_when(tmp_path: Path) -> None:
    path = write_death_record(str(tmp_path), 2, 4, "ValueError: boom", "Traceback ...\nValueError: boom", attempt=1)
    assert path == death_record_path(str(tmp_path), 2) and path.endswith("ranks/death.r2.json")
    rec = json.loads(Path(path).read_text())
    assert rec["schema_version"] == DEATH_RECORD_SCHEMA == 1
    assert (rec["rank"], rec["world_size"], rec["error"], rec["pid"]) == (2, 4, "ValueError: boom", os.getpid())
    assert rec["unix_time"] > 0 and rec["incarnation"].startswith("1.")
    assert (Path(path).stat().st_mode & 0o777) == 0o600


def test_a_record_that_cannot_be_written_does_not_hide_the_error(tmp_path: Path) -> None:
    blocked = tmp_path / "job"
    blocked.write_text("a file where the job folder should be")
    assert write_death_record(str(blocked), 0, 2, "RuntimeError: x", "") is None
