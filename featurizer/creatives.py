"""Creative features by id: the table a row's creative id is looked up in, and
the encoder that puts the looked-up features into the batch's dense block.

    CREATIVES_DIR/creatives.npy    (C, 28, 28) uint8   the images, row k = ids[k]
    CREATIVES_DIR/creatives.json   {"ids": [...], "field": "C26", ...}

    CreativeFeatures(ids, features (C, d))
        .lookup(column of ids) -> (B, d + 1) float32: the features, then a flag
        that is 1.0 for an unknown creative (whose features are all zeros)

The lookup is one hash probe per row in pyarrow's C++ (`index_in`) and one
gather: the cache-hit path that preprocess and serving share.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mariana.featurizer.idx import BadImage, load_npy
from mariana.sparse.batch import SparseBatch
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import DataFormatError
from mariana.sparse.files import loads_json
from mariana.sparse.parse import Chunk

IMAGES_FILE = "creatives.npy"
META_FILE = "creatives.json"
FALLBACK = "zero features, flag column = 1"  # what an unknown creative gets (as records say it)


def load_creatives(path: str | os.PathLike) -> tuple[list[bytes], np.ndarray, dict]:
    """(ids, images (C, 28, 28) uint8, the metadata) of a creatives dir."""
    d = Path(path)
    if not d.is_dir():
        raise DataFormatError(f"{d}: not a creatives directory (make one with 'mariana gen ads-with-images')")
    try:
        meta = loads_json((d / META_FILE).read_text())
        images = load_npy(d / IMAGES_FILE, IMAGES_FILE)  # its header checked first: a lying one was a MemoryError
    except FileNotFoundError as e:
        raise DataFormatError(f"{d}: missing {Path(e.filename).name}") from None
    except (ValueError, BadImage) as e:  # (JSONDecodeError is one)
        raise DataFormatError(f"{d}: unreadable creatives: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("ids", []), list):
        raise DataFormatError(f"{d}: {META_FILE} must be a JSON object whose \"ids\" is a list of creative ids, "
                              f"got {json.dumps(meta)[:60]}")
    ids = [str(i).encode() for i in meta.get("ids", [])]
    if images.dtype != np.uint8 or images.ndim != 3 or len(images) != len(ids):
        raise DataFormatError(f"{d}: {IMAGES_FILE} must be (len(ids)={len(ids)}, S, S) uint8, "
                              f"got {images.dtype} {images.shape}")
    if len(set(ids)) != len(ids):
        raise DataFormatError(f"{d}: duplicate creative ids in {META_FILE}")
    return ids, images, meta


class CreativeFeatures:
    """ids -> features, with a defined fallback for unknown ids, counted.

    >>> t = CreativeFeatures([b"a1", b"b2"], np.array([[1, 2], [3, 4]], np.float32))
    >>> t.lookup([b"b2", b"zz", b""]).tolist()
    [[3.0, 4.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    >>> t.counts()
    {'lookups': 3, 'unknown': 2}
    """

    def __init__(self, ids: list[bytes], features: np.ndarray):
        if features.ndim != 2 or len(features) != len(ids):
            raise ValueError(f"features must be (len(ids), d), got {features.shape} for {len(ids)} ids")
        self.ids = list(ids)
        self.dim = features.shape[1]
        # (C + 1, d + 1): the features and flag 0, then the fallback row (zeros, flag 1)
        # that index -1 (not found) selects.
        table = np.zeros((len(ids) + 1, self.dim + 1), np.float32)
        table[:-1, :-1] = features
        table[-1, -1] = 1.0
        self.table = table
        self._value_set = pa.array(self.ids, pa.binary())
        self._lock = threading.Lock()
        self._lookups = self._unknown = 0

    @property
    def width(self) -> int:
        """Columns a lookup adds to the dense block: d features + the unknown flag."""
        return self.dim + 1

    @property
    def features(self) -> np.ndarray:
        return self.table[:-1, :-1]

    def index(self, column) -> np.ndarray:
        """(B,) int64 row of each id in the table, -1 when unknown (or missing)."""
        col = column if isinstance(column, (pa.Array, pa.ChunkedArray)) else pa.array(column, pa.binary())
        if not (pa.types.is_binary(col.type) or pa.types.is_string(col.type)):
            col = col.cast(pa.binary())
        found = pc.index_in(col, value_set=self._value_set.cast(col.type))
        return pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)

    def lookup(self, column) -> np.ndarray:
        """(B, d + 1) float32: each row's creative features and the unknown flag."""
        idx = self.index(column)
        unknown = int((idx < 0).sum())
        with self._lock:
            self._lookups += len(idx)
            self._unknown += unknown
        return self.table[idx]

    def counts(self) -> dict:
        with self._lock:
            return {"lookups": self._lookups, "unknown": self._unknown}

    # ---- as arrays (a model version stores its table: serving needs no featurizer) ----

    def to_arrays(self) -> dict[str, np.ndarray]:
        lengths = np.array([len(i) for i in self.ids], np.int64)
        return {"images.features": np.ascontiguousarray(self.features),
                "images.id_bytes": np.frombuffer(b"".join(self.ids), np.uint8).copy(),
                "images.id_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "CreativeFeatures":
        raw, off = arrays["images.id_bytes"].tobytes(), arrays["images.id_offsets"]
        ids = [raw[a:b] for a, b in zip(off[:-1].tolist(), off[1:].tolist())]
        return cls(ids, np.asarray(arrays["images.features"], np.float32))


def check_image_field(field: str, schema) -> None:
    """DataFormatError unless `field` (images.field) is a categorical column of `schema`: the
    column whose text names a row's creative. Checked when a job is submitted too: a cluster
    job with a number column there had its preprocess fail on every chunk, for ever.

    >>> from mariana.sparse.schema import criteo
    >>> check_image_field("I1", criteo())
    Traceback (most recent call last):
    mariana.sparse.errors.DataFormatError: images.field 'I1' is not a categorical column of schema 'criteo'
    """
    if field not in schema.categorical:
        raise DataFormatError(f"images.field {field!r} is not a categorical column of schema {schema.name!r}")


class ImageFeatureEncoder:
    """An `Encoder` whose batches carry the row's creative features at the end
    of the dense block: dense = [numeric dense (Dn) | features (d) | unknown flag].

    Same interface as `Encoder` (encode, encode_rows, schema, field counts), so
    training, evaluation, predict and serving use it unchanged.
    """

    def __init__(self, base: Encoder, table: CreativeFeatures, field: str):
        check_image_field(field, base.schema)
        self.base, self.table, self.field = base, table, field
        self.schema, self.spec = base.schema, base.spec
        self.sparse_fields, self.dense_fields = base.sparse_fields, base.dense_fields

    @property
    def num_fields(self) -> int:
        return self.base.num_fields

    @property
    def dense_dim(self) -> int:
        return self.base.dense_dim + self.table.width

    def share_ids(self, other) -> bool:
        """The base encoder's `Encoder.share_ids` with `other`'s (an image encoder's, or a plain
        one): the hashed ids are the base's alone; each version keeps its own creative table."""
        return self.base.share_ids(getattr(other, "base", other))

    def encode(self, chunk: Chunk, batch_id: str = "") -> SparseBatch:
        return self.attach(self.base.encode(chunk, batch_id), chunk)

    def encode_rows(self, chunk: Chunk) -> SparseBatch:
        return self.attach(self.base.encode_rows(chunk), chunk)

    def attach(self, batch: SparseBatch, chunk: Chunk) -> SparseBatch:
        """`batch` (the base encoder's, of `chunk`) with the creative features appended to its dense block."""
        feats = self.table.lookup(chunk.columns[self.field])          # (B, d + 1)
        batch.dense = np.concatenate([batch.dense, feats], axis=1) if batch.dense.shape[1] else feats
        return batch
