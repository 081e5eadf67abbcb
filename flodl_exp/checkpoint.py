"""Checkpoint bundles: ``<stem>.pt`` (consensus model), ``<stem>.optim.pt`` (primary rank),
``<stem>.optim.r<N>.pt`` (other ranks), ``<stem>.meta.json`` (trajectory metadata).

Every piece is written to a temporary file in the same directory and renamed
into place, so a crash mid-write never leaves a torn bundle. Loading uses
``torch.load(weights_only=True)``: a bundle never runs code.

The meta is written last and lists the pieces the ranks reported written (``pieces``); a bundle
whose save failed gets no meta. Resuming checks every listed piece (:func:`check_pieces`). Pieces
get the permissions the user's umask gives a new file (``0666 & ~umask``), like ``open()`` would.
The writes themselves are :mod:`flodl_exp.fsio`'s; only the torch one lives here. Torch is imported by the
functions that save or load tensors only: the coordinator of the nccl backend names, lists and removes
pieces and writes metas, and never imports it.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional, cast

from flodl_exp.bundle_meta import META_SCHEMA_VERSION as META_SCHEMA_VERSION  # re-exported
from flodl_exp.bundle_meta import BundleMeta, Resume
from flodl_exp.bundle_names import BUNDLE_SUFFIXES, meta_path, model_path, optim_path, outer_path
from flodl_exp.fsio import atomic_json, atomic_write
from flodl_exp.fsio import atomic_text as atomic_text  # re-exported; new code imports both from flodl_exp.fsio (no torch)
from flodl_exp.json_fields import FieldError

if TYPE_CHECKING:
    import torch
    from torch import nn


def atomic_torch_save(obj: Any, path: str) -> None:
    import torch

    atomic_write(path, lambda fh: torch.save(obj, fh))


def bundle_files(stem: str) -> list[str]:
    """Every piece of ``stem`` on disk now (model, optimizer pieces, meta): not temp files, not other stems."""
    d, name = os.path.dirname(os.path.abspath(stem)), os.path.basename(stem)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out = []
    for fn in names:
        rest = fn[len(name):] if fn.startswith(name + ".") else ""
        if rest in BUNDLE_SUFFIXES or (rest.startswith(".optim.r") and rest.endswith(".pt")
                                                           and rest[len(".optim.r"):-len(".pt")].isdigit()):
            out.append(os.path.join(d, fn))
    return out


def remove_bundle(stem: str) -> list[str]:
    """Delete the pieces of ``stem`` left by an earlier save (meta first: never a meta beside missing
    pieces); a reused ``checkpoint.save_path`` then never mixes old and new pieces. Returns what went."""
    files = bundle_files(stem)
    files.sort(key=lambda f: not f.endswith(".meta.json"))
    gone = []
    for f in files:
        try:
            os.unlink(f)
            gone.append(f)
        except FileNotFoundError:
            pass
    return gone


def check_pieces(stem: str, meta: BundleMeta) -> Optional[str]:
    """The first piece the meta lists that is missing or not a torch file, as one line; None when all are there.

    Metas written before ``pieces`` existed list nothing: only the model piece is checked."""
    names = meta.pieces if meta.pieces is not None else (os.path.basename(model_path(stem)),)
    d = os.path.dirname(os.path.abspath(stem))
    for n in names:
        path = os.path.join(d, os.path.basename(str(n)))
        try:
            with open(path, "rb") as fh:
                head = fh.read(4)
        except FileNotFoundError:
            return f"{path} does not exist (the meta lists it)"
        except OSError as e:
            return f"{path} is unreadable ({e.strerror or e})"
        if head != b"PK\x03\x04":  # torch.save's zip container
            return f"{path} is unreadable (not a torch file: truncated or corrupt)"
    return None


def save_rank_pieces(stem: str, model: nn.Module, optimizer: Any, *, rank: int,
                     primary: bool, write_model: bool, model_state: Optional[dict[str, torch.Tensor]] = None,
                     outer_state: Optional[dict[str, Any]] = None) -> None:
    """This rank's pieces (``optimizer``: a torch optimizer or a cooperative loop's OptimizerSet: its state dict);
    ``model_state`` replaces the replica's state dict in the model piece;
    ``outer_state`` (nccl: the model's writer holds the replicated outer optimizer) goes to the sidecar."""
    if write_model:
        state = model_state if model_state is not None else model.state_dict()
        atomic_torch_save({k: v.detach().to("cpu") for k, v in state.items()}, model_path(stem))
        if outer_state is not None:
            atomic_torch_save(outer_state, outer_path(stem))
    atomic_torch_save(optimizer.state_dict(), optim_path(stem, rank, primary))


def write_meta(stem: str, meta: BundleMeta) -> None:
    """Write the bundle writer's meta (core/checkpoints.py) as JSON, atomically; readers take it back through
    :func:`load_meta` as the same :class:`~flodl_exp.bundle_meta.BundleMeta`."""
    atomic_json(meta.to_dict(), meta_path(stem))


def load_meta(stem: str) -> BundleMeta:
    """Read and check ``<stem>.meta.json``; ValueError with one line on any problem (naming the key)."""
    path = meta_path(stem)
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path} is unreadable ({e})") from None
    try:
        return BundleMeta.from_dict(raw)
    except FieldError as e:
        raise ValueError(f"checkpoint.resume_from={stem!r}: {path}: {e}") from None


