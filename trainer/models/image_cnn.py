"""The image CNN: the one definition that the image featurizer trains and
exports (featurizer/image.py) and that the image mode (model parallel + data
parallel) splits into partitions.

    pixels  (B, 1, S, S)    float32, normalised
    conv1   3x3 conv 1->c1, ReLU, 2x2 max pool     (B, c1, S/2, S/2)
    ...     one block per entry of `channels`      (B, ck, S/2^k, S/2^k)
    embed   flatten, linear -> d, ReLU             (B, d)        the featurizer's output
    head    linear d -> classes                    (B, classes)  logits

The default (2 blocks of 16 and 32 channels on 28x28) is the MNIST featurizer;
`ImageCNNConfig.wide()` (6 blocks, 64-256 channels, 64x64 inputs) is big enough
that memory and speed of the parallel modes matter. The parts are named and kept
in order in `stages()`, so a partitioner can cut the list anywhere (each stage's
output is the next one's only input). `frozen_ops` writes the stages as a list of
plain ops (conv2d, relu, ...) over named weights: the exported featurizer
(featurizer/image.py) runs that list, so serving and preprocess need no training
code and this file stays the one definition of the network.

>>> m = ImageCNN(ImageCNNConfig(embed_dim=8))
>>> [name for name, _ in m.stages()]
['conv1', 'conv2', 'embed', 'head']
>>> [op["op"] for op in frozen_ops(m)]
['conv2d', 'relu', 'max_pool2d', 'conv2d', 'relu', 'max_pool2d', 'flatten', 'linear', 'relu']
>>> m(torch.zeros(2, 1, 28, 28)).shape, m.embed_features(torch.zeros(2, 1, 28, 28)).shape
(torch.Size([2, 10]), torch.Size([2, 8]))
>>> w = ImageCNN(ImageCNNConfig.wide())
>>> len(w.stages()), w(torch.zeros(1, 1, 64, 64)).shape
(8, torch.Size([1, 10]))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ImageCNNConfig:
    size: int = 28            # square input, one channel
    channels: tuple[int, ...] = (16, 32)   # one conv block per entry
    embed_dim: int = 32       # d: the width of the featurizer's output
    classes: int = 10

    def __post_init__(self) -> None:
        if not self.channels or any(c < 1 for c in self.channels):
            raise ValueError(f"image CNN: at least one conv block, each with >= 1 channel, got {self.channels}")
        if self.size < 1 or self.size % (1 << len(self.channels)):
            raise ValueError(f"image size must be a multiple of {1 << len(self.channels)} "
                             f"({len(self.channels)} 2x2 pools), got {self.size}")

    @classmethod
    def wide(cls) -> "ImageCNNConfig":
        """The preset for the parallel modes: 6 blocks of 64-256 channels on 64x64 inputs."""
        return cls(size=64, channels=(64, 96, 128, 160, 192, 256), embed_dim=256, classes=10)

    @property
    def side(self) -> int:
        """The feature map's side after the last block."""
        return self.size >> len(self.channels)

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
        self.cfg = cfg
        c_in = 1
        for i, c in enumerate(cfg.channels, 1):  # conv1, conv2, ...: the featurizer's weight names
            setattr(self, f"conv{i}", conv_block(c_in, c))
            c_in = c
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(c_in * cfg.side * cfg.side, cfg.embed_dim), nn.ReLU())
        self.head = nn.Linear(cfg.embed_dim, cfg.classes)

    def stages(self) -> list[tuple[str, nn.Module]]:
        """(name, module) in forward order: pixels -> ... -> logits."""
        convs = [(f"conv{i}", getattr(self, f"conv{i}")) for i in range(1, len(self.cfg.channels) + 1)]
        return convs + [("embed", self.embed), ("head", self.head)]

    def fine_stages(self) -> list[tuple[str, nn.Module]]:
        """`stages()` with each conv block cut after its ReLU: (`convI`: conv and ReLU,
        `poolI`: the max pool), so a partitioner can also cut between the two (on a CPU the
        pool of a wide early block costs as much as its conv). The parameter names stay the
        model's: the first part keeps the block's own indices (`conv1.0.weight`).

        >>> [n for n, _ in ImageCNN().fine_stages()]
        ['conv1', 'pool1', 'conv2', 'pool2', 'embed', 'head']
        """
        out: list[tuple[str, nn.Module]] = []
        for i in range(1, len(self.cfg.channels) + 1):
            block = getattr(self, f"conv{i}")
            out += [(f"conv{i}", block[:2]), (f"pool{i}", block[2])]
        return out + [("embed", self.embed), ("head", self.head)]

    def embed_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, S) normalised pixels -> (B, d) features (every stage before the head)."""
        for _, stage in self.stages()[:-1]:
            x = stage(x)
        return x

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
