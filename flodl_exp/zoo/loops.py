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

``early_stop``: the managed step, with the loop's own early stopping. Every rank hears each eval of the cohort
(``w.poll_eval()``); once the eval accuracy reaches ``TARGET_ACCURACY``, or has not improved for ``PATIENCE``
evals, the loop asks the run to stop (``w.request_stop()``): the furthest epoch started is trained whole, then
the run ends as at its planned end (final reduce, eval and bundle), its tag ``stopped_early`` saying where.

Run any of them from the CLI: ``python -m flodl_exp experiment=digits_accumulate``,
``experiment=digits_two_optimizers`` or ``experiment=digits_early_stop``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flodl_exp

MICRO_BATCHES = 4
TARGET_ACCURACY = 0.95
"""early_stop: stop once the cohort's eval accuracy reaches this."""
PATIENCE = 3
"""early_stop: or once this many evals in a row did not improve on the best."""


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


def early_stop(cfg: Any) -> None:
    with flodl_exp.worker() as w:
        model, opt = w.model, w.optimizer
        best, stale, asked = -1.0, 0, False
        for _epoch in w.epochs():
            for x, y in w.batches():
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                w.step(opt, loss=loss)
            while (ev := w.poll_eval()) is not None:
                acc = ev[1].get("eval/accuracy", -1.0)
                best, stale = (acc, 0) if acc > best else (best, stale + 1)
                if not asked and (best >= TARGET_ACCURACY or stale >= PATIENCE):
                    w.request_stop()
                    asked = True
