"""The pure training step: (batch, pulled rows) -> loss and gradients.

Local training and parameter-server workers run exactly this; they differ
only in where rows come from and where gradients go (an in-process table, or
shards over the wire).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.sparse.metrics import score_histogram
from mariana.sparse.optim import AdaGrad
from mariana.trainer.models.registry import uses_torch

if TYPE_CHECKING:  # torch is imported where a torch model or tensor needs it: an LR job never does
    import torch

    from mariana.trainer.dense import Loss


@dataclass
class StepResult:
    loss_sum: float                     # the batch's summed loss (logloss by default)
    num_rows: int
    row_grads: dict[str, np.ndarray]    # table -> (U, dim), one row per pulled id
    dense_grads: list[np.ndarray]       # one per model.parameters(), same order
    score_hist: tuple[np.ndarray, np.ndarray] | None = None  # (pos, neg) per logit bin: progressive AUC


def compute_grads(model, batch: SparseBatch, inverse: np.ndarray, pulled: dict[str, np.ndarray],
                  loss: Loss | None = None) -> StepResult:
    """Forward and backward on one batch; `pulled[t]` holds table t's rows for
    the batch's unique ids and `inverse` maps each entry to its row (`batch.unique()`).
    `loss` (logits, labels) -> the batch's summed loss; None: logloss (binary
    cross-entropy on logits, summed), the only loss of a numpy model's own step (LR's
    `numpy_grads`). The gradients come back as numpy arrays (CPU), as the tables and
    the wire take them."""
    if not uses_torch(model):
        if loss is not None:
            raise TypeError(f"{type(model).__name__} trains on logloss only (its step is numpy's), not {loss!r}")
        return model.numpy_grads(batch, np.asarray(inverse), pulled)
    import torch

    from mariana.trainer.models.base import make_input

    loss = loss or _logloss_sum()
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


@functools.cache
def _logloss_sum() -> Loss:
    """Binary cross-entropy on logits, summed over the batch (made once, at the first torch step)."""
    from mariana.trainer.dense import loss_fn

    return loss_fn("bce", "sum")


class DenseOptimizer:
    """`AdaGrad`'s step (sparse/optim.py) on whole dense parameters, every element each step.
    Arrays (what bundles and shards pass: numpy views of any model's parameters, a shard's
    flat dense vector) step with that numpy step itself: for the DNN's 49,602 parameters
    0.05 ms a step against 0.13 with torch's ops. Tensors (a GPU's) step with torch ops on
    their own device: the same float32 operations in the same order, so on the CPU the
    same numbers.

    `params` (one device, one dtype) are updated in place, shared, not copied.
    AdaGrad's sums of squared gradients live in one flat tensor or array, `sums` its
    per-parameter views; `state` shows them as numpy arrays over the same memory (CPU
    parameters): what checkpoints and snapshots read and write back.

    >>> w = np.zeros(2, np.float32)
    >>> DenseOptimizer(AdaGrad(lr=0.1, initial_accumulator=1e-8), [w]).apply([np.array([1.0, -2.0], np.float32)])
    >>> w.tolist()  # a first step: -lr * sign(g)
    [-0.1..., 0.1...]
    """

    def __init__(self, opt: AdaGrad, params: Sequence[torch.Tensor | np.ndarray]):
        if not isinstance(opt, AdaGrad):
            raise TypeError(f"dense parameters train with AdaGrad, not {type(opt).__name__}")
        self.opt = opt
        self.torch = not all(isinstance(p, np.ndarray) for p in params)
        if not self.torch:
            kinds = {p.dtype for p in params}
            if len(kinds) > 1:
                raise ValueError(f"dense parameters on one device and of one dtype, not {sorted(map(str, kinds))}")
            self.params = list(params)
            self._sum = np.zeros(sum(p.size for p in self.params), kinds.pop() if kinds else np.float32)
            self.sums = _views(self._sum, self.params)
            return
        import torch

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
        return [{"sum_sq": s.numpy() if self.torch else s} for s in self.sums]

    def apply(self, grads: Sequence[torch.Tensor | np.ndarray]) -> None:
        """One step; `grads` (tensors or arrays) in the order of `params`."""
        if not self.torch:
            for w, acc, g in zip(self.params, self.sums, grads):
                self.opt.step(w, {"sum_sq": acc}, np.asarray(g, w.dtype).reshape(w.shape))
            return
        import torch

        lr, init = self.opt.lr, self.opt.initial_accumulator
        with _one_thread(self._sum.device):
            gs = [torch.as_tensor(g, device=w.device) for g, w in zip(grads, self.params)]
            torch._foreach_add_(self.sums, torch._foreach_mul(gs, gs))         # acc += g * g
            _sqrt_(torch.add(self._sum, init, out=self._denom))                 # sqrt(acc + init)
            torch._foreach_addcdiv_(self.params, gs, self._denoms, value=-lr)   # w -= lr * g / sqrt(...)


def _views(flat, like: list) -> list:
    """`flat` (a tensor or an array) cut into views shaped as `like`."""
    if isinstance(flat, np.ndarray):
        ends = np.cumsum([p.size for p in like])
        return [flat[end - p.size:end].reshape(p.shape) for end, p in zip(ends, like)]
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
def _one_thread(device) -> Iterator[None]:
    """On the CPU, torch's ops without intra-op threads, as numpy's: on tensors this small
    a parallel region costs more than it saves, and on a busy machine (the parse threads)
    it waits for a descheduled thread (the DNN's dense update in `mariana train` when it
    was done here, 2 cores: 0.68 -> 0.38 ms a step)."""
    import torch

    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
