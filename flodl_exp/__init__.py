"""flodl_exp: a config-driven runner for data-parallel training on mixed hardware.

Public surface: ``record_scalar`` (user metrics from a train step) and
``launch(cfg) -> RunHandle``. Importing the package does not import torch.
The launcher lives in ``flodl_exp.jobs`` (a name that is not a public function,
so ``flodl_exp.launch`` stays this function however many submodules are imported).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .scalars import record_scalar

if TYPE_CHECKING:
    from .jobs.launcher import RunHandle

__all__ = ["launch", "record_scalar"]


def launch(cfg: Any, **kw: Any) -> RunHandle:
    """Validate ``cfg``, create the MLflow run and submit the job; see :func:`flodl_exp.jobs.launcher.launch`."""
    from .jobs.launcher import launch as _launch

    return _launch(cfg, **kw)
