"""Two training loops of the cooperative tier (``experiment.loop``), on the digits data.

``accumulate``: gradient accumulation. Each item of ``w.batches()`` is one optimizer step's data
(``experiment.batch_size`` samples); the loop splits it into ``MICRO_BATCHES`` micro-batches, backpropagates
each (the loss scaled by its share) and steps once. ElChe counts optimizer steps, as it counts batches in
the managed tier: the effective batch is the configured one, the peak activation memory a quarter of it.

``two_optimizers``: an encoder/decoder pair trained with separate optimizers. The encoder and the
classifier head learn the labels with Adam; a decoder learns to reconstruct the image from the (detached)
code with SGD + momentum. Both optimizers are registered with ``w.setup`` (bundles save both, DiLoCo
resets both) and stepped by one ``w.step``. Its quality bar is the managed tier's: eval accuracy >= 0.90
(the model's forward is the classifier), with the reconstruction error recorded as a scalar.

Run either from the CLI: ``python -m flodl_exp experiment=digits_accumulate`` or
``experiment=digits_two_optimizers``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flodl_exp

MICRO_BATCHES = 4


def accumulate(cfg: Any) -> None:
    with flodl_exp.worker() as w:
        model, opt = w.model, w.optimizer
        for _epoch in w.epochs():
            for x, y in w.batches():
                total = 0.0
                for xm, ym in zip(x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)):
                    loss = F.cross_entropy(model(xm), ym) * (len(ym) / len(y))
                    loss.backward()
                    total += float(loss.detach())
                w.record_scalar("micro_batches", MICRO_BATCHES)
                w.step(opt, loss=total)


class EncoderDecoder(nn.Module):
    """An encoder, a classifier head on its code (the forward: logits) and a decoder back to the image."""

    def __init__(self, code: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, code), nn.ReLU())
        self.head = nn.Linear(code, 10)
        self.decoder = nn.Sequential(nn.Linear(code, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x.flatten(1)))


def two_optimizers(cfg: Any) -> None:
    with flodl_exp.worker() as w:
        model = w.model
        if not isinstance(model, EncoderDecoder):
            raise TypeError(f"two_optimizers trains an flodl_exp.zoo.loops.EncoderDecoder, not a {type(model).__name__}")
        classify = torch.optim.Adam([*model.encoder.parameters(), *model.head.parameters()], lr=2e-3)
        reconstruct = torch.optim.SGD(model.decoder.parameters(), lr=0.05, momentum=0.9)
        w.setup(classify, reconstruct)
        for _epoch in w.epochs():
            for x, y in w.batches():
                code = model.encoder(x.flatten(1))
                loss = F.cross_entropy(model.head(code), y)
                loss.backward()
                recon = F.mse_loss(model.decoder(code.detach()), x.flatten(1))
                recon.backward()
                w.record_scalar("recon_mse", float(recon.detach()))
                w.step(classify, reconstruct, loss=loss)
