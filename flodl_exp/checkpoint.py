"""Checkpoint bundles: ``<stem>.pt`` (consensus model), ``<stem>.optim.pt`` (primary rank),
``<stem>.optim.r<N>.pt`` (other ranks), ``<stem>.meta.json`` (trajectory metadata).

Every piece is written to a temporary file in the same directory and renamed
into place, so a crash mid-write never leaves a torn bundle. Loading uses
``torch.load(weights_only=True)``: a bundle never runs code.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import torch
from torch import nn

META_SCHEMA_VERSION = 1


def model_path(stem: str) -> str:
    return f"{stem}.pt"


def optim_path(stem: str, rank: int, primary: bool) -> str:
    return f"{stem}.optim.pt" if primary else f"{stem}.optim.r{rank}.pt"


def meta_path(stem: str) -> str:
    return f"{stem}.meta.json"


def _atomic_write(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_torch_save(obj: Any, path: str) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


def atomic_json(obj: Any, path: str) -> None:
    _atomic_write(path, lambda fh: fh.write(json.dumps(obj, indent=2, sort_keys=True).encode()))


def save_rank_pieces(stem: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
                     primary: bool, write_model: bool) -> None:
    if write_model:
        atomic_torch_save({k: v.detach().to("cpu") for k, v in model.state_dict().items()}, model_path(stem))
    atomic_torch_save(optimizer.state_dict(), optim_path(stem, rank, primary))


def write_meta(stem: str, meta: dict) -> None:
    meta = dict(meta)
    meta.setdefault("schema_version", META_SCHEMA_VERSION)
    atomic_json(meta, meta_path(stem))


def load_meta(stem: str) -> dict:
    """Read and check ``<stem>.meta.json``; ValueError with one line on any problem."""
    path = meta_path(stem)
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path} is unreadable ({e})") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path} is not a flodl_exp bundle meta")
    if int(meta["schema_version"]) > META_SCHEMA_VERSION:
        raise ValueError(f"checkpoint.resume_from={stem!r}: schema {meta['schema_version']} is newer than supported ({META_SCHEMA_VERSION})")
    return meta


def load_model_state(stem: str, map_location: Optional[str] = "cpu") -> dict[str, torch.Tensor]:
    return torch.load(model_path(stem), map_location=map_location, weights_only=True)
