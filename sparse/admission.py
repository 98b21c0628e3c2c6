"""Frequency-based admission of ids (`hashing.min_count` = K).

An id gets rows of its own in the hashed tables only once training has seen
it K times. Until then every entry of it is redirected, at train time, to its
field's rare id (`hashing.rare_ids`: the id of the reserved RARE token), so a
field's rare ids share one row that learns what an unseen-before value is
worth, and rare ids never get rows (nor optimizer state) of their own.

An id is admitted when its row exists (`touched`) or when its count, this
batch's occurrences included, reaches K. Rows are never dropped, so admission
is for good; and prediction needs no counts: an id without a row is looked up
as its field's rare row, which is exactly what training did with it.

>>> b = SparseBatch.from_fixed(np.array([[3, 7], [3, 9]]), num_ids=16, labels=np.ones(2, np.float32))
>>> counts, touched = Counts(16, min_count=2), np.zeros(16, bool)
>>> admit(b, counts, touched, rare=np.array([14, 15])).ids.tolist()   # 3 is seen twice: admitted
[3, 15, 3, 15]
>>> counts.get(np.array([7, 9])).tolist()
[1, 1]
"""
from __future__ import annotations

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.sparse.hashing import MAX_MIN_COUNT
from mariana.sparse.table import sparse_zeros

# Keys of the pending counts in a saved version's optimizer state and in a PS
# checkpoint: ids (global, int64) not admitted yet with a count > 0, and their counts.
IDS_KEY, COUNTS_KEY = "admission.ids", "admission.counts"


class Counts:
    """Occurrences per row as saturating uint16 (at `MAX_MIN_COUNT`), allocated on
    first use: the OS maps the zero pages of rows never counted lazily."""

    def __init__(self, num_rows: int, min_count: int):
        self.num_rows, self.min_count = num_rows, min_count
        self._n: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._n is None:
            self._n = sparse_zeros((self.num_rows,), np.uint16)  # memory follows the ids counted
        return self._n

    def get(self, rows: np.ndarray) -> np.ndarray:
        """(n,) int64 counts of `rows`."""
        return self.array[rows].astype(np.int64)

    def admitted(self, rows: np.ndarray, occ: np.ndarray, touched: np.ndarray) -> np.ndarray:
        """(n,) bool: rows that have a row already or reach K with `occ` more occurrences
        (nothing is counted here)."""
        return touched | (self.get(rows) + occ >= self.min_count)

    def add(self, rows: np.ndarray, occ: np.ndarray) -> None:
        """Count `occ` more occurrences of unique `rows`, saturating."""
        if len(rows):
            self.array[rows] = np.minimum(self.get(rows) + occ, MAX_MIN_COUNT)

    def pending(self, touched: np.ndarray) -> np.ndarray:
        """Rows counted but not admitted (no row yet): what a checkpoint keeps."""
        if self._n is None:
            return np.zeros(0, np.int64)
        counted = np.flatnonzero(self._n)
        return counted[~touched[counted]]  # `touched` indexed only: a FrozenTable's flags too


def occurrences(batch: SparseBatch) -> tuple[np.ndarray, np.ndarray]:
    """(U,) unique ids and (U,) int64 entries holding each."""
    uniq, inverse = batch.unique()
    return uniq, np.bincount(inverse, minlength=len(uniq))


def admit(batch: SparseBatch, counts: Counts, touched: np.ndarray, rare: np.ndarray) -> SparseBatch:
    """One training step's admission: count the batch's ids that have no row yet and
    redirect the entries of those still under K to their field's rare id.

    counts   Counts over all ids; touched (num_ids,) bool: ids that have rows;
    rare     (F,) int64: each field's rare id. The batch itself is not changed.
    """
    uniq, occ = occurrences(batch)
    ok = counts.admitted(uniq, occ, touched[uniq])
    counts.add(uniq[~ok], occ[~ok])
    return redirect(batch, ok, rare)[0]


