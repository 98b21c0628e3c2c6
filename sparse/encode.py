"""Validated rows -> `SparseBatch`: feature hashing per field, numeric
transforms, the dense block. Training, evaluation and serving all go through
`Encoder`, so a row gets the same ids everywhere: `encode` for parsed blocks
(columns from `sparse.parse`), `encode_rows` for a few rows given as values
(`sparse.records`, a prediction request), the same hash of the same tokens.
"""
from __future__ import annotations

import math

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.sparse.hashing import (INT_SALT, MISSING_SALT, U64, HashSpec, binary_codes, bucket_codes, field_key,
                                    fmix64, fnv1a64, int_codes, log_bucket, log_bucket_few, log_dense, py_fmix64,
                                    py_token)
from mariana.sparse.parse import Chunk
from mariana.sparse.records import FEW_ROWS
from mariana.sparse.schema import HOUR_FIELDS, Schema

ID_CACHE_ENTRIES = 1 << 18    # (field, value) ids an IdCache holds: ~36 MB at most (shared by versions hashing alike)
PLAIN_TYPES = frozenset((str, int, float, type(None)))  # an instance's values looked up as they come
FEW_MISSED = 64               # new values hashed one by one in Python ints; more: numpy's vector steps


class IdCache:
    """What an `Encoder` remembers of the values it met: per sparse field, value -> id, and
    how many entries all fields hold. The encoders of versions that hash alike can share
    one (`Encoder.share_ids`), so a model swapped in starts with the values its predecessor
    met instead of hashing them all again."""

    __slots__ = ("fields", "entries")

    def __init__(self, num_fields: int):
        self.fields: list[dict] = [{} for _ in range(num_fields)]
        self.entries = 0


