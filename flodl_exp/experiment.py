"""Build an experiment (model, optimizer, LR factor, data, step and eval functions) from config.

Factories are resolved through Hydra's ``instantiate`` / ``get_method`` on the
``_target_`` dotted paths of ``conf/experiment/*.yaml`` (the shipped presets name ``flodl_exp.zoo``, a
user's preset names their own module); the library never imports an experiment module by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclass
class Experiment:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_factor: Optional[Callable[[int], float]]
    train_data: Any
    eval_data: Any
    train_step: Optional[Callable[[nn.Module, Any], torch.Tensor]]
    """None for the cooperative tier (``experiment.loop``): the user's loop does the step."""
    eval_fn: Optional[Callable[[nn.Module, Any, torch.device], dict]]
    epoch_fn: Optional[Callable[[int, nn.Module, dict], Optional[dict]]] = None


def _to_container(node: Any) -> Any:
    import dataclasses

    from omegaconf import DictConfig, ListConfig, OmegaConf

    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def build_experiment(exp: Any, *, world_size: int, device: torch.device, seed: int, augment: int = 1) -> Experiment:
    """Instantiate every factory of ``exp`` (an ExperimentConfig node or plain dict).

    The model is created under ``torch.manual_seed(seed)`` so every rank starts
    from the same weights (averaging replicas that started apart wastes the
    first windows).
    """
    from hydra.utils import get_method, instantiate

    exp = _to_container(exp)
    torch.manual_seed(int(seed))
    model = instantiate(exp["model"]).to(device)
    optimizer = instantiate(exp["optimizer"])(model.parameters())
    train_data = instantiate(exp["train_data"])
    eval_data = instantiate(exp["eval_data"]) if exp.get("eval_data") else None
    lr_factor = None
    if exp.get("scheduler"):
        steps_per_epoch = (len(train_data) * max(1, augment)) // int(exp["batch_size"])
        total_steps = max(1, steps_per_epoch * int(exp["epochs"]))
        lr_factor = instantiate(exp["scheduler"])(total_steps=total_steps, world_size=world_size)
    train_step = get_method(exp["train_step"]) if exp.get("train_step") else None
    eval_fn = get_method(exp["eval_fn"]) if exp.get("eval_fn") else None
    epoch_fn = get_method(exp["epoch_fn"]) if exp.get("epoch_fn") else None
    return Experiment(model, optimizer, lr_factor, train_data, eval_data, train_step, eval_fn, epoch_fn)


def fetch_batch(dataset: Any, sample_ids: Any) -> Any:
    """A dataset offers ``get_batch(ids)``; otherwise samples are stacked from ``__getitem__``."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(sample_ids)
    items = [dataset[int(i)] for i in sample_ids]
    if isinstance(items[0], (tuple, list)):
        return tuple(torch.stack([torch.as_tensor(it[k]) for it in items]) for k in range(len(items[0])))
    return torch.stack([torch.as_tensor(it) for it in items])


def batch_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: batch_to(v, device) for k, v in batch.items()}
    return batch
