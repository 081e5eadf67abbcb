"""flodl_exp: a config-driven runner for data-parallel training on mixed hardware.

Public surface: ``record_scalar`` (user metrics from a train step),
``launch(cfg) -> RunHandle`` and ``worker()`` (the cooperative tier: the user's own loop on a rank). Importing the package does not import torch.
The launcher lives in ``flodl_exp.jobs`` (a name that is not a public function,
so ``flodl_exp.launch`` stays this function however many submodules are imported).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl_exp.jobs.launcher import RunHandle
    from flodl_exp.rank.cooperative import CooperativeWorker
    from flodl_exp.scalars import record_scalar as record_scalar

__version__ = "0.2.0"
"""The package's version (pyproject reads it from here; CHANGELOG.md says what each one changed)."""

__all__ = ["__version__", "launch", "record_scalar", "worker"]


def __getattr__(name: str) -> Any:
    """``record_scalar`` on first use (PEP 562): importing the package loads no submodule, so a module that
    imports ``flodl_exp.<anything>`` (the control core) pulls in nothing it did not ask for."""
    if name == "record_scalar":
        from flodl_exp.scalars import record_scalar

        globals()["record_scalar"] = record_scalar  # later look-ups find it directly
        return record_scalar
    raise AttributeError(f"module 'flodl_exp' has no attribute {name!r}")


def launch(cfg: Any, **kw: Any) -> RunHandle:
    """Validate ``cfg``, create the MLflow run and submit the job; see :func:`flodl_exp.jobs.launcher.launch`."""
    from flodl_exp.jobs.launcher import launch as _launch

    return _launch(cfg, **kw)


def worker() -> AbstractContextManager[CooperativeWorker]:
    """``with flodl_exp.worker() as w:`` inside an ``experiment.loop``: join the coordinator as this rank
    and drive training from the user's own loop; see :mod:`flodl_exp.rank.cooperative`. It takes no config:
    the rank reads its own (``w.cfg``)."""
    from flodl_exp.rank.cooperative import worker as _worker

    return _worker()
