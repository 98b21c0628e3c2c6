"""Training a dense model: every parameter inside the model (no hashed tables),
every batch a pair of tensors (inputs, targets). Read top to bottom:

    device = resolve_device(cfg.device)          "auto": CUDA when there is one
    loss, opt = loss_fn(cfg.loss), make_optimizer(cfg, model.parameters())
    for epoch:
        train_dense(model, tensor_batches(x, y, cfg.batch_size, gen), loss, opt, device)
                                                 -> DenseRecord (steps, rows, mean loss, seconds)
        evaluate_dense(model, tensor_batches(x_val, y_val, 512), loss, device)
                                                 -> DenseEval (rows, mean loss, accuracy)

The image featurizer trains this way (trainer/featurizer_train.py); data parallel
and model parallel training wrap the same step.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mariana.sparse.errors import ConfigError
from mariana.trainer.config import DenseConfig

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> scalar

# DenseConfig.loss (trainer.config.LOSSES) -> the function. "bce" takes logits, as every model here outputs.
_LOSSES: dict[str, Loss] = {"cross_entropy": F.cross_entropy, "bce": F.binary_cross_entropy_with_logits,
                            "mse": F.mse_loss}


@dataclass
class DenseProgress:
    steps: int
    rows: int            # trained in this pass so far
    loss: float          # mean loss of the rows since the last report
    rows_per_s: float
    seconds: float       # since the pass began


@dataclass
class DenseRecord:
    """One pass of `train_dense`."""

    steps: int
    rows: int
    loss: float | None   # mean over the pass's rows (None: no rows)
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DenseEval:
    rows: int
    loss: float | None      # mean over the rows
    accuracy: float | None  # targets that are class ids: the share of rows whose top output is theirs


def resolve_device(name: str) -> torch.device:
    """A DenseConfig.device as a torch device; "auto": CUDA when there is one.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index or 0) >= count:
            raise ConfigError(f"dense.device = {name!r}, but this machine has {count} CUDA device(s)")
    return device


def resolve_backend(name: str, device: torch.device) -> str:
    """A DenseConfig.backend for processes on `device`; "auto": nccl on CUDA, gloo on the CPU.

    >>> resolve_backend("auto", torch.device("cpu"))
    'gloo'
    """
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError(f"dense.backend = 'nccl' needs a CUDA device, not {device}")
    return name


def loss_fn(name: str, reduction: str = "mean") -> Loss:
    """The loss `name` (DenseConfig.loss): (outputs, targets) -> the mean over rows, or
    their "sum". "cross_entropy" takes (B, classes) scores and class ids, "bce" logits
    and 0/1 targets, "mse" any values.

    >>> loss_fn("bce", "sum")(torch.zeros(2), torch.tensor([0.0, 1.0])).item()  # 2 ln 2
    1.3862943649291992
    """
    f = _LOSSES.get(name)
    if f is None:
        raise ConfigError(f"dense.loss: unknown loss {name!r} (use one of {list(_LOSSES)})")
    return f if reduction == "mean" else functools.partial(f, reduction=reduction)


def make_optimizer(cfg: DenseConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer DenseConfig names, with its lr, momentum (sgd) and weight decay.

    >>> make_optimizer(DenseConfig(optimizer="sgd", lr=0.1, momentum=0.9), [torch.zeros(1)]).defaults["momentum"]
    0.9
    """
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def tensor_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                   generator: torch.Generator | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) cut into batches of `batch_size` rows: in a random order drawn from `generator`
    (when the iteration starts), in order without one.

    >>> [xb.tolist() for xb, _ in tensor_batches(torch.arange(5), torch.arange(5), 2)]
    [[0, 1], [2, 3], [4]]
    """
    if generator is None:
        for start in range(0, len(x), batch_size):
            yield x[start:start + batch_size], y[start:start + batch_size]
        return
    order = torch.randperm(len(x), generator=generator)
    for start in range(0, len(x), batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a copy to CUDA does not wait (it overlaps when `t` is pinned). On its
    device already: `t` itself."""
    return t.to(device, non_blocking=device.type == "cuda")


def train_dense(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss: Loss,
                optimizer: torch.optim.Optimizer, device: torch.device,
                progress: Callable[[DenseProgress], None] | None = None, report_every: float = 1.0) -> DenseRecord:
    """One pass over `batches`: per (x, y), forward, `loss` (a mean over the batch), backward,
    an optimizer step. `progress` sees the rows so far and the mean loss since it was last
    called about every `report_every` seconds, and after the last batch. The losses are
    summed on `device` (read back only to report), so a CUDA step does not wait for the last.

    >>> _ = torch.manual_seed(0)
    >>> model, x = nn.Linear(3, 1), torch.randn(64, 3)
    >>> y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    >>> opt = make_optimizer(DenseConfig(optimizer="sgd", lr=0.1), model.parameters())
    >>> first = train_dense(model, tensor_batches(x, y, 8), loss_fn("mse"), opt, torch.device("cpu"))
    >>> later = train_dense(model, tensor_batches(x, y, 8), loss_fn("mse"), opt, torch.device("cpu"))
    >>> first.steps, first.rows, later.loss < first.loss / 10
    (8, 64, True)
    """
    model.train()
    t0 = last = time.perf_counter()
    steps = rows = window_rows = 0
    # float64 sums of (batch mean loss * rows): the same numbers as Python floats would be
    total = torch.zeros((), dtype=torch.float64, device=device)
    window = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = to_device(x, device), to_device(y, device)
        batch_loss = loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        batch_loss.backward()
        optimizer.step()
        n = len(y)
        part = batch_loss.detach().double() * n
        total += part
        window += part
        steps, rows, window_rows = steps + 1, rows + n, window_rows + n
        now = time.perf_counter()
        if progress and now - last >= report_every:
            progress(DenseProgress(steps, rows, float(window) / window_rows, rows / max(now - t0, 1e-9), now - t0))
            window.zero_()
            window_rows, last = 0, now
    now = time.perf_counter()
    if progress and window_rows:
        progress(DenseProgress(steps, rows, float(window) / window_rows, rows / max(now - t0, 1e-9), now - t0))
    return DenseRecord(steps, rows, float(total) / rows if rows else None, now - t0)


def evaluate_dense(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss: Loss,
                   device: torch.device) -> DenseEval:
    """The mean `loss` over `batches` with the model in eval mode, and the accuracy when the
    targets are class ids (integers) and the outputs (B, classes) scores.

    >>> model = nn.Linear(2, 2, bias=False)
    >>> _ = nn.init.eye_(model.weight)
    >>> x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])
    >>> evaluate_dense(model, [(x, y)], loss_fn("cross_entropy"), torch.device("cpu")).accuracy  # 2 of 3
    0.666...
    """
    model.eval()
    rows = 0
    total = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    classes = None
    with torch.inference_mode():
        for x, y in batches:
            x, y = to_device(x, device), to_device(y, device)
            out = model(x)
            total += loss(out, y).double() * len(y)
            classes = out.ndim == 2 and not y.is_floating_point()
            if classes:
                correct += (out.argmax(1) == y).sum()
            rows += len(y)
    if not rows:
        return DenseEval(0, None, None)
    return DenseEval(rows, float(total) / rows, int(correct) / rows if classes else None)
