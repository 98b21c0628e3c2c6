"""Hashed parameter tables: one row of `dim` weights per hashed id.

Rows start from a deterministic function of (seed, id), so any process (a
local trainer, a parameter-server shard owning some ids, a server) sees the
same initial row for an id without storing it. Storage is allocated zeroed
and a row is materialized on first touch, so memory grows with the pages of ids
seen, not with 2**bits (the OS maps untouched zero pages lazily, in 4 KiB pages
for big tables: `sparse_zeros`).

>>> t = HashedTable("emb", num_rows=8, dim=2, init_scale=0.1, seed=1)
>>> bool(np.allclose(t.lookup(np.array([3])), t.gather(np.array([3]))))
True
"""
from __future__ import annotations

import mmap

import numpy as np

from mariana.sparse.errors import ModelDirError
from mariana.sparse.hashing import fmix64

_INIT_SALT = np.uint64(0x2545F4914F6CDD1D)
SMALL_PAGES_BYTES = 64 << 20  # arrays this big or bigger are mapped in the OS's small pages (`sparse_zeros`)


def sparse_zeros(shape: tuple, dtype) -> np.ndarray:
    """A zeroed array whose memory follows the pages written. numpy asks Linux for 2 MiB
    pages (madvise MADV_HUGEPAGE) on big arrays, so a row written anywhere took 2 MiB: 20,000
    ids written into a 2^28-row table took 1.06 GB and 1.27 s of page zeroing, against 130 MB
    and 0.03 s in 4 KiB pages (docs/benchmarks.md). Arrays of SMALL_PAGES_BYTES and more are
    an anonymous mapping with MADV_NOHUGEPAGE (Linux documents it to hold under THP "always"
    too; measured here under "madvise" only); smaller ones are np.zeros. Random reads over a
    table with every page written: ~10% slower.

    >>> a = sparse_zeros((1 << 25,), np.float32)
    >>> a[[3, -1]] = 1.5; float(a.sum()), a.flags.writeable
    (3.0, True)
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < SMALL_PAGES_BYTES:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)  # the array holds the mapping; unmapped with it


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
        self.weights = sparse_zeros((num_rows, dim), np.float32)
        self.touched = sparse_zeros((num_rows,), bool)
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
            arr = self.state[key] = sparse_zeros((self.num_rows, self.dim), np.float32)
        return arr

    def touched_rows(self) -> np.ndarray:
        return np.flatnonzero(self.touched)

    def saved_arrays(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(rows written, ascending; their weights; their optimizer state): what a version saves."""
        rows = self.touched_rows()
        return rows, self.weights[rows], {key: arr[rows] for key, arr in self.state.items()}

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


# ---- a saved table that is only read (a server's) ----------------------------------------------

TABLE_FORMS = ("dense", "frozen", "auto")  # a loaded version's tables (`ModelBundle.load`, serve.tables)
DENSE_MIN_BYTES = 64 << 20  # tables this small stay a HashedTable when read: its lookups are the cheapest
_EMPTY = -1
FEW_IDS = 128  # `RowIndex.positions` finds this many ids or fewer in plain Python ...
FEW_PROBES = 16  # ... and the last this many ids still probing


def index_slots(n: int) -> int:
    """A `RowIndex`'s slots for n ids: the power of two >= 2n (at most half full), at least 8."""
    return 1 << max(3, (2 * n - 1).bit_length())


