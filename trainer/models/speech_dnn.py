"""The frame-level speech DNN: a context window of log-mel frames in, the
posteriors of the 10 digits out; an utterance's score is the sum of its frames'
log-posteriors (featurizer/speech.py makes the frames).

    x       (B, (2K+1) * n_mels)  float32, one row per frame
    input   (x - mean) / std       per dimension, measured on the training frames (buffers)
    hidden  [linear, ReLU] x len(hidden)
    head    linear -> classes      (B, classes) logits

`frozen_ops` writes the network as plain ops over state_dict names, as the image
CNN does, so the exported recognizer (featurizer/speech.py's SpeechRecognizer)
runs it without this file.

>>> m = SpeechDNN(SpeechDNNConfig(input_dim=6, hidden=(8, 8)))
>>> m(torch.zeros(3, 6)).shape, sum(p.numel() for p in m.parameters())
(torch.Size([3, 10]), 218)
>>> [op["op"] for op in frozen_ops(m)]
['standardise', 'linear', 'relu', 'linear', 'relu', 'linear']
>>> utterance_scores(torch.zeros(4, 10), torch.tensor([0, 0, 1, 1]), 2).shape
torch.Size([2, 10])
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SpeechDNNConfig:
    input_dim: int = 440                    # (2K+1) * n_mels: 11 frames of 40 bins
    hidden: tuple[int, ...] = (512, 512, 512)
    classes: int = 10

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden": list(self.hidden)}

    @classmethod
    def from_dict(cls, d: dict) -> "SpeechDNNConfig":
        return cls(input_dim=int(d["input_dim"]), hidden=tuple(int(h) for h in d["hidden"]),
                   classes=int(d["classes"]))


class SpeechDNN(nn.Module):
    def __init__(self, cfg: SpeechDNNConfig = SpeechDNNConfig()):
        super().__init__()
        if cfg.input_dim < 1 or cfg.classes < 2 or any(h < 1 for h in cfg.hidden):
            raise ValueError(f"speech DNN: input_dim >= 1, hidden widths >= 1 and classes >= 2, got {cfg}")
        self.cfg = cfg
        self.register_buffer("input_mean", torch.zeros(cfg.input_dim))
        self.register_buffer("input_std", torch.ones(cfg.input_dim))
        layers: list[nn.Module] = []
        width = cfg.input_dim
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.hidden = nn.Sequential(*layers)
        self.head = nn.Linear(width, cfg.classes)

    def set_input_stats(self, x: torch.Tensor) -> None:
        """Standardise inputs by the mean and std of `x` (the training frames); a constant
        dimension keeps std 1."""
        with torch.no_grad():
            std = x.std(0)
            self.input_mean.copy_(x.mean(0))
            self.input_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, input_dim) frames -> (B, last hidden width): the last hidden layer's output."""
        return self.hidden((x - self.input_mean) / self.input_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def utterance_scores(logits: torch.Tensor, utterance: torch.Tensor, count: int) -> torch.Tensor:
    """(frames, classes) logits and each frame's utterance id in [0, count) -> (count, classes):
    per utterance, the sum of its frames' log-posteriors."""
    logp = F.log_softmax(logits.double(), dim=1)
    return logp.new_zeros(count, logits.shape[1]).index_add_(0, utterance, logp)


def frozen_ops(model: SpeechDNN) -> list[dict]:
    """The network as plain ops over state_dict names (what SpeechRecognizer runs)."""
    ops: list[dict] = [{"op": "standardise", "mean": "input_mean", "std": "input_std"}]
    for i, layer in enumerate(model.hidden):
        if isinstance(layer, nn.Linear):
            ops.append({"op": "linear", "weight": f"hidden.{i}.weight", "bias": f"hidden.{i}.bias"})
        else:
            ops.append({"op": "relu"})
    ops.append({"op": "linear", "weight": "head.weight", "bias": "head.bias"})
    return ops