def load_model_state(stem: str, map_location: Optional[str] = "cpu") -> dict[str, torch.Tensor]:
    import torch

    return torch.load(model_path(stem), map_location=map_location, weights_only=True)


def load_outer_state(stem: str) -> dict[str, Any]:
    """The outer optimizer's sidecar (tensors and plain values only: weights_only)."""
    import torch

    return cast(dict[str, Any], torch.load(outer_path(stem), map_location="cpu", weights_only=True))


def validate_resume(cfg: Any) -> Optional[Resume]:
    """Check ``checkpoint.resume_from`` before any process starts; ConfigError (one line) on a bad bundle.

    Refused: a missing or corrupt meta, a newer schema, another world size, another data set size, another
    model (parameter names/shapes). Another ``seed`` is not refused: the run adopts the bundle's shuffle seed
    (``bundle_meta.resolve_shuffle_seed``).
    """
    from flodl_exp.config import ConfigError, outer_spec, world_size

    stem = cfg.checkpoint.resume_from
    if not stem:
        return None
    key = f"checkpoint.resume_from={stem!r}"
    stem = os.path.abspath(stem)
    try:
        meta = load_meta(stem)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    if not os.path.exists(model_path(stem)):
        raise ConfigError(f"config error: {key}: {model_path(stem)} does not exist")
    bad = check_pieces(stem, meta)
    if bad:
        raise ConfigError(f"config error: {key}: {bad}")
    spec = outer_spec(cfg)
    if spec.stateful and not os.path.exists(outer_path(stem)):
        raise ConfigError(f"config error: {key}: {outer_path(stem)} does not exist: outer={spec.describe()} resumes its "
                          "state from the bundle (saved with outer=avg? resume with outer=avg)")
    w = world_size(cfg)
    if meta.world_size_at_save is not None and meta.world_size_at_save != w:
        raise ConfigError(f"config error: {key}: saved with world size {meta.world_size_at_save}, this run has {w}")
    if meta.epoch > int(cfg.experiment.epochs):
        raise ConfigError(f"config error: {key}: saved at epoch {meta.epoch}, beyond experiment.epochs={cfg.experiment.epochs}")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    exp = cast(dict[str, Any], OmegaConf.to_container(cfg.experiment, resolve=True))  # a DictConfig gives a dict
    try:
        saved = load_model_state(stem)
    except Exception as e:
        raise ConfigError(f"config error: {key}: {model_path(stem)} is unreadable ({type(e).__name__})") from None
    model = instantiate(exp["model"])
    now = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    was = {k: tuple(v.shape) for k, v in saved.items()}
    if now != was:
        diff = sorted(set(now) ^ set(was)) or [k for k in now if now[k] != was.get(k)]
        k = diff[0]
        raise ConfigError(f"config error: {key}: the bundle holds another model than experiment={cfg.experiment.name} "
                          f"(first difference: {k}: saved {was.get(k)} vs now {now.get(k)})")
    if meta.total_picks:
        data = instantiate(exp["train_data"])
        picks = len(data) * max(1, int(cfg.data_plane.augment))
        if picks != meta.total_picks:
            raise ConfigError(f"config error: {key}: saved with {meta.total_picks} picks per epoch, this data set has {picks}")
    return Resume(stem=stem, meta=meta)
