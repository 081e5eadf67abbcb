"""The zoo's models, steps, schedules and presets (flodl_exp/zoo, conf/experiment/<model>.yaml).

Each architecture is pinned by its output shape and its parameter count, computed from the reference's
layer list (algorithms.md 12.1 names the layers, not the counts; ResNet-20 with projection shortcuts is the
published 0.27 M), so a silently changed layer fails here. One optimizer step of the preset's own optimizer
on a tiny fixed batch must lower the loss on that batch. Every preset composes, validates and builds.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests import helpers from the repo root
    sys.path.insert(0, str(ROOT))

from flodl_exp.zoo import models_text as MT  # noqa: E402
from flodl_exp.zoo import models_vision as MV  # noqa: E402
from flodl_exp.zoo import tasks  # noqa: E402

ZOO = ("logistic", "mlp", "lenet", "resnet20", "char_rnn", "gpt_nano", "conv_ae")


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _mnist(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 28, 28, generator=g), torch.arange(n) % 10


def _text(n: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 65, (n, t + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# name -> (model factory, batch factory, step, optimizer factory, expected params, output shape)
CASES = {
    "logistic": (MV.Logistic, _mnist, tasks.classify_step, lambda p: torch.optim.Adam(p, 1e-3),
                 784 * 10 + 10, (8, 10)),
    "mlp": (MV.MLP, _mnist, tasks.classify_step, lambda p: torch.optim.Adam(p, 1e-3),
            784 * 256 + 256 + 256 * 10 + 10, (8, 10)),
    "lenet": (MV.LeNet5, _mnist, tasks.classify_step, lambda p: torch.optim.Adam(p, 1e-3),
              (6 * 25 + 6) + 12 + (16 * 6 * 25 + 16) + 32 + (256 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10), (8, 10)),
    "conv_ae": (MV.ConvAE, _mnist, tasks.reconstruct_step, lambda p: torch.optim.Adam(p, 1e-3),
                (16 * 9 + 16) + (32 * 16 * 9 + 32) + (32 * 16 * 9 + 16) + (16 * 9 + 1), (8, 1, 28, 28)),
    "resnet20": (MV.ResNet20, lambda: (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                                       torch.arange(8) % 10),
                 tasks.classify_step, lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=1e-4),
                 272_474, (8, 10)),
    "char_rnn": (MT.CharRNN, _text, tasks.lm_step, lambda p: torch.optim.RMSprop(p, 2e-3),
                 65 * 128 + (4 * 256 * (128 + 256) + 8 * 256) + (4 * 256 * 512 + 8 * 256) + (256 * 65 + 65), (4, 32, 65)),
    "gpt_nano": (MT.GPTNano, _text, tasks.lm_step, lambda p: torch.optim.Adam(p, 3e-4),
                 65 * 128 + 128 * 128 + 4 * (2 * 256 + (3 * 128 * 128 + 3 * 128) + (128 * 128 + 128)
                                             + (128 * 512 + 512) + (512 * 128 + 128)) + 256 + (128 * 65 + 65), (4, 32, 65)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_architecture_shape_params_and_one_step_learns(name):
    """Losses are taken in training mode under one seed: the same dropout masks and BatchNorm batch statistics
    before and after the step, so the difference is the step's alone."""
    make, batch_fn, step, opt_fn, want_params, out_shape = CASES[name]
    torch.manual_seed(0)
    model = make()
    assert n_params(model) == want_params
    batch = batch_fn()
    opt = opt_fn(model.parameters())
    torch.manual_seed(1)
    out = model(batch[0])
    assert tuple(out.shape) == out_shape
    loss = step(model, batch)
    loss.backward()
    opt.step()
    with torch.no_grad():
        torch.manual_seed(1)
        after = float(step(model, batch))
    before = loss.item()
    assert math.isfinite(after) and after < before, f"{name}: {before} -> {after}"


