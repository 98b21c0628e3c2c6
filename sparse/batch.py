"""`SparseBatch`: the one batch type at every boundary.

Hashed ids (+ optional values) in CSR form with the field of each entry, a
dense block and labels. Encoders make them, models read them, the wire sends
them, the cache stores them.

>>> b = SparseBatch.from_fixed(np.array([[3, 7], [3, 9]]), labels=np.array([1, 0], np.float32), num_ids=16)
>>> b.num_rows, b.num_fields, b.to_scipy().toarray()[1].nonzero()[0].tolist()
(2, 2, [3, 9])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mariana.sparse.errors import DataFormatError

if TYPE_CHECKING:
    import scipy.sparse


@dataclass
class SparseBatch:
    """Rows of hashed features.

    ids      (nnz,)   int64   hashed ids in [0, num_ids)
    indptr   (B+1,)   int64   CSR row offsets into ids
    fields   (nnz,)   int32   field index of each entry, in [0, num_fields)
    values   (nnz,)   float32 or None (None: every value is 1.0)
    dense    (B, Dd)  float32 dense block (Dd may be 0)
    labels   (B,)     float32 0/1, or None for unlabeled rows
    """

    ids: np.ndarray
    indptr: np.ndarray
    fields: np.ndarray
    num_fields: int
    num_ids: int
    values: np.ndarray | None = None
    dense: np.ndarray | None = None
    labels: np.ndarray | None = None
    batch_id: str = ""
    _fixed: bool | None = field(default=None, repr=False, compare=False)
    _unique: tuple | None = field(default=None, repr=False, compare=False)
    _parent_unique: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dense is None:
            self.dense = np.zeros((self.num_rows, 0), np.float32)

    @classmethod
    def from_fixed(cls, ids: np.ndarray, *, num_ids: int, labels: np.ndarray | None = None,
                   dense: np.ndarray | None = None, values: np.ndarray | None = None,
                   batch_id: str = "") -> "SparseBatch":
        """From a (B, F) id matrix with one entry per field per row."""
        b, f = ids.shape
        return cls(
            ids=np.ascontiguousarray(ids, dtype=np.int64).reshape(-1),
            indptr=np.arange(0, b * f + 1, f, dtype=np.int64) if f else np.zeros(b + 1, np.int64),
            fields=np.tile(np.arange(f, dtype=np.int32), b),
            num_fields=f, num_ids=num_ids,
            values=None if values is None else np.ascontiguousarray(values, np.float32).reshape(-1),
            dense=None if dense is None else np.ascontiguousarray(dense, np.float32),
            labels=labels, batch_id=batch_id, _fixed=f > 0)

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        return len(self.ids)

    @property
    def fixed_width(self) -> bool:
        """True when every row holds exactly one entry per field, in field order."""
        if self._fixed is None:
            f = self.num_fields
            self._fixed = (f > 0 and self.nnz == self.num_rows * f
                           and bool(np.array_equal(self.indptr, np.arange(0, self.nnz + 1, f)))
                           and bool((self.fields.reshape(-1, f) == np.arange(f, dtype=self.fields.dtype)).all()))
        return self._fixed

    def unique(self) -> tuple[np.ndarray, np.ndarray]:
        """(U,) distinct ids and (nnz,) int64 position of each entry's id among
        them: the rows a step pulls, and how entries find them. Cached."""
        if self._unique is None:
            if self._parent_unique is not None:
                self._unique = _dedupe_local(*self._parent_unique)
            else:
                self._unique = hash_unique(self.ids)
        return self._unique

    def set_unique(self, uniq: np.ndarray, inverse: np.ndarray) -> None:
        """Record a known (unique ids, inverse) pair; uniq[inverse] must equal ids."""
        self._unique = (uniq, inverse)

    def row_index(self) -> np.ndarray:
        """(nnz,) row of each entry."""
        return np.repeat(np.arange(self.num_rows, dtype=np.int64), np.diff(self.indptr))

    def slice(self, start: int, stop: int, batch_id: str = "") -> "SparseBatch":
        """Rows [start, stop) as a new batch (views where possible)."""
        stop = min(stop, self.num_rows)
        lo, hi = int(self.indptr[start]), int(self.indptr[stop])
        return SparseBatch(
            ids=self.ids[lo:hi], indptr=self.indptr[start:stop + 1] - lo, fields=self.fields[lo:hi],
            num_fields=self.num_fields, num_ids=self.num_ids,
            values=None if self.values is None else self.values[lo:hi],
            dense=self.dense[start:stop],
            labels=None if self.labels is None else self.labels[start:stop], batch_id=batch_id,
            _fixed=self._fixed,
            _parent_unique=None if self._unique is None else (self._unique[0], self._unique[1][lo:hi]))

    def split(self, rows: int) -> list["SparseBatch"]:
        """Consecutive batches of at most `rows` rows."""
        return [self.slice(i, i + rows, batch_id=f"{self.batch_id}:{i}" if self.batch_id else "")
                for i in range(0, self.num_rows, rows)]

    def to_scipy(self) -> scipy.sparse.csr_matrix:
        """(B, num_ids) CSR matrix; duplicate ids in a row are summed."""
        import scipy.sparse as sp  # here: importing scipy costs every command ~0.1 s
        vals = np.ones(self.nnz, np.float32) if self.values is None else self.values
        m = sp.csr_matrix((vals, self.ids, self.indptr), shape=(self.num_rows, self.num_ids))
        m.sum_duplicates()
        return m

    def to_torch(self) -> dict:
        """The arrays as torch tensors sharing memory where dtypes allow."""
        import torch  # the core stays importable without torch for tooling

        out = {"ids": torch.from_numpy(self.ids), "indptr": torch.from_numpy(self.indptr),
               "fields": torch.from_numpy(self.fields), "dense": torch.from_numpy(self.dense)}
        out["values"] = None if self.values is None else torch.from_numpy(self.values)
        out["labels"] = None if self.labels is None else torch.from_numpy(self.labels)
        return out

    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(meta, named arrays) for the wire and the sample cache: the unique
        ids and each entry's index into them (uint16 when there are at most
        65536 distinct ids, as in a few thousand Criteo rows, else int32: a
        quarter or half the bytes of the ids, and the step needs them anyway);
        the CSR layout only when not fixed-width. `from_arrays` is the inverse."""
        uniq, inverse = self.unique()
        if len(uniq) > np.iinfo(np.int32).max:
            raise DataFormatError(f"batch {self.batch_id!r}: too many distinct ids for the wire")
        index_type = np.uint16 if len(uniq) <= 1 << 16 else np.int32
        arrays = {"uniq": np.ascontiguousarray(uniq, np.int64),
                  "inverse": np.ascontiguousarray(inverse, index_type),
                  "dense": np.ascontiguousarray(self.dense, np.float32)}
        if self.labels is not None:
            arrays["labels"] = np.ascontiguousarray(self.labels, np.float32)
        if self.values is not None:
            arrays["values"] = np.ascontiguousarray(self.values, np.float32)
        fixed = self.fixed_width
        if not fixed:
            arrays["indptr"] = np.ascontiguousarray(self.indptr, np.int64)
            arrays["fields"] = np.ascontiguousarray(self.fields, np.int32)
        meta = {"rows": self.num_rows, "num_fields": self.num_fields, "num_ids": self.num_ids,
                "fixed": fixed, "batch_id": self.batch_id}
        return meta, arrays

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> "SparseBatch":
        """Rebuild and validate a batch from `to_arrays` output (e.g. off the wire).

        >>> b = SparseBatch.from_fixed(np.array([[3, 7], [3, 9]]), num_ids=16, labels=np.ones(2, np.float32))
        >>> c = SparseBatch.from_arrays(*b.to_arrays())
        >>> c.ids.tolist(), c.unique()[0].size
        ([3, 7, 3, 9], 3)
        """
        try:
            rows, f, n = int(meta["rows"]), int(meta["num_fields"]), int(meta["num_ids"])
            fixed, batch_id = bool(meta["fixed"]), str(meta.get("batch_id", ""))
            uniq, inverse = arrays["uniq"], arrays["inverse"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataFormatError(f"bad SparseBatch arrays: missing or wrong {e}") from None
        if uniq.ndim != 1 or inverse.ndim != 1 or (inverse.size and uniq.size == 0):
            raise DataFormatError("bad SparseBatch arrays: uniq and inverse must be 1-d")
        if uniq.dtype != np.int64 or inverse.dtype not in (np.uint16, np.int32, np.int64):
            raise DataFormatError(f"bad SparseBatch arrays: uniq must be int64 and inverse uint16 or int32, "
                                  f"got {uniq.dtype} and {inverse.dtype}")
        if inverse.size and (int(inverse.min()) < 0 or int(inverse.max()) >= uniq.size):
            raise DataFormatError(f"bad SparseBatch arrays: inverse must lie in [0, {uniq.size})")
        inverse = inverse.astype(np.int64)
        if fixed:
            if inverse.size != rows * f:
                raise DataFormatError(f"bad SparseBatch arrays: {inverse.size} entries for {rows} rows x {f} fields")
            indptr = np.arange(0, rows * f + 1, f, dtype=np.int64) if f else np.zeros(rows + 1, np.int64)
            fields = np.tile(np.arange(f, dtype=np.int32), rows)
        elif "indptr" in arrays and "fields" in arrays:
            indptr, fields = arrays["indptr"], arrays["fields"]
        else:
            raise DataFormatError("bad SparseBatch arrays: a batch that is not fixed-width needs indptr and fields")
        if uniq.size and (int(uniq.min()) < 0 or int(uniq.max()) >= n):
            raise DataFormatError(f"bad SparseBatch arrays: ids must lie in [0, {n})")
        batch = cls(ids=np.take(uniq, inverse), indptr=indptr, fields=fields, num_fields=f, num_ids=n,
                    values=arrays.get("values"), dense=arrays.get("dense"), labels=arrays.get("labels"),
                    batch_id=batch_id, _fixed=fixed or None)
        if fixed:  # the layout was built here and ids come from checked uniq: check the rest only
            batch.validate_rows()
        else:
            batch.validate()
        batch.set_unique(uniq, inverse)
        return batch

    def validate(self) -> "SparseBatch":
        """Check shapes, dtypes and bounds; for batches that come from outside."""
        need = self._need

        need(self.ids.dtype == np.int64 and self.ids.ndim == 1, "ids must be 1-d int64")
        need(self.indptr.dtype == np.int64 and self.indptr.ndim == 1 and len(self.indptr) >= 1,
             "indptr must be 1-d int64")
        need(int(self.indptr[0]) == 0 and int(self.indptr[-1]) == self.nnz, "indptr must span ids")
        need(bool((np.diff(self.indptr) >= 0).all()), "indptr must not decrease")
        need(self.fields.shape == self.ids.shape and self.fields.dtype == np.int32,
             "fields must be int32 like ids")
        need(self.nnz == 0 or (int(self.ids.min()) >= 0 and int(self.ids.max()) < self.num_ids),
             f"ids must lie in [0, {self.num_ids})")
        need(self.nnz == 0 or (int(self.fields.min()) >= 0 and int(self.fields.max()) < self.num_fields),
             f"fields must lie in [0, {self.num_fields})")
        return self.validate_rows()

    def validate_rows(self) -> "SparseBatch":
        """Check values, the dense block and labels against the layout."""
        need = self._need
        need(self.values is None or (self.values.shape == self.ids.shape and self.values.dtype == np.float32),
             "values must be float32 like ids")
        need(self.dense.dtype == np.float32 and self.dense.ndim == 2 and self.dense.shape[0] == self.num_rows,
             "dense must be (rows, d) float32")
        need(self.labels is None or (self.labels.shape == (self.num_rows,) and self.labels.dtype == np.float32),
             "labels must be (rows,) float32")
        return self

    def _need(self, cond: bool, what: str) -> None:
        if not cond:
            raise DataFormatError(f"bad SparseBatch {self.batch_id!r}: {what}")


def hash_unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values in first-seen order, (n,) int64 position of each among them): a hash
    table in C++ (pyarrow's dictionary encoding), as fast as torch.unique and faster than
    np.unique's sort on a batch's ids, without importing torch.

    >>> u, inv = hash_unique(np.array([7, 3, 7, 9], np.int64))
    >>> u.tolist(), inv.tolist()
    ([7, 3, 9], [0, 1, 0, 2])
    """
    import pyarrow as pa  # every parse has imported it already

    enc = pa.array(np.asarray(values)).dictionary_encode()
    return enc.dictionary.to_numpy(), enc.indices.to_numpy().astype(np.int64)


def _dedupe_local(uniq: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique ids of a slice, from the parent's unique ids and the slice's
    positions among them: O(entries + parent uniques), no sort."""
    mark = np.zeros(len(uniq), dtype=bool)
    mark[local] = True
    keep = np.flatnonzero(mark)
    pos = np.empty(len(uniq), dtype=np.int64)
    pos[keep] = np.arange(len(keep))
    return uniq[keep], pos[local]


def concat(batches: list[SparseBatch]) -> SparseBatch:
    """Rows of several batches with the same field layout, in order."""
    first = batches[0]
    sizes = np.cumsum([0] + [b.nnz for b in batches[:-1]])
    indptr = np.concatenate([[0]] + [b.indptr[1:] + off for b, off in zip(batches, sizes)])
    has_vals = any(b.values is not None for b in batches)
    return SparseBatch(
        ids=np.concatenate([b.ids for b in batches]), indptr=indptr.astype(np.int64),
        fields=np.concatenate([b.fields for b in batches]),
        num_fields=first.num_fields, num_ids=first.num_ids,
        values=np.concatenate([np.ones(b.nnz, np.float32) if b.values is None else b.values
                               for b in batches]) if has_vals else None,
        dense=np.concatenate([b.dense for b in batches]),
        labels=None if first.labels is None else np.concatenate([b.labels for b in batches]))
