"""flodl_exp.fsio: atomic writes (whole or not at all, modes, no temp file left behind), torch-free."""
import json
import os
import stat
import subprocess
import sys

import pytest

from flodl_exp import fsio


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_create_the_folder_and_the_file(tmp_path):
    p = tmp_path / "a" / "b" / "x.json"
    fsio.atomic_json({"b": 1, "a": [1, 2]}, str(p))
    assert json.loads(p.read_text()) == {"a": [1, 2], "b": 1}
    fsio.atomic_text("héllo\n", str(tmp_path / "t.md"))
    assert (tmp_path / "t.md").read_text(encoding="utf-8") == "héllo\n"
    fsio.atomic_bytes(b"\x00\x01", str(tmp_path / "b.bin"), fsync=False)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["a", "b.bin", "t.md"]


def test_modes(tmp_path):
    old = os.umask(0o027)
    try:
        fsio.atomic_json({}, str(tmp_path / "umask.json"))  # mode None: what open() gives a new file
        fsio.atomic_text("", str(tmp_path / "report.md"))  # text: 0644 unless told
        fsio.atomic_text("", str(tmp_path / "secret.json"), mode=0o600)
        assert fsio.umask() == 0o027
    finally:
        os.umask(old)
    assert _mode(tmp_path / "umask.json") == 0o640
    assert _mode(tmp_path / "report.md") == 0o644
    assert _mode(tmp_path / "secret.json") == 0o600


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, exc):
    p = tmp_path / "state.json"
    fsio.atomic_json({"v": 1}, str(p))

    def write(fh):
        fh.write(b'{"v": 2, "half')  # a torn write that never reaches the target
        raise exc

    with pytest.raises(type(exc)):
        fsio.atomic_write(str(p), write)
    assert json.loads(p.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_rename_leaves_no_temp_file(tmp_path):
    (tmp_path / "dir").mkdir()  # os.replace of a file onto a folder fails
    with pytest.raises(OSError):
        fsio.atomic_text("x", str(tmp_path / "dir"))
    assert os.listdir(tmp_path) == ["dir"]
    assert os.listdir(tmp_path / "dir") == []


def test_replaces_an_existing_file_whole(tmp_path):
    p = tmp_path / "r.md"
    fsio.atomic_text("old " * 1000, str(p))
    fsio.atomic_text("new", str(p))
    assert p.read_text() == "new"
    assert os.listdir(tmp_path) == ["r.md"]


def test_fsio_imports_no_torch():
    code = "import sys, flodl_exp.fsio; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
