"""The pure training step: (batch, pulled rows) -> loss and gradients.

Local training and parameter-server workers run exactly this; they differ
only in where rows come from and where gradients go (an in-process table, or
shards over the wire).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mariana.sparse.batch import SparseBatch
from mariana.sparse.metrics import score_histogram
from mariana.sparse.optim import SparseOptimizer
from mariana.trainer.models.base import CTRModel, make_input


@dataclass
class StepResult:
    loss_sum: float                     # summed logloss of the batch
    num_rows: int
    row_grads: dict[str, np.ndarray]    # table -> (U, dim), one row per pulled id
    dense_grads: list[np.ndarray]       # one per model.parameters(), same order
    score_hist: tuple[np.ndarray, np.ndarray] | None = None  # (pos, neg) per logit bin: progressive AUC


def compute_grads(model: CTRModel, batch: SparseBatch, inverse: torch.Tensor,
                  pulled: dict[str, np.ndarray]) -> StepResult:
    """Forward and backward on one batch; `pulled[t]` holds table t's rows for
    the batch's unique ids and `inverse` maps each entry to its row."""
    rows = {name: torch.from_numpy(r).requires_grad_() for name, r in pulled.items()}
    logits = model(make_input(batch, inverse, rows))
    loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels), reduction="sum")
    model.zero_grad(set_to_none=False)
    loss.backward()
    return StepResult(
        loss_sum=float(loss.detach()), num_rows=batch.num_rows,
        row_grads={name: r.grad.numpy() for name, r in rows.items()},
        dense_grads=[p.grad.numpy() for p in model.parameters()],
        score_hist=score_histogram(batch.labels, logits.detach().numpy()))


class DenseOptimizer:
    """Applies a `SparseOptimizer`'s step to whole dense arrays (every row touched)."""

    def __init__(self, opt: SparseOptimizer, params: list[np.ndarray]):
        self.opt = opt
        self.params = params  # numpy views of the model's parameters, updated in place
        self.state = [{k: np.zeros_like(p) for k in opt.state_keys} for p in params]

    def apply(self, grads: list[np.ndarray]) -> None:
        for p, st, g in zip(self.params, self.state, grads):
            self.opt.step(p, st, g)
