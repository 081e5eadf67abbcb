"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every write goes to a temporary file in the target's own directory (so the rename stays on one
file system), is flushed and fsync'd, then renamed over the target with ``os.replace``. A write
that fails anywhere leaves the old file as it was and removes its temporary file.

Modes: ``mode=None`` gives what ``open()`` would give a new file (``0666 & ~umask``; ``mkstemp``
alone gives 0600); pass 0o600 for files holding secrets (the rendezvous token), 0o644 for
reports others read. This module imports no torch and nothing else of flodl_exp, so the
launcher, the reports and the record log can use it without paying for torch.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import IO, Any, Optional


def umask() -> int:
    """The process's umask, read without changing it where Linux's /proc allows."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the /proc path first)
    os.umask(old)
    return old


def atomic_write(path: str, write: Callable[[IO[bytes]], object], mode: Optional[int] = None, *,
                 fsync: bool = True) -> None:
    """Call ``write(fh)`` on a binary temp file beside ``path``, then rename it into place.

    ``fsync=False`` skips the flush to disk (still atomic against readers and crashes of this
    process, not against a power loss): for files rewritten often whose loss costs little."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        os.fchmod(fd, (0o666 & ~umask()) if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_bytes(data: bytes, path: str, mode: Optional[int] = None, *, fsync: bool = True) -> None:
    atomic_write(path, lambda fh: fh.write(data), mode, fsync=fsync)


def atomic_text(text: str, path: str, mode: Optional[int] = 0o644) -> None:
    """A text file (UTF-8) written whole or not at all; by default readable by others (0644), as reports are."""
    atomic_write(path, lambda fh: fh.write(text.encode("utf-8")), mode)


def atomic_json(obj: Any, path: str, mode: Optional[int] = None) -> None:
    """``obj`` as indented, key-sorted JSON."""
    atomic_write(path, lambda fh: fh.write(json.dumps(obj, indent=2, sort_keys=True).encode()), mode)