class RowIndex:
    """Where each of a table's saved ids has its row: an open-addressing hash table (linear
    probing, at most half full) from id to row (0..n-1), `n` for an id not saved. Ids are
    fmix64 outputs (sparse/hashing.py), so their low bits index it as they are. 16 bytes a
    slot, 2-4 slots an id.

    >>> ix = RowIndex(np.array([5, 13, 21, 2]))  # 5, 13 and 21 share a slot of 8
    >>> ix.positions(np.array([13, 2, 7, 21])).tolist(), ix.rows_of([21, 8, 5])
    ([1, 3, 4, 2], [2, 4, 0])
    """

    def __init__(self, ids: np.ndarray):
        ids = np.asarray(ids, np.int64)
        self.n = n = len(ids)
        self.mask = index_slots(n) - 1
        self.keys = np.full(self.mask + 1, _EMPTY, np.int64)
        self.rows = np.full(self.mask + 1, n, np.int64)
        slot, todo = ids & self.mask, np.arange(n)
        while todo.size:  # each round the first id of each free slot takes it; the rest probe on
            s = slot[todo]
            free = self.keys[s] == _EMPTY
            _, first = np.unique(s[free], return_index=True)
            won = todo[free][first]
            self.keys[slot[won]], self.rows[slot[won]] = ids[won], won
            todo = todo[self.keys[slot[todo]] != ids[todo]]
            slot[todo] = (slot[todo] + 1) & self.mask
        self._keys, self._rows = memoryview(self.keys), memoryview(self.rows)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row (n when not saved), in the shape of `ids`. Up to FEW_IDS ids (a
        request's rows) in plain Python: ~10 numpy calls on small arrays cost ~25 us more."""
        flat = np.asarray(ids, np.int64).reshape(-1)
        if len(flat) <= FEW_IDS:
            return np.array(self.rows_of(flat.tolist()), np.int64).reshape(np.shape(ids))
        slot = flat & self.mask
        found = self.keys[slot]
        todo = np.flatnonzero((found != flat) & (found != _EMPTY))
        while todo.size > FEW_PROBES:  # ~1 id in 4 probes on; each round ~5 calls, the last few on few ids
            slot[todo] = (slot[todo] + 1) & self.mask
            found = self.keys[slot[todo]]
            todo = todo[(found != flat[todo]) & (found != _EMPTY)]
        keys, mask = self._keys, self.mask
        for j in todo.tolist():  # the last few in plain Python
            i, s = int(flat[j]), (int(slot[j]) + 1) & mask
            while keys[s] != i and keys[s] != _EMPTY:
                s = (s + 1) & mask
            slot[j] = s
        return self.rows[slot].reshape(np.shape(ids))

    def holds(self, ids: np.ndarray) -> bool:
        """Whether `ids` are the ids it was made of, in that order (another table's index fits)."""
        return len(ids) == self.n and bool((self.positions(ids) == np.arange(self.n)).all())

    def rows_of(self, ids: list[int]) -> list[int]:
        """`positions` of a few ids in plain Python: a server's lone request makes no numpy call."""
        keys, rows, mask = self._keys, self._rows, self.mask
        out = []
        for i in ids:
            s = i & mask
            k = keys[s]
            while k != i and k != _EMPTY:
                s = (s + 1) & mask
                k = keys[s]
            out.append(rows[s])
        return out


class _Saved:
    """`FrozenTable.touched`: indexed by ids as HashedTable's flags are, True where a row was saved."""

    def __init__(self, index: RowIndex):
        self.index = index

    def __getitem__(self, ids) -> np.ndarray:
        return self.index.positions(ids) != self.index.n


class FrozenTable:
    """A saved table for reading only: its rows' weights in saved order and a `RowIndex`, so its
    memory follows the rows saved. A HashedTable takes num_rows x dim floats, and a version's
    rows, spread over them by the hash, touch nearly every page: 1.4 GB for an LR at bits 28
    whatever its rows. `lookup` and `touched[ids]` read as HashedTable's. `values` has one row
    more, zeros, for ids not saved (`RowIndex.rows_of` gives them row n); `saved` flags the rows
    that are not that one.

    >>> t = HashedTable("emb", num_rows=64, dim=2, init_scale=0.1, seed=1)
    >>> t.load_rows(np.array([3, 40]), np.ones((2, 2), np.float32), {})
    >>> f = FrozenTable.of(t, RowIndex(np.array([3, 40])), np.ones((2, 2), np.float32))
    >>> ids = np.array([40, 7, 3])
    >>> bool(np.array_equal(f.lookup(ids), t.lookup(ids))), f.touched[ids].tolist()
    (True, [True, False, True])
    """

    def __init__(self, name: str, num_rows: int, dim: int, init_scale: float, seed: int, index: RowIndex,
                 weights: np.ndarray, ids: np.ndarray | None = None, state: dict[str, np.ndarray] | None = None):
        """`ids` (ascending, those of `index`) and `state` (each (n, dim)): kept for `saved_arrays`
        (a model assembled from a cluster's shards, which is saved); a server's keeps neither."""
        self.name, self.num_rows, self.dim = name, num_rows, dim
        self.init_scale, self.seed, self.index = init_scale, seed, index
        self.ids, self.state = ids, state
        self.values = np.zeros((index.n + 1, dim), np.float32)
        self.values[:index.n] = weights
        self.saved = np.ones(index.n + 1, bool)
        self.saved[index.n] = False
        self.touched = _Saved(index)

    @classmethod
    def of(cls, table: HashedTable, index: RowIndex, weights: np.ndarray, ids: np.ndarray | None = None,
           state: dict[str, np.ndarray] | None = None) -> "FrozenTable":
        """The frozen form of `table` (a whole one) holding `weights`, one row per id of `index`."""
        return cls(table.name, table.num_rows, table.dim, table.init_scale, table.seed, index, weights, ids, state)

    def saved_arrays(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """As HashedTable's; only for a table made with its ids and state."""
        if self.ids is None or self.state is None:
            raise ValueError(f"table {self.name} was loaded for reading only: it has no ids and state to save")
        return self.ids, self.values[:self.index.n], self.state

    @property
    def nbytes(self) -> int:
        """Its own arrays (the index, maybe shared with other tables, apart)."""
        kept = (self.ids.nbytes if self.ids is not None else 0) + sum(a.nbytes for a in (self.state or {}).values())
        return self.values.nbytes + self.saved.nbytes + kept

    def lookup(self, ids: np.ndarray, pos: np.ndarray | None = None) -> np.ndarray:
        """Ids' weights (a copy); ids not saved read their initial values, as HashedTable's do.
        `pos`: the ids' `index.positions` when found already (another table of the same index)."""
        if pos is None:
            pos = self.index.positions(ids)
        out = self.values[pos]
        if self.init_scale:
            fresh = pos == self.index.n
            if fresh.any():
                out[fresh] = init_rows(np.asarray(ids)[fresh], self.dim, self.init_scale, self.seed)
        return out


def frozen_pays(num_rows: int, dims: int, saved: int) -> bool:
    """Whether tables of `num_rows` rows and `dims` floats a row in all, `saved` of them saved,
    take less memory frozen (FrozenTable) than as HashedTables by enough to pay for their
    slower lookups: at least DENSE_MIN_BYTES dense and under half of it frozen.

    >>> frozen_pays(1 << 22, 1, 1_000_000), frozen_pays(1 << 28, 1, 1_000_000), frozen_pays(1 << 24, 17, 1 << 23)
    (False, True, False)
    """
    dense = num_rows * (4 * dims + 1)
    frozen = (saved + 1) * (4 * dims + 1) + 16 * index_slots(saved)
    return dense >= DENSE_MIN_BYTES and 2 * frozen <= dense