def lookup_ids(batch: SparseBatch, touched: np.ndarray, rare: np.ndarray) -> SparseBatch:
    """The batch as a model trained with admission reads it: ids without a row
    take their field's rare row. A batch without its unique ids found (a request's
    few rows) stays without: one vectorised where."""
    if batch._unique is None and batch._parent_unique is None:
        ids = np.where(touched[batch.ids], batch.ids, rare[batch.fields])
        return _with_ids(batch, ids)
    uniq, _ = batch.unique()
    return redirect(batch, touched[uniq], rare)[0]


def redirect(batch: SparseBatch, admitted: np.ndarray, rare: np.ndarray) -> tuple[SparseBatch, np.ndarray]:
    """(batch', src): the entries whose id is not `admitted` ((U,) bool over
    `batch.unique()[0]`) take their field's `rare` id. batch' comes with its unique
    ids found, and they are `concat(uniq, rare)[src]`: a worker that pulled the
    rows of uniq and of every rare id takes batch's rows as `rows[src]`.

    >>> b = SparseBatch.from_fixed(np.array([[3, 7], [4, 7]]), num_ids=16)
    >>> uniq = b.unique()[0]
    >>> c, src = redirect(b, uniq != 4, rare=np.array([14, 15]))
    >>> c.ids.tolist(), np.concatenate([uniq, [14, 15]])[src].tolist() == c.unique()[0].tolist()
    ([3, 7, 14, 7], True)
    """
    uniq, inverse = batch.unique()
    n = len(uniq)
    if admitted.all():
        return batch, np.arange(n)
    # Passes over the entries are what this costs (a 4096-row Criteo batch: 160k
    # entries, 18k ids): one to find the entries that move, one to renumber.
    moved = np.flatnonzero((~admitted)[inverse])  # (m,) entries: few, ids seen < K times
    target = _rare_positions(uniq, rare)[batch.fields[moved]]  # (m,) into concat(uniq, rare)
    used = np.zeros(n + len(rare), bool)
    used[:n] = admitted
    used[target] = True
    src = np.flatnonzero(used)
    index = np.zeros(n + len(rare), np.int64)
    index[src] = np.arange(len(src))
    new_uniq = np.concatenate([uniq, rare])[src]
    new_inverse = np.take(index, inverse)
    new_inverse[moved] = index[target]
    ids = batch.ids.copy()
    ids[moved] = new_uniq[new_inverse[moved]]
    out = _with_ids(batch, ids)
    out.set_unique(new_uniq, new_inverse)
    return out, src


def _rare_positions(uniq: np.ndarray, rare: np.ndarray) -> np.ndarray:
    """(F,) where each field's rare id first stands in concat(uniq, rare): a rare id
    may equal an id of the batch or another field's rare id (hashing collisions), and
    a step must pull and update each id once."""
    pos = np.arange(len(uniq), len(uniq) + len(rare))
    hit = np.isin(uniq, rare)
    first = dict(zip(uniq[hit].tolist(), np.flatnonzero(hit).tolist()))
    for j, r in enumerate(rare.tolist()):
        pos[j] = first.setdefault(r, pos[j])
    return pos


def _with_ids(batch: SparseBatch, ids: np.ndarray) -> SparseBatch:
    return SparseBatch(ids=ids, indptr=batch.indptr, fields=batch.fields, num_fields=batch.num_fields,
                       num_ids=batch.num_ids, values=batch.values, dense=batch.dense, labels=batch.labels,
                       batch_id=batch.batch_id, _fixed=batch._fixed)


def to_arrays(counts: Counts, touched: np.ndarray, global_ids=None) -> dict[str, np.ndarray]:
    """{IDS_KEY, COUNTS_KEY}: the pending counts (global ids via `global_ids(rows)`)."""
    rows = counts.pending(touched)
    ids = rows if global_ids is None else global_ids(rows)
    return {IDS_KEY: np.asarray(ids, np.int64), COUNTS_KEY: counts.array[rows] if len(rows) else
            np.zeros(0, np.uint16)}


def load_arrays(counts: Counts, arrays: dict[str, np.ndarray], local_rows=None) -> None:
    """Add the pending counts of `to_arrays` (rows via `local_rows(ids)`); none there: nothing."""
    if IDS_KEY not in arrays:
        return
    ids = np.asarray(arrays[IDS_KEY], np.int64)
    counts.add(ids if local_rows is None else local_rows(ids), np.asarray(arrays[COUNTS_KEY], np.int64))
