"""The pure training step: (batch, pulled rows) -> loss and gradients.

Local training and parameter-server workers run exactly this; they differ
only in where rows come from and where gradients go (an in-process table, or
shards over the wire).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from mariana.sparse.batch import SparseBatch
from mariana.sparse.metrics import score_histogram
from mariana.sparse.optim import AdaGrad
from mariana.trainer.dense import Loss, loss_fn
from mariana.trainer.models.base import CTRModel, make_input

LOGLOSS_SUM = loss_fn("bce", "sum")  # binary cross-entropy on logits, summed over the batch


@dataclass
class StepResult:
    loss_sum: float                     # the batch's summed loss (logloss by default)
    num_rows: int
    row_grads: dict[str, np.ndarray]    # table -> (U, dim), one row per pulled id
    dense_grads: list[np.ndarray]       # one per model.parameters(), same order
    score_hist: tuple[np.ndarray, np.ndarray] | None = None  # (pos, neg) per logit bin: progressive AUC


def compute_grads(model: CTRModel, batch: SparseBatch, inverse: torch.Tensor, pulled: dict[str, np.ndarray],
                  loss: Loss = LOGLOSS_SUM) -> StepResult:
    """Forward and backward on one batch; `pulled[t]` holds table t's rows for
    the batch's unique ids and `inverse` maps each entry to its row. `loss`
    (logits, labels) -> the batch's summed loss. The gradients come back as numpy
    arrays (CPU), as the tables and the wire take them."""
    rows = {name: torch.from_numpy(r).requires_grad_() for name, r in pulled.items()}
    logits = model(make_input(batch, inverse, rows))
    loss_sum = loss(logits, torch.from_numpy(batch.labels))
    model.zero_grad(set_to_none=False)
    loss_sum.backward()
    return StepResult(
        loss_sum=float(loss_sum.detach()), num_rows=batch.num_rows,
        row_grads={name: r.grad.numpy() for name, r in rows.items()},
        dense_grads=[p.grad.numpy() for p in model.parameters()],
        score_hist=score_histogram(batch.labels, logits.detach().numpy()))


class DenseOptimizer:
    """`AdaGrad`'s step (sparse/optim.py) on whole dense tensors, every element each step,
    with torch ops on the parameters' own device: the same float32 operations in the
    same order as the numpy step on table rows, so on the CPU the same numbers.

    `params` (one device, one dtype) are updated in place: tensors (the model's
    parameters) or arrays, which are shared, not copied (a PS shard's flat dense
    vector). AdaGrad's sums of squared gradients live in one flat tensor, `sums` its
    per-parameter views; `state` shows them as numpy arrays over the same memory (CPU
    parameters): what checkpoints and snapshots read and write back.

    >>> w = torch.zeros(2)
    >>> DenseOptimizer(AdaGrad(lr=0.1, initial_accumulator=1e-8), [w]).apply([np.array([1.0, -2.0], np.float32)])
    >>> w.tolist()  # a first step: -lr * sign(g)
    [-0.1..., 0.1...]
    """

    def __init__(self, opt: AdaGrad, params: Sequence[torch.Tensor | np.ndarray]):
        if not isinstance(opt, AdaGrad):
            raise TypeError(f"dense parameters train with AdaGrad, not {type(opt).__name__}")
        self.opt = opt
        self.params = [torch.as_tensor(p).detach() for p in params]
        kinds = {(p.device, p.dtype) for p in self.params} or {(torch.device("cpu"), torch.float32)}
        if len(kinds) > 1:
            raise ValueError(f"dense parameters on one device and of one dtype, not {sorted(map(str, kinds))}")
        (device, dtype), = kinds
        # flat: the sqrt, the step's costliest op (a correctly rounded one: _sqrt_), runs once a step
        self._sum = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype, device=device)
        self._denom = torch.empty_like(self._sum)
        self.sums = _views(self._sum, self.params)
        self._denoms = _views(self._denom, self.params)

    @property
    def state(self) -> list[dict[str, np.ndarray]]:
        return [{"sum_sq": s.numpy()} for s in self.sums]

    def apply(self, grads: Sequence[torch.Tensor | np.ndarray]) -> None:
        """One step; `grads` (tensors or arrays) in the order of `params`."""
        lr, init = self.opt.lr, self.opt.initial_accumulator
        with _one_thread(self._sum.device):
            gs = [torch.as_tensor(g, device=w.device) for g, w in zip(grads, self.params)]
            torch._foreach_add_(self.sums, torch._foreach_mul(gs, gs))         # acc += g * g
            _sqrt_(torch.add(self._sum, init, out=self._denom))                 # sqrt(acc + init)
            torch._foreach_addcdiv_(self.params, gs, self._denoms, value=-lr)   # w -= lr * g / sqrt(...)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into views shaped as `like`."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in like]), like)]


def _sqrt_(x: torch.Tensor) -> None:
    """x <- its correctly rounded square root, as numpy's and CUDA's: torch's vectorized
    CPU sqrt (MKL) may be 1 ulp off, which would make every step differ from numpy's;
    in float64, rounded back, it is exact."""
    if x.device.type == "cpu":
        x.copy_(x.double().sqrt_())
    else:
        x.sqrt_()


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On the CPU, torch's ops without intra-op threads, as numpy's: on tensors this small
    a parallel region costs more than it saves, and on a busy machine (the parse threads)
    it waits for a descheduled thread (the DNN's dense update in `mariana train`, 2 cores:
    0.68 -> 0.38 ms a step)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
