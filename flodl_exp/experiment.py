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
    checkpoint_fn: Optional[Callable[[int, nn.Module], None]] = None
    """``experiment.checkpoint_fn``: run with a periodic or requested bundle on its model-piece rank."""
    amp: Optional[str] = None
    """``experiment.amp``: the managed step's mixed precision, ``fp16`` (autocast + a GradScaler), ``bf16``
    (autocast, no scaler needed) or None (float32, as the model is)."""


AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""``experiment.amp`` values and the autocast dtype each means."""


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s own torch random streams (CPU and CUDA: dropout masks, random augmentation):
    apart from every other rank's and from ``seed``'s stream, the same at every start of the run."""
    import numpy as np

    state = np.random.SeedSequence([int(seed) % 2**64, int(rank)]).generate_state(1, dtype=np.uint64)
    return int(state[0]) % 2**63


def _to_container(node: Any) -> Any:
    import dataclasses

    from omegaconf import DictConfig, ListConfig, OmegaConf

    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


class ExperimentSetupError(RuntimeError):
    """A factory of the experiment could not be built: which key, which target, the cause, in one line.

    A rank's set-up runs user code (imports, data files, constructors) far from the terminal that launched it; the
    user needs the config key to fix and the cause, not Hydra's frames (the rank keeps the full traceback)."""

    def __init__(self, key: str, target: Optional[str], cause: BaseException) -> None:
        self.key, self.target, self.cause = key, target, cause
        what = f"cannot build {target!r}" if target else "cannot be built"
        super().__init__(f"{key}: {what}: {root_cause(cause)}")


def root_cause(e: BaseException) -> str:
    """The innermost cause of ``e`` as ``Type: first line`` (Hydra wraps an ImportError two levels deep)."""
    from flodl_exp.failure_cause import cause_chain, one_line

    return one_line(list(cause_chain(e))[-1])


def _target(node: Any) -> Optional[str]:
    if isinstance(node, dict):
        return str(node.get("_target_")) if node.get("_target_") else None
    return str(node) if isinstance(node, str) else None


def _built(key: str, node: Any, make: Callable[[], Any]) -> Any:
    """``make()``, or an ExperimentSetupError naming ``experiment.<key>`` and its target."""
    try:
        return make()
    except Exception as e:
        raise ExperimentSetupError(f"experiment.{key}", _target(node), e) from e


def build_experiment(exp: Any, *, world_size: int, device: torch.device, seed: int, augment: int = 1,
                     rank: Optional[int] = None) -> Experiment:
    """Instantiate every factory of ``exp`` (an ExperimentConfig node or plain dict).

    The model (and the data sets after it) are created under ``torch.manual_seed(seed)`` so every rank starts
    from the same weights (averaging replicas that started apart wastes the
    first windows). Then, given its ``rank``, the rank's torch CPU and CUDA generators are reseeded with
    :func:`rank_seed`: replicas that drew one stream would apply the same dropout masks at equal step counts.
    The data partition does not draw from torch (partition.py seeds its own generator). A factory that fails
    raises :class:`ExperimentSetupError` (its key, target and cause).
    """
    from hydra.utils import get_method, instantiate

    exp = _to_container(exp)
    torch.manual_seed(int(seed))
    model = _built("model", exp["model"], lambda: instantiate(exp["model"]).to(device))
    optimizer = _built("optimizer", exp["optimizer"], lambda: instantiate(exp["optimizer"])(model.parameters()))
    train_data = _built("train_data", exp["train_data"], lambda: instantiate(exp["train_data"]))
    eval_data = _built("eval_data", exp["eval_data"], lambda: instantiate(exp["eval_data"])) if exp.get("eval_data") else None
    lr_factor = None
    if exp.get("scheduler"):
        steps_per_epoch = (len(train_data) * max(1, augment)) // int(exp["batch_size"])
        total_steps = max(1, steps_per_epoch * int(exp["epochs"]))
        lr_factor = _built("scheduler", exp["scheduler"],
                           lambda: instantiate(exp["scheduler"])(total_steps=total_steps, world_size=world_size))

    def method(key: str) -> Any:
        return _built(key, exp[key], lambda: get_method(exp[key])) if exp.get(key) else None

    amp = exp.get("amp") or None
    if amp is not None and amp not in AMP_DTYPES:
        raise ExperimentSetupError("experiment.amp", None, ValueError(f"{amp!r}: fp16, bf16 or unset"))
    built = Experiment(model, optimizer, lr_factor, train_data, eval_data, method("train_step"), method("eval_fn"),
                       method("epoch_fn"), method("checkpoint_fn"), amp=amp)
    if rank is not None:
        torch.manual_seed(rank_seed(seed, rank))  # seeds every CUDA device too
    return built


def fetch_batch(dataset: Any, sample_ids: Any) -> Any:
    """A dataset offers ``get_batch(ids)``; otherwise samples are stacked from ``__getitem__``."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(sample_ids)
    items = [dataset[int(i)] for i in sample_ids]
    if isinstance(items[0], (tuple, list)):
        return tuple(torch.stack([torch.as_tensor(it[k]) for it in items]) for k in range(len(items[0])))
    return torch.stack([torch.as_tensor(it) for it in items])

