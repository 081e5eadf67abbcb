"""Train steps, evaluations and LR schedules of the zoo (what ``conf/experiment/<model>.yaml`` names).

Three kinds of task share them: classification (logistic, mlp, lenet, resnet20: cross-entropy,
accuracy), reconstruction (conv_ae: MSE of the image against itself) and next-character language
modelling (char_rnn, gpt_nano: cross-entropy per character in nats, reported beside the corpus's
unigram baseline so "it learned something" is a comparison, not a guess).

Evaluations run in chunks of ``EVAL_CHUNK`` samples on the rank's device, so a full test set fits a
small GPU and a CPU rank's memory. Schedules are pure functions of the global step (every rank
computes the same LR factor without exchanging it), built from ``(total_steps, world_size)``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EVAL_CHUNK = 500


def classify_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def reconstruct_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """MSE of the reconstruction against the input (labels unused)."""
    x = batch[0]
    return F.mse_loss(model(x), x)


def lm_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-character cross-entropy over every position of every window."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _chunks(dataset: Any, device: torch.device, chunk: int = EVAL_CHUNK) -> Iterator[tuple[torch.Tensor, ...]]:
    n = len(dataset)
    for lo in range(0, n, chunk):
        batch = dataset.get_batch(np.arange(lo, min(n, lo + chunk)))
        yield tuple(t.to(device) for t in batch)


@torch.no_grad()
def evaluate_classifier(model: nn.Module, dataset: Any, device: torch.device) -> dict[str, float]:
    correct, loss, n = 0.0, 0.0, 0
    for x, y in _chunks(dataset, device):
        logits = model(x)
        correct += float((logits.argmax(1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        n += len(y)
    return {"accuracy": correct / max(1, n), "loss": loss / max(1, n)}


@torch.no_grad()
def evaluate_reconstruction(model: nn.Module, dataset: Any, device: torch.device) -> dict[str, float]:
    """Per-pixel MSE on the held-out images, and the MSE of predicting each pixel's mean (the baseline)."""
    sq, base, n = 0.0, 0.0, 0
    for x, _ in _chunks(dataset, device):
        sq += float(F.mse_loss(model(x), x, reduction="sum"))
        base += float(((x - x.mean()) ** 2).sum())
        n += x.numel()
    return {"mse": sq / max(1, n), "mean_image_mse": base / max(1, n)}


@torch.no_grad()
def evaluate_lm(model: nn.Module, dataset: Any, device: torch.device) -> dict[str, float]:
    """Validation cross-entropy (nats/char), its bits/char, and the unigram baseline in the same units."""
    total, n = 0.0, 0
    for x, y in _chunks(dataset, device, chunk=64):
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        n += y.numel()
    loss = total / max(1, n)
    return {"loss": loss, "bits_per_char": loss / math.log(2), "unigram_loss": float(dataset.unigram_loss)}


def multistep(total_steps: int, world_size: int, milestones: Sequence[float] = (0.5, 0.75),
              gamma: float = 0.1) -> Callable[[int], float]:
    """LR factor ``gamma ** (milestones passed)``, milestones as fractions of the total steps (ResNet-20's)."""
    marks = sorted(int(total_steps * m) for m in milestones)

    def factor(step: int) -> float:
        return float(gamma ** sum(step >= m for m in marks))

    return factor


def warmup_cosine(total_steps: int, world_size: int, warmup_frac: float = 0.2, base_lr: float = 3e-4,
                  min_lr: float = 1e-5) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_frac`` of the steps, then cosine from ``base_lr`` down to ``min_lr``
    (GPT-nano's); returned as a factor of the optimizer's base LR: digits' schedule with the floor
    ``min_lr / base_lr``."""
    from flodl_exp.zoo.digits import cosine_schedule

    return cosine_schedule(total_steps, world_size, warmup_frac=warmup_frac, floor=min_lr / base_lr)
