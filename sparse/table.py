"""Hashed parameter tables: one row of `dim` weights per hashed id.

Rows start from a deterministic function of (seed, id), so any process (a
local trainer, a parameter-server shard owning some ids, a server) sees the
same initial row for an id without storing it. Storage is allocated zeroed
and a row is materialized on first touch, so memory grows with the ids seen,
not with 2**bits (the OS maps untouched zero pages lazily).

>>> t = HashedTable("emb", num_rows=8, dim=2, init_scale=0.1, seed=1)
>>> bool(np.allclose(t.lookup(np.array([3])), t.gather(np.array([3]))))
True
"""
from __future__ import annotations

import numpy as np

from mariana.sparse.errors import ModelDirError
from mariana.sparse.hashing import fmix64

_INIT_SALT = np.uint64(0x2545F4914F6CDD1D)


def init_rows(ids: np.ndarray, dim: int, scale: float, seed: int) -> np.ndarray:
    """(len(ids), dim) float32 uniform in [-scale, scale), a pure function of (seed, id, column)."""
    if scale == 0.0:
        return np.zeros((len(ids), dim), np.float32)
    cells = (np.asarray(ids, np.int64)[:, None] * dim + np.arange(dim)).astype(np.uint64)
    bits = fmix64(cells ^ fmix64(np.array([seed], np.uint64) ^ _INIT_SALT))
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
    return ((unit * 2.0 - 1.0) * scale).astype(np.float32)


class HashedTable:
    """Weights (num_rows, dim) float32 plus optimizer state arrays of the same shape.

    `row_ids` maps local rows to global ids (identity for a whole table; a
    parameter-server shard holds every S-th id) so that initial values are
    the same wherever a row lives.
    """

    def __init__(self, name: str, num_rows: int, dim: int, init_scale: float = 0.0, seed: int = 0,
                 id_offset: int = 0, id_stride: int = 1):
        self.name, self.num_rows, self.dim = name, num_rows, dim
        self.init_scale, self.seed = init_scale, seed
        self.id_offset, self.id_stride = id_offset, id_stride
        self.weights = np.zeros((num_rows, dim), np.float32)
        self.touched = np.zeros(num_rows, bool)
        self.state: dict[str, np.ndarray] = {}

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.int64) * self.id_stride + self.id_offset

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """Rows' weights (a copy), without materializing untouched rows."""
        out = self.weights[rows]
        if not self.init_scale:  # untouched rows are zeros, as their initial values (LR's weights)
            return out
        fresh = ~self.touched[rows]
        if fresh.any():
            out[fresh] = init_rows(self.global_ids(rows[fresh]), self.dim, self.init_scale, self.seed)
        return out

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows' weights (a copy) for training; materializes untouched rows.

        `rows` must be unique (duplicates would be initialized twice, harmlessly).
        """
        self.materialize(rows)
        return np.take(self.weights, rows, axis=0)  # several times faster than weights[rows]

    def materialize(self, rows: np.ndarray) -> None:
        """Give untouched `rows` their initial values (a row is written once, on first touch)."""
        fresh = rows[~self.touched[rows]]
        if fresh.size:
            if self.init_scale:
                self.weights[fresh] = init_rows(self.global_ids(fresh), self.dim, self.init_scale, self.seed)
            self.touched[fresh] = True

    def state_array(self, key: str) -> np.ndarray:
        """Optimizer state of the same shape as the weights, zero-initialized."""
        arr = self.state.get(key)
        if arr is None:
            arr = self.state[key] = np.zeros((self.num_rows, self.dim), np.float32)
        return arr

    def touched_rows(self) -> np.ndarray:
        return np.flatnonzero(self.touched)

    def load_rows(self, rows: np.ndarray, weights: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Restore saved rows (a version's, a shard's export) after checking them: ModelDirError
        naming the array as a version names it (table.<name>.<key>) when they do not fit."""
        problem = self.rows_problem(rows, weights, state)
        if problem:
            raise ModelDirError(f"table.{self.name}.{problem[0]} {problem[1]}")
        self.weights[rows] = weights
        self.touched[rows] = True
        for key, values in state.items():
            self.state_array(key)[rows] = values

    def rows_problem(self, rows: np.ndarray, weights: np.ndarray, state: dict[str, np.ndarray]
                     ) -> tuple[str, str] | None:
        """What makes saved rows unfit for this table, as (the array: "rows", "weights" or a state
        key; what is wrong), or None. Rows: (n,) integers in [0, num_rows), each once (numpy would
        wrap a negative id round, and a repeated one would take one of its rows' weights); weights
        and each state array: (n, dim) floats. Vectorized passes only: ~3 ms a million rows.

        >>> t = HashedTable("emb", num_rows=8, dim=2)
        >>> t.rows_problem(np.array([3, -1]), np.zeros((2, 2), np.float32), {})
        ('rows', 'holds row ids from -1 to 3, expected 0 <= id < 8')
        """
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            return "rows", f"is {_kind(rows)}, expected a 1-d array of integers"
        if weights.dtype.kind != "f" or weights.ndim != 2 or weights.shape[1] != self.dim:
            return "weights", f"is {_kind(weights)}, expected floats of shape ({len(rows)}, {self.dim})"
        if len(weights) != len(rows):
            return "rows", f"holds {len(rows)} ids, expected one for each of the {len(weights)} rows of its weights"
        for key, arr in state.items():
            if arr.dtype.kind != "f" or arr.shape != weights.shape:
                return key, f"is {_kind(arr)}, expected floats of its weights' shape {weights.shape}"
        if not len(rows):
            return None
        lo, hi = rows.min(), rows.max()
        if lo < 0 or hi >= self.num_rows:
            return "rows", f"holds row ids from {lo} to {hi}, expected 0 <= id < {self.num_rows}"
        if not (rows[1:] > rows[:-1]).all():  # a version's rows ascend; others are sorted to find repeats
            ordered = np.sort(rows)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if repeated.size:
                return "rows", f"holds {repeated.size} repeated row ids (the first: {repeated[0]}), expected each once"
        return None


def _kind(a: np.ndarray) -> str:
    """'float32 of shape (3, 4)': an array as an error names it."""
    return f"{a.dtype} of shape {a.shape}"
