"""flodl_exp: a config-driven runner for data-parallel training on mixed hardware.

Public surface: ``record_scalar`` (user metrics from a train step) and
``launch(cfg) -> RunHandle``. Importing the package does not import torch.
"""
from .scalars import record_scalar

__all__ = ["record_scalar", "launch"]


def launch(cfg, **kw):
    from .runner import launch as _launch

    return _launch(cfg, **kw)
