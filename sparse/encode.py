"""Validated rows -> `SparseBatch`: feature hashing per field, numeric
transforms, the dense block. Training, evaluation and serving all go through
`Encoder`, so a row gets the same ids everywhere: `encode` for parsed blocks
(columns from `sparse.parse`), `encode_rows` for a few rows given as values
(`sparse.records`, a prediction request), the same hash of the same tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from mariana.sparse.batch import SparseBatch
from mariana.sparse.hashing import (INT_SALT, MISSING_SALT, U64, HashSpec, binary_codes, bucket_codes, field_key, fmix64,
                            fnv1a64, int_codes, log_bucket, log_dense)
from mariana.sparse.parse import Chunk
from mariana.sparse.schema import HOUR_FIELDS, Schema


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
        uniq, table_pos = torch.unique(torch.from_numpy(tables), sorted=False, return_inverse=True)
        uniq, table_pos = uniq.numpy(), table_pos.numpy()
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

        Built for a request's few rows: every field's tokens go into one (B, F)
        array and each hashing step runs once over it, where `encode` pays a
        dozen numpy calls per field to hash each distinct value of a big block once.
        """
        b, f = chunk.num_rows, self.num_fields
        tokens = np.empty((b, f), U64)
        numeric, at = self._rows_plan["numeric"]
        if numeric:  # log buckets as integer tokens; NaN is the missing token
            x = np.stack([chunk.columns[n] for n in numeric], axis=1)
            tok = fmix64(log_bucket(x, self.spec.bucket_scale).view(U64) ^ INT_SALT)
            tok[np.isnan(x)] = MISSING_SALT
            tokens[:, at] = tok
        ints, at = self._rows_plan["int"]
        if ints:
            values = np.stack([np.asarray(chunk.columns[n], np.int64) for n in ints], axis=1)
            tokens[:, at] = fmix64(values.view(U64) ^ INT_SALT)
        text, at = self._rows_plan["text"]
        if text:  # every value of every text field, row-major, hashed in one pass
            values = [v for row in zip(*(chunk.columns[n] for n in text)) for v in row]
            lengths = np.fromiter(map(len, values), np.int64, len(values))
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            tok = fnv1a64(offsets, np.frombuffer(b"".join(values), np.uint8))
            tok[lengths == 0] = MISSING_SALT
            tokens[:, at] = tok.reshape(b, len(text))
        ids = (fmix64(tokens ^ self._key_array) & self.spec.mask).view(np.int64)  # (B, F)
        dense = None
        if self.dense_fields:
            dense = np.stack([log_dense(chunk.columns[n]) for n in self.dense_fields], axis=1)
        return SparseBatch.from_fixed(ids, num_ids=self.spec.num_ids, labels=chunk.labels, dense=dense)

    def _codes(self, name: str, col, key) -> tuple[np.ndarray, np.ndarray]:
        if name in self.numeric:
            return bucket_codes(col, key, self.spec)
        if name in self.int_fields:
            return int_codes(col, key, self.spec)
        return binary_codes(col, key, self.spec)
