"""The oldest torch flodl_exp runs on, checked without importing torch.

The launcher checks the installed distribution's version (``importlib.metadata``: no torch import on its critical
path) so an old torch is refused in one line before a job starts; each rank checks ``torch.__version__`` again
at start-up (a SLURM node may have another environment than the machine that submitted)."""
from __future__ import annotations

import re
from typing import Optional

TORCH_FLOOR = (2, 6)
"""The oldest torch a rank runs on: elastic regroup aborts an NCCL group with ``_abort_process_group``
(torch.distributed, new in 2.6); without it a regroup re-initialises a live default group and fails."""


def check_torch_version(version: str) -> Optional[str]:
    """One line naming the installed torch and the floor when ``version`` is older than :data:`TORCH_FLOOR`, else None.

    ``version`` is ``torch.__version__`` (``2.5.1+cu121``, ``2.6.0a0+git...``); a string that does not start with
    ``major.minor`` is let through (a private build: the abort path says so itself if it lacks the function)."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) >= TORCH_FLOOR:
        return None
    floor = ".".join(map(str, TORCH_FLOOR))
    return (f"torch {version} is installed but flodl_exp needs torch>={floor} (elastic regroup aborts NCCL groups "
            f"with torch.distributed's _abort_process_group, new in {floor}): pip install 'torch>={floor}'")


def installed_torch_problem() -> Optional[str]:
    """:func:`check_torch_version` of the installed torch distribution, read without importing torch (None when
    it is recent enough, or when no distribution metadata names it: a source build on ``sys.path``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return check_torch_version(version("torch"))
    except PackageNotFoundError:
        return None