class Encoder:
    """Hashes a schema's feature fields into ids with one `HashSpec`.

    Sparse fields (one id per row each): numeric fields when `spec.numeric` is
    'bucket' or 'both', then the categorical fields, then the hour fields.
    Dense block: the numeric fields, log-scaled, when 'dense' or 'both'.
    """

    def __init__(self, schema: Schema, spec: HashSpec):
        self.schema, self.spec = schema, spec
        bucket = spec.numeric in ("bucket", "both")
        self.numeric = set(schema.numeric)
        self.int_fields = set(HOUR_FIELDS) if schema.hour else set()
        self.sparse_fields = ((schema.numeric if bucket else ()) + schema.categorical
                              + (HOUR_FIELDS if schema.hour else ()))
        self.dense_fields = schema.numeric if spec.numeric in ("dense", "both") else ()
        self._keys = [field_key(f) for f in self.sparse_fields]
        # encode_rows: each kind of field's positions among the sparse fields
        kinds = [("numeric" if f in self.numeric else "int" if f in self.int_fields else "text")
                 for f in self.sparse_fields]
        self._rows_plan = {k: ([f for f, kf in zip(self.sparse_fields, kinds) if kf == k],
                               np.array([j for j, kf in enumerate(kinds) if kf == k], np.int64))
                           for k in ("numeric", "int", "text")}
        self._key_array = np.array(self._keys, U64)
        self._key_ints = [int(k) for k in self._keys]
        self._mask_int = int(spec.mask)
        self._kinds = kinds
        self._memo = IdCache(len(self.sparse_fields))  # `_cached_ids`, `instance_ids`; shared by `share_ids`
        self._plain = "int" not in kinds and not self.dense_fields  # encode_instances: all text or numbers
        self._known = set(schema.columns)

    def hashes_like(self, other: Encoder) -> bool:
        """True when every value gets the same id from both: the same sparse fields, of the
        same kinds, hashed with the same spec."""
        return self.spec == other.spec and self.sparse_fields == other.sparse_fields and self._kinds == other._kinds

    def share_ids(self, other: Encoder) -> bool:
        """Use `other`'s id cache from now on when the two hash alike (a new version of a
        served model: the values the old one met are lookups at once); False, and nothing
        shared, when they do not."""
        if not self.hashes_like(other):
            return False
        self._memo = other._memo
        return True

    @property
    def _id_cache(self) -> list[dict]:
        """Per sparse field: value -> id."""
        return self._memo.fields

    @property
    def num_fields(self) -> int:
        return len(self.sparse_fields)

    @property
    def dense_dim(self) -> int:
        return len(self.dense_fields)

    def encode(self, chunk: Chunk, batch_id: str = "") -> SparseBatch:
        """(B rows) -> SparseBatch with ids (B, F) row-major and dense (B, Dd).

        The batch comes with its unique ids already found: each field's codes
        table holds its distinct ids, so deduping the (small) concatenation of
        tables dedupes the block.
        """
        codes = [self._codes(name, chunk.columns[name], key)
                 for name, key in zip(self.sparse_fields, self._keys)]
        tables = np.concatenate([t for t, _ in codes]) if codes else np.zeros(0, np.int64)
        offsets = np.cumsum([0] + [len(t) for t, _ in codes[:-1]])
        # nearly all distinct (a field's table is; fields collide in ~1% of ids): numpy's sort beats a hash
        # table here (75k ids: 1.0 ms against pyarrow's 3.3, torch.unique's 0.8), without importing torch
        uniq, table_pos = np.unique(tables, return_inverse=True)
        local = np.empty((chunk.num_rows, self.num_fields), dtype=np.int64)  # (B, F) into uniq
        for j, ((_, index), off) in enumerate(zip(codes, offsets)):
            local[:, j] = table_pos[index + off]
        dense = None
        if self.dense_fields:
            dense = np.stack([log_dense(chunk.columns[f]) for f in self.dense_fields], axis=1)
        batch = SparseBatch.from_fixed(uniq[local], num_ids=self.spec.num_ids, labels=chunk.labels,
                                       dense=dense, batch_id=batch_id)
        batch.set_unique(uniq, local.reshape(-1))
        return batch

    def encode_rows(self, chunk: Chunk) -> SparseBatch:
        """A chunk from `sparse.records.parse_records` (categorical columns as lists
        of bytes) -> the batch `encode` makes of the same rows.

        Built for a request's few rows: up to `FEW_ROWS` rows take their ids from the
        encoder's id cache (`_cached_ids`); more go through `_hashed_ids`, where every
        field's tokens go into one (B, F) array and each hashing step runs once over it
        (`encode` pays a dozen numpy calls per field to hash each distinct value of a
        big block once).
        """
        ids = self._cached_ids(chunk) if chunk.num_rows <= FEW_ROWS else self._hashed_ids(chunk)
        dense = None
        if self.dense_fields:
            dense = np.stack([log_dense(chunk.columns[n]) for n in self.dense_fields], axis=1)
        return SparseBatch.from_fixed(ids, num_ids=self.spec.num_ids, labels=chunk.labels, dense=dense)

    def encode_instances(self, instances: list) -> tuple[np.ndarray, list[int]] | None:
        """A few instances of requests -> ((B, F) ids, those of the batch `encode_rows` makes of
        them; each one's keys the schema does not know), when each is a dict of plain values
        (text or null in a categorical field; a finite int or float, or null, in a numeric one):
        the checks of `sparse.records` for those values and the id lookups in one pass, ~6 us
        a row where parsing then encoding a Criteo row takes ~32. None for anything else
        (`instance_ids`)."""
        found = self.instance_ids(instances)
        if found is None:
            return None
        ids, unknown = found
        return np.array(ids, np.int64).reshape(len(instances), self.num_fields), unknown

    def instance_ids(self, instances: list) -> tuple[list[int], list[int]] | None:
        """`encode_instances` as plain lists: the ids row-major, and each instance's unknown keys.
        Values not met yet (up to `FEW_MISSED` of them) are hashed here one by one and remembered:
        a request that brings a new id, as many do on high-cardinality fields, stays on this
        path. None for anything else (another type of value, more new values, hour fields, a
        dense block): `parse_records` and `encode_rows` take them and name what is wrong."""
        if not self._plain:
            return None
        ids, unknown, missed, aliases = [], [], [], []
        for instance in instances:
            if type(instance) is not dict or not self._instance_ids(instance, ids, missed, aliases):
                return None
            unknown.append(0 if self._known.issuperset(instance) else len(instance.keys() - self._known))
        if missed:
            if len(missed) > FEW_MISSED:
                return None
            self._hash_missed(missed, ids)
            # a new text is remembered by the str it came as too: its next request is all lookups
            if self._memo.entries + len(aliases) <= ID_CACHE_ENTRIES:
                for pos, j, raw in aliases:
                    if raw not in self._id_cache[j]:
                        self._id_cache[j][raw] = ids[pos]
                        self._memo.entries += 1
        return ids, unknown

    def _instance_ids(self, instance: dict, ids: list, missed: list, aliases: list) -> bool:
        """Appends a plain instance's ids to `ids` (0 for a value not met yet, whose (position,
        field, value) goes to `missed`, and (position, field, text as it came) to `aliases`
        for a text); False (some appended) when one value is not plain.

        A value met before is one lookup by the value as it came (a number by its value, text
        by its str: a new text is remembered by its str as well as its bytes, and one met first
        as bytes, in a file's row, by its str once looked up so), checked by its type only; the
        rest is checked and normalized here (text to UTF-8, a number to a finite float, a
        missing text to b"")."""
        values = list(map(instance.get, self.sparse_fields))
        try:  # every field's lookup in C: most requests' values were all met before
            found = list(map(dict.get, self._id_cache, values))
        except TypeError:  # unhashable: a list or an object is no plain value
            return False
        if not PLAIN_TYPES.issuperset(map(type, values)):  # no bool (it equals 0 or 1), bytes, ...
            return False
        base = len(ids)
        ids.extend(found)
        if None not in found:
            return True
        for j in [j for j, i in enumerate(found) if i is None]:  # only the values not met: a few
            kind, known, v = self._kinds[j], self._id_cache[j], values[j]
            raw = v
            if kind == "text":
                if type(v) is str:
                    try:
                        v = v.encode()
                    except UnicodeEncodeError:  # a lone surrogate: parse_records names it
                        return False
                elif v is None:
                    v = b""
                else:
                    return False
            elif type(v) is int or type(v) is float:
                try:
                    v = float(v)
                except OverflowError:
                    return False
                if not math.isfinite(v):
                    return False
            elif v is not None:
                return False
            i = known.get(v)
            if i is None:
                missed.append((base + j, j, v))
                if kind == "text":
                    aliases.append((base + j, j, raw))
                i = 0
            elif kind == "text":  # met as bytes (a file's row, or an instance's first sight): found by its str from now
                known[raw] = i
                self._memo.entries += 1
            ids[base + j] = i
        return True

    def _hashed_ids(self, chunk: Chunk) -> np.ndarray:
        """(B, F) ids of a chunk's rows, each hashing step once over all of them."""
        b, f = chunk.num_rows, self.num_fields
        tokens = np.empty((b, f), U64)
        for kind, (names, at) in self._rows_plan.items():
            if not names:
                continue
            if kind == "text":  # every value of every text field, row-major
                values = [v for row in zip(*(chunk.columns[n] for n in names)) for v in row]
                tokens[:, at] = self._tokens(kind, values).reshape(b, len(names))
            else:
                tokens[:, at] = self._tokens(kind, np.stack([chunk.columns[n] for n in names], axis=1))
        return self._ids(tokens, self._key_array)

    def _ids(self, tokens: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The hashing's last step: tokens mixed with their fields' keys, cut to the id space."""
        return (fmix64(tokens ^ keys) & self.spec.mask).view(np.int64)

    def _cached_ids(self, chunk: Chunk) -> np.ndarray:
        """(B, F) ids of a few rows, the same as `_hashed_ids`'. The id of each (field, value)
        met is remembered (up to `ID_CACHE_ENTRIES` of them, then forgotten all at once), so a
        request's values are mostly dictionary lookups: a single Criteo row's hashing cost
        ~110 us of a server's CPU in numpy calls, a few us in lookups. Only the values not
        met yet are hashed, one vectorized step per kind of field."""
        b, f = chunk.num_rows, self.num_fields
        out = [0] * (b * f)
        missed: list[tuple[int, int, object]] = []  # (position in out, field, value)
        for j, name in enumerate(self.sparse_fields):
            known, col = self._id_cache[j], chunk.columns[name]
            for pos, v in zip(range(j, b * f, f), col.tolist() if isinstance(col, np.ndarray) else col):
                if v != v:  # NaN: a missing number, one key (NaNs are never equal as keys)
                    v = None
                i = known.get(v)
                if i is None:
                    missed.append((pos, j, v))
                else:
                    out[pos] = i
        if missed:
            self._hash_missed(missed, out)
        return np.array(out, np.int64).reshape(b, f)

    def _hash_missed(self, missed: list[tuple[int, int, object]], out: list[int]) -> None:
        if self._memo.entries + len(missed) > ID_CACHE_ENTRIES:
            for known in self._id_cache:
                known.clear()
            self._memo.entries = 0
        store = len(missed) <= ID_CACHE_ENTRIES
        ids = self._few_ids(missed) if len(missed) <= FEW_MISSED else self._many_ids(missed)
        for (pos, j, v), i in zip(missed, ids):
            out[pos] = i
            if store and v not in self._id_cache[j]:  # a value met twice in one request is one entry
                self._id_cache[j][v] = i
                self._memo.entries += 1

    def _few_ids(self, missed: list[tuple[int, int, object]]) -> list[int]:
        """The ids of a request's few new values, hashed one by one with Python ints
        (`hashing.py_token`, `py_fmix64`: exact, the reference the vectorized code is tested
        against): numpy's per-call cost made `_many_ids` ~50-70 us for any handful of values,
        two ufunc calls per byte of a text value. A number's log stays numpy's (one call for
        all of them: `log_bucket_few`), the function training used."""
        numbers = [k for k, (_, j, v) in enumerate(missed) if self._kinds[j] == "numeric" and v is not None]
        buckets = dict(zip(numbers, log_bucket_few([missed[k][2] for k in numbers],
                                                   self.spec.bucket_scale))) if numbers else {}
        mask = self._mask_int
        return [py_fmix64(py_token(buckets.get(k) if self._kinds[j] == "numeric" else v) ^ self._key_ints[j]) & mask
                for k, (_, j, v) in enumerate(missed)]

    def _many_ids(self, missed: list[tuple[int, int, object]]) -> list[int]:
        """The ids of many new values (a request of many rows): one vectorized step per kind."""
        ids = [0] * len(missed)
        for kind in ("numeric", "int", "text"):
            at = [k for k, m in enumerate(missed) if self._kinds[m[1]] == kind]
            if not at:
                continue
            if kind == "numeric":
                values = np.array([math.nan if missed[k][2] is None else missed[k][2] for k in at], np.float64)
            else:
                values = [missed[k][2] for k in at]
            keys = self._key_array[[missed[k][1] for k in at]]
            for k, i in zip(at, self._ids(self._tokens(kind, values), keys).tolist()):
                ids[k] = i
        return ids

    def _tokens(self, kind: str, values) -> np.ndarray:
        """The hashing's first step over values of one kind of field: numbers (float, NaN =
        missing) -> their log bucket's token; ints (hour fields) -> theirs; text (a list of
        bytes, b'' = missing) -> FNV-1a. The same shape as `values` (a list: flat)."""
        if kind == "numeric":  # log buckets as integer tokens; NaN is the missing token
            x = np.asarray(values, np.float64)
            tok = fmix64(log_bucket(x, self.spec.bucket_scale).view(U64) ^ INT_SALT)
            tok[np.isnan(x)] = MISSING_SALT
            return tok
        if kind == "int":
            return fmix64(np.asarray(values, np.int64).view(U64) ^ INT_SALT)
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tok = fnv1a64(offsets, np.frombuffer(b"".join(values), np.uint8))
        tok[lengths == 0] = MISSING_SALT
        return tok

    def _codes(self, name: str, col, key) -> tuple[np.ndarray, np.ndarray]:
        if name in self.numeric:
            return bucket_codes(col, key, self.spec)
        if name in self.int_fields:
            return int_codes(col, key, self.spec)
        return binary_codes(col, key, self.spec)