def test_resnet20_structure():
    """20 weighted layers on the main path (19 convolutions + the linear), 3 stages of 3 blocks, 2 projections."""
    m = MV.ResNet20()
    convs = [mod for name, mod in m.named_modules() if isinstance(mod, torch.nn.Conv2d) and "shortcut" not in name]
    assert len(convs) == 19 and all(c.bias is None for c in convs)
    blocks = [b for b in m.stages if isinstance(b, MV.BasicBlock)]
    assert len(blocks) == len(m.stages) and [b.conv1.out_channels for b in blocks] == [16] * 3 + [32] * 3 + [64] * 3
    assert sum(1 for b in m.stages if not isinstance(b.shortcut, torch.nn.Identity)) == 2


def test_gpt_nano_is_causal_and_bounded_by_block_size():
    torch.manual_seed(0)
    m = MT.GPTNano().eval()
    x = torch.randint(0, 65, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 65  # changing the future does not change the past's logits
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0, :12], m(y)[0, :12])
        assert not torch.allclose(m(x)[0, 12:], m(y)[0, 12:])
    with pytest.raises(ValueError, match="exceeds the block size 128"):
        m(torch.zeros(1, 129, dtype=torch.long))


def test_schedules():
    f = tasks.multistep(total_steps=100, world_size=2)
    assert [f(s) for s in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    g = tasks.warmup_cosine(total_steps=100, world_size=2, warmup_frac=0.2, base_lr=3e-4, min_lr=1e-5)
    assert g(0) == pytest.approx(1 / 20) and g(19) == pytest.approx(1.0) and g(20) == pytest.approx(1.0)
    assert g(100) == pytest.approx(1e-5 / 3e-4) and all(g(s) >= g(s + 1) for s in range(20, 100))


def test_evaluations_report_their_baselines():
    class Windows:
        unigram_loss = 3.0

        def __init__(self) -> None:
            self.x, self.y = _text(n=3, t=16)

        def __len__(self) -> int:
            return 3

        def get_batch(self, ids):
            return self.x[ids], self.y[ids]

    out = tasks.evaluate_lm(MT.CharRNN().eval(), Windows(), torch.device("cpu"))
    assert out["loss"] == pytest.approx(math.log(65), abs=0.1) and out["unigram_loss"] == 3.0
    assert out["bits_per_char"] == pytest.approx(out["loss"] / math.log(2))
    ae = tasks.evaluate_reconstruction(MV.ConvAE().eval(), _Pairs(*_mnist(6)), torch.device("cpu"))
    assert ae["mse"] > 0 and ae["mean_image_mse"] == pytest.approx(float(((_mnist(6)[0] - _mnist(6)[0].mean()) ** 2).mean()))
    acc = tasks.evaluate_classifier(MV.Logistic().eval(), _Pairs(*_mnist(6)), torch.device("cpu"))
    assert 0.0 <= acc["accuracy"] <= 1.0 and acc["loss"] > 0


class _Pairs:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def get_batch(self, ids):
        idx = torch.as_tensor(np.asarray(ids))
        return self.x[idx], self.y[idx]


def test_every_zoo_preset_composes_validates_and_builds():
    """The seven presets name real factories and keys the schema knows; each builds its model, optimizer,
    schedule and data (sizes cut for speed: the data factories are the presets' own)."""
    from hydra import compose, initialize_config_dir

    from flodl_exp.config import register_configs
    from flodl_exp.config_rules import validate
    from flodl_exp.experiment import build_experiment

    register_configs()
    small = {"resnet20": ["experiment.train_data.limit=64", "experiment.eval_data.limit=32"],
             "char_rnn": ["experiment.train_data.windows=32"], "gpt_nano": ["experiment.train_data.windows=32"]}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name in ZOO:
            cfg = compose("config", overrides=[f"experiment={name}", "cluster=local_hetero", *small.get(name, [])])
            validate(cfg)
            assert cfg.experiment.name == name
            exp = build_experiment(cfg.experiment, world_size=2, device=torch.device("cpu"), seed=0)
            assert exp.train_step is not None and exp.eval_fn is not None and len(exp.train_data) > 0
            x, y = exp.train_data.get_batch(np.arange(2))  # the step itself is tested per model above
            assert len(x) == len(y) == 2
            if name in ("resnet20", "gpt_nano"):
                assert exp.lr_factor is not None
            if name == "gpt_nano":  # the cosine floor is 1e-5 absolute: base_lr follows the optimizer's lr
                assert cfg.experiment.scheduler.base_lr == cfg.experiment.optimizer.lr
