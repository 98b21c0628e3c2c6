"""Logistic regression on hashed features (+ a dense block)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mariana.trainer.models.base import CTRModel, ModelInput, TableSpec, pool_fields, register


class LogisticRegression(CTRModel):
    """logit = sum of the rows' weights (x value) + dense @ w + bias."""

    tables = (TableSpec("linear", 1, 0.0, "linear"),)

    def __init__(self, dense_dim: int):
        super().__init__()
        self.dense = nn.Linear(dense_dim, 1, bias=False) if dense_dim else None
        if self.dense is not None:
            nn.init.zeros_(self.dense.weight)
        self.bias = nn.Parameter(torch.zeros(1))

    def numpy_logits(self, rows: dict[str, np.ndarray], num_rows: int, dense: np.ndarray) -> np.ndarray:
        """`CTRModel.numpy_logits`: each entry's weight (`rows["linear"]`) summed per row, +
        dense @ w + bias; the arrays are views of the parameters (they follow in-place changes)."""
        bias, weight = self.numpy_params()
        logit = rows["linear"].reshape(num_rows, -1).sum(axis=1)
        if weight is not None:
            logit = logit + dense @ weight
        return logit + bias

    def numpy_params(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(bias (1,), dense weight (Dd,) or None): views of the parameters, made once."""
        p = self.__dict__.get("_numpy")
        if p is None:
            p = self.__dict__["_numpy"] = (self.bias.detach().numpy(),
                                           None if self.dense is None else self.dense.weight.detach().numpy()[0])
        return p

    def forward(self, x: ModelInput) -> torch.Tensor:
        logit = pool_fields(x, "linear").sum(dim=(1, 2)) + self.bias  # (B,)
        if self.dense is not None:
            logit = logit + self.dense(x.dense).squeeze(1)
        return logit


@register("lr")
def build_lr(cfg, num_fields: int, dense_dim: int, image_dim: int, image_tower: int) -> LogisticRegression:
    """Image features (mode 1) are dense values like the others."""
    return LogisticRegression(dense_dim + image_dim)
