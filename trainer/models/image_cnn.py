"""The image CNN: the one definition that the image featurizer trains and
exports (featurizer/image.py) and that the image GPU mode (model parallel +
data parallel) will split into partitions.

    pixels  (B, 1, 28, 28)  float32, normalised
    conv1   3x3 conv 1->c1, ReLU, 2x2 max pool     (B, c1, 14, 14)
    conv2   3x3 conv c1->c2, ReLU, 2x2 max pool    (B, c2, 7, 7)
    embed   flatten, linear c2*7*7 -> d, ReLU      (B, d)        the featurizer's output
    head    linear d -> classes                    (B, classes)  logits

The parts are named and kept in order in `stages()`, so a partitioner can cut
the list anywhere (each stage's output is the next one's only input).
`frozen_ops` writes the stages as a list of plain ops (conv2d, relu, ...) over
named weights: the exported featurizer (featurizer/image.py) runs that list,
so serving and preprocess need no training code and this file stays the one
definition of the network.

>>> m = ImageCNN(ImageCNNConfig(embed_dim=8))
>>> [name for name, _ in m.stages()]
['conv1', 'conv2', 'embed', 'head']
>>> [op["op"] for op in frozen_ops(m)]
['conv2d', 'relu', 'max_pool2d', 'conv2d', 'relu', 'max_pool2d', 'flatten', 'linear', 'relu']
>>> m(torch.zeros(2, 1, 28, 28)).shape, m.embed_features(torch.zeros(2, 1, 28, 28)).shape
(torch.Size([2, 10]), torch.Size([2, 8]))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ImageCNNConfig:
    size: int = 28            # square input, one channel
    channels: tuple[int, int] = (16, 32)
    embed_dim: int = 32       # d: the width of the featurizer's output
    classes: int = 10

    def to_dict(self) -> dict:
        return {**asdict(self), "channels": list(self.channels)}

    @classmethod
    def from_dict(cls, d: dict) -> "ImageCNNConfig":
        return cls(size=int(d["size"]), channels=tuple(int(c) for c in d["channels"]),
                   embed_dim=int(d["embed_dim"]), classes=int(d["classes"]))


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 same-padding conv, ReLU, 2x2 max pool: (B, c_in, H, W) -> (B, c_out, H/2, W/2)."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


class ImageCNN(nn.Module):
    def __init__(self, cfg: ImageCNNConfig = ImageCNNConfig()):
        super().__init__()
        if cfg.size % 4:
            raise ValueError(f"image size must be a multiple of 4 (two 2x2 pools), got {cfg.size}")
        self.cfg = cfg
        c1, c2 = cfg.channels
        side = cfg.size // 4
        self.conv1 = conv_block(1, c1)
        self.conv2 = conv_block(c1, c2)
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(c2 * side * side, cfg.embed_dim), nn.ReLU())
        self.head = nn.Linear(cfg.embed_dim, cfg.classes)

    def stages(self) -> list[tuple[str, nn.Module]]:
        """(name, module) in forward order: pixels -> ... -> logits."""
        return [("conv1", self.conv1), ("conv2", self.conv2), ("embed", self.embed), ("head", self.head)]

    def embed_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, S) normalised pixels -> (B, d) features (every stage before the head)."""
        return self.embed(self.conv2(self.conv1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed_features(x))  # (B, classes)


def frozen_ops(model: ImageCNN, start: str = "conv1", stop: str = "embed") -> list[dict]:
    """The stages from `start` to `stop` (inclusive) as plain ops over state_dict names."""
    names = [n for n, _ in model.stages()]
    chosen = model.stages()[names.index(start):names.index(stop) + 1]
    ops = []
    for name, stage in chosen:
        layers = list(stage) if isinstance(stage, nn.Sequential) else [stage]
        for i, layer in enumerate(layers):
            ops.append(_op(layer, f"{name}.{i}." if isinstance(stage, nn.Sequential) else f"{name}."))
    return ops


def _op(layer: nn.Module, prefix: str) -> dict:
    if isinstance(layer, nn.Conv2d):
        return {"op": "conv2d", "weight": prefix + "weight", "bias": prefix + "bias",
                "stride": list(layer.stride), "padding": list(layer.padding)}
    if isinstance(layer, nn.Linear):
        return {"op": "linear", "weight": prefix + "weight", "bias": prefix + "bias"}
    if isinstance(layer, nn.MaxPool2d):
        return {"op": "max_pool2d", "kernel": layer.kernel_size}
    if isinstance(layer, nn.ReLU):
        return {"op": "relu"}
    if isinstance(layer, nn.Flatten):
        return {"op": "flatten"}
    raise TypeError(f"no frozen op for {type(layer).__name__} at {prefix!r}")
