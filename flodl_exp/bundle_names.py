"""The names of a checkpoint bundle's pieces: pure string rules, shared by the control core (which decides
what a bundle holds) and :mod:`flodl_exp.checkpoint` (which writes and reads the files).

Stems are POSIX paths (the coordinator and the ranks run on Linux); :func:`file_name` is ``os.path.basename``
there, without importing ``os`` into the core.
"""
from __future__ import annotations


def model_path(stem: str) -> str:
    return f"{stem}.pt"


def optim_path(stem: str, rank: int, primary: bool) -> str:
    return f"{stem}.optim.pt" if primary else f"{stem}.optim.r{rank}.pt"


def meta_path(stem: str) -> str:
    return f"{stem}.meta.json"


def outer_path(stem: str) -> str:
    """The outer optimizer's sidecar (momentum and the last adopted global), written only when it has state."""
    return f"{stem}.outer.pt"


BUNDLE_SUFFIXES = (".pt", ".optim.pt", ".outer.pt", ".meta.json")
"""Every fixed piece suffix of a bundle (besides the per-rank ``.optim.r<N>.pt``)."""


def file_name(path: str) -> str:
    """The last component of a POSIX path (``os.path.basename``)."""
    return path.rsplit("/", 1)[-1]
