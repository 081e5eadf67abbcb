"""The reference's image models (algorithms.md 12.1), layer for layer.

MNIST-shaped ([n, 1, 28, 28]): ``Logistic`` (Flatten -> Linear(784, 10)), ``MLP`` (784 -> 256 ReLU
-> 10), ``LeNet5`` (the modern LeNet-5: 5x5 convolutions 1->6->16 without padding, each with
BatchNorm, ReLU and 2x2 max-pool, then 256 -> 120 -> 84 -> 10 with ReLUs) and ``ConvAE`` (two 3x3
stride-2 convolutions 1->16->32, two 3x3 stride-2 transposed convolutions 32->16->1, ReLUs between,
sigmoid out). CIFAR-shaped ([n, 3, 32, 32]): ``ResNet20`` (He et al. 2015: a 3x3 stem to 16
channels, three stages of three BasicBlocks at 16/32/64 channels, the first block of stages 2 and 3
strided, projection shortcuts (1x1 convolution + BatchNorm) where the shape changes, global average
pool, Linear(64, 10); convolutions without bias, as BatchNorm follows each).

Sizes are the architecture: the CPU presets scale data, batch and epochs, never these. The unit
tests pin each model's parameter count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Logistic(nn.Module):
    def __init__(self, in_features: int = 784, classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, in_features: int = 784, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class LeNet5(nn.Module):
    """LeNet-5 with BatchNorm + ReLU for 28x28 inputs: 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 4 * 4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class ConvAE(nn.Module):
    """Encoder (1, 28, 28) -> (16, 14, 14) -> (32, 7, 7); the decoder mirrors it back, sigmoid out."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, 1, 3, stride=2, padding=1, output_padding=1), nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU; a 1x1 projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 RGB: 1 stem + 3 stages x 3 blocks x 2 convolutions + 1 linear = 20 layers."""

    def __init__(self, classes: int = 10, widths: tuple[int, int, int] = (16, 32, 64), blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(cin, w, stride=2 if (i > 0 and b == 0) else 1))
                cin = w
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
