"""Logistic regression on hashed features (+ a dense block), in numpy.

No torch: its gradient has a closed form, so the step (`numpy_grads`), evaluation and
serving of an LR model never import torch (~0.7 s of every process's start, ~200 MB).
The parameters keep the names and order of the torch module it was before (`bias`, then
`dense.weight`), so versions saved then load now.
"""
from __future__ import annotations

import functools
import math
import struct

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.trainer.models.registry import TableSpec, register


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Click probabilities of logits, float32 (importing scipy for its expit costs a command
    0.07-0.18 s): exp of -|x| only, so no logit overflows.

    >>> sigmoid(np.array([0.0, 1000.0, -1000.0], np.float32)).tolist()
    [0.5, 1.0, 0.0]
    """
    x = np.asarray(logits, np.float32)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32, copy=False)


_F32 = struct.Struct("f")


def lone_pctr(weights: memoryview, bias: float, ids: list[int]) -> float:
    """The click probability of one row given as its ids (one per field, values 1), in plain
    Python floats: `bias` plus the ids' weights (`weights`: the linear table as a flat
    memoryview). A server's lone request runs every numpy call cold (a few us each between
    requests), and this makes none (~18 us less of a server's CPU per LR request). The
    logit is summed in float64 and the probability rounded to float32, as the arrays' is:
    within ~1e-7 of `numpy_logits` and `sigmoid`.

    >>> w = memoryview(np.array([0.5, -1.0, 2.0], np.float32))
    >>> lone_pctr(w, 0.0, [0, 2]) == float(sigmoid(np.float32(2.5))), lone_pctr(w, -1000.0, [1])
    (True, 0.0)
    """
    z = bias
    for i in ids:
        z += weights[i]
    if z >= 0.0:
        p = 1.0 / (1.0 + math.exp(-z))
    else:  # exp of -|z| only: no logit overflows
        e = math.exp(z)
        p = e / (1.0 + e)
    return _F32.unpack(_F32.pack(p))[0]


class LogisticRegression:
    """logit = sum of the rows' weights (x value) + dense @ w + bias.

    >>> m = LogisticRegression(2)
    >>> m.bias[...] = 0.5; m.weight[...] = [1.0, -1.0]
    >>> b = SparseBatch.from_fixed(np.array([[0, 1]]), num_ids=4, dense=np.array([[2.0, 1.0]], np.float32),
    ...                            labels=np.array([1.0], np.float32))
    >>> step = m.numpy_grads(b, np.array([0, 1]), {"linear": np.array([[0.25], [-0.75]], np.float32)})
    >>> round(float(m.logits(b, np.array([0.25, -0.75], np.float32))[0]), 6)  # 0.25 - 0.75 + 2 - 1 + 0.5
    1.0
    >>> [round(float(g), 4) for g in step.row_grads["linear"][:, 0]], round(step.loss_sum, 4)  # p - y = -0.2689
    ([-0.2689, -0.2689], 0.3133)
    """

    tables = (TableSpec("linear", 1, 0.0, "linear"),)
    uses_torch = False

    def __init__(self, dense_dim: int):
        self.bias = np.zeros(1, np.float32)
        self.weight = np.zeros((1, dense_dim), np.float32) if dense_dim else None

    def named_arrays(self) -> list[tuple[str, np.ndarray]]:
        """The dense parameters, named and ordered as the torch module's were."""
        return [("bias", self.bias)] + ([("dense.weight", self.weight)] if self.weight is not None else [])

    def logits(self, batch: SparseBatch, entry_weights: np.ndarray) -> np.ndarray:
        """(B,) float32: each entry's weight (x its value) summed per row, + dense @ w + bias.
        `entry_weights` (nnz,) float32, in the batch's entry order."""
        w = entry_weights if batch.values is None else entry_weights * batch.values
        if batch.fixed_width:
            logits = w.reshape(batch.num_rows, batch.num_fields).sum(axis=1)
        else:
            logits = np.bincount(batch.row_index(), weights=w, minlength=batch.num_rows).astype(np.float32)
        if self.weight is not None:
            logits = logits + batch.dense @ self.weight[0]
        return logits + self.bias

    def lone_scorer(self, linear: memoryview, tables: dict, rows_of=None):
        """`ModelBundle.lone_scorer`: one row's ids -> pCTR with no numpy call (`lone_pctr`);
        None with a dense block (its rows come through `predict_rows`). `rows_of`: {table: ids ->
        the rows that hold them} (frozen tables); None: an id is its row."""
        if self.weight is not None:
            return None
        score = functools.partial(lone_pctr, linear, float(self.bias[0]))
        if rows_of is None:
            return score
        linear_rows = rows_of["linear"]
        return lambda ids: score(linear_rows(ids))

    def numpy_logits(self, rows: dict[str, np.ndarray], num_rows: int, dense: np.ndarray) -> np.ndarray:
        """`CTRModel.numpy_logits`: a request's rows, one id per field (`rows["linear"]`:
        each entry's weight, row-major), + dense @ w + bias."""
        logit = rows["linear"].reshape(num_rows, -1).sum(axis=1)
        if self.weight is not None:
            logit = logit + dense @ self.weight[0]
        return logit + self.bias

    def numpy_grads(self, batch: SparseBatch, inverse: np.ndarray, pulled: dict[str, np.ndarray]):
        """One step's forward and backward on the summed logloss (`ps_step.StepResult`):
        `pulled["linear"]` holds the rows of the batch's distinct ids, `inverse` each
        entry's row among them. d loss / d logit = sigmoid(logit) - label; an id's gradient
        sums that (x value) over its entries."""
        from mariana.trainer.strategies.ps_step import StepResult
        from mariana.sparse.metrics import score_histogram

        table = pulled["linear"]
        logits = self.logits(batch, table[:, 0].take(inverse))
        labels = batch.labels
        x = logits.astype(np.float64)
        loss_sum = float((np.logaddexp(0.0, x) - x * labels).sum())  # log(1 + e^x) - y x, stable
        g = sigmoid(logits) - labels  # (B,) float32
        per_entry = np.repeat(g, batch.num_fields) if batch.fixed_width else g.take(batch.row_index())
        if batch.values is not None:
            per_entry = per_entry * batch.values
        row_grads = np.bincount(inverse, weights=per_entry, minlength=len(table)).astype(np.float32)
        dense_grads = [np.array([g.sum(dtype=np.float32)], np.float32)]
        if self.weight is not None:
            dense_grads.append((g @ batch.dense).astype(np.float32)[None, :])
        return StepResult(loss_sum=loss_sum, num_rows=batch.num_rows, row_grads={"linear": row_grads[:, None]},
                          dense_grads=dense_grads, score_hist=score_histogram(labels, logits))


@register("lr", uses_torch=False)
def build_lr(cfg, num_fields: int, dense_dim: int, image_dim: int, image_tower: int) -> LogisticRegression:
    """Image features (mode 1) are dense values like the others."""
    return LogisticRegression(dense_dim + image_dim)
