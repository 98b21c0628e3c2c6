"""`ModelBundle`: everything one model is — its job config, schema, encoder,
model (a torch module, or numpy's LR), hashed tables and optimizer state — with
save, load and predict. An LR bundle never imports torch.

Training, evaluation, `mariana predict` and serving all hold a bundle, so a
row takes the same path from bytes to pCTR everywhere.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np

from mariana.featurizer.creatives import CreativeFeatures, ImageFeatureEncoder
from mariana.featurizer.speech import MODEL_KIND as SPEECH_KIND
from mariana.sparse import admission, finite
from mariana.sparse.batch import SparseBatch
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import ConfigError, MarianaError, ModelDirError
from mariana.sparse.hashing import rare_ids
from mariana.sparse.host import memory_limit
from mariana.sparse.optim import AdaGrad, FTRL, SparseOptimizer
from mariana.sparse.records import FEW_ROWS
from mariana.sparse.schema import Schema
from mariana.sparse.table import TABLE_FORMS, FrozenTable, HashedTable, RowIndex, frozen_pays
from mariana.trainer import checkpoint
from mariana.sparse.settings import from_dict
from mariana.trainer.config import LOWER_RATES, JobConfig
from mariana.trainer.models.lr import sigmoid
from mariana.trainer.models.registry import build_model, dense_params, dense_size, set_dense, uses_torch
from mariana.trainer.strategies.ps_step import DenseOptimizer

log = logging.getLogger(__name__)


FEW_ENTRIES = 4096  # up to ~100 Criteo rows: predicted without deduplicating ids


class ModelBundle:
    """`images`: the creative id -> image features table of a job with
    `images.creatives` set (trainer.images makes it; a saved version stores it);
    the encoder then appends each row's features to the dense block."""

    def __init__(self, config: JobConfig, schema: Schema, images: CreativeFeatures | None = None):
        if bool(config.images.creatives) != (images is not None):
            raise ConfigError("a job with images.creatives needs its creative features table (and only it has one)")
        self.config, self.schema, self.images = config, schema, images
        base = Encoder(schema, config.hashing)
        self.encoder = ImageFeatureEncoder(base, images, config.images.field) if images else base
        self.model = build_model(config.model, base.num_fields, base.dense_dim,
                                 images.width if images else 0, config.images.tower)
        self.tables = {
            t.name: HashedTable(t.name, config.hashing.num_ids, t.dim, t.init_scale, seed=config.model.seed)
            for t in self.model.tables}
        self.optimizers = {t.name: table_optimizer(config, t.role) for t in self.model.tables}
        self.dense_opt = DenseOptimizer(AdaGrad(lr=config.optim.dense_lr,
                                                initial_accumulator=config.optim.initial_accumulator),
                                        [a for _, a in dense_params(self.model)])
        # hashing.min_count > 1: each field's rare id and the counts of ids not admitted yet
        # (sparse/admission.py); None otherwise, and for versions saved before it existed.
        k = config.hashing.min_count
        self.rare = rare_ids(base.sparse_fields, config.hashing) if k > 1 else None
        self.counts = admission.Counts(config.hashing.num_ids, k) if k > 1 else None
        self.rows_trained = 0
        self.steps = 0
        self.manifest: dict = {}  # of the version this bundle was loaded from
        self.parent: dict | None = None  # the version a warm start went on from (`warm_start`)

    # ---- inference ------------------------------------------------------------

    def predict(self, batch: SparseBatch) -> np.ndarray:
        """(B,) click probabilities; reads tables without changing them."""
        if batch.num_rows <= FEW_ROWS and batch._unique is None and batch.values is None and batch.fixed_width:
            return self.predict_rows(batch.ids.reshape(batch.num_rows, -1), batch.dense)
        if not uses_torch(self.model):
            return sigmoid(self._lr_logits(batch))
        import torch

        from mariana.trainer.models.base import make_input

        if batch._unique is None and batch.nnz <= FEW_ENTRIES:
            # A request's rows: look every entry up as it comes. Reads need no
            # distinct ids, each entry gets the same row values in the same order,
            # and a hash-based unique costs more than the duplicate lookups it saves.
            uniq, inverse, pos = batch.ids, torch.arange(batch.nnz), None
            if self.rare is not None:  # ids never admitted (no row) read their field's rare row
                uniq, pos = self._rare_swapped(uniq, self.rare[batch.fields])
        else:
            if self.rare is not None:
                batch = admission.lookup_ids(batch, self.touched, self.rare)
            uniq, inverse = batch.unique()
            pos = None
        rows = {name: torch.from_numpy(r) for name, r in self.lookup(uniq, pos).items()}
        with torch.inference_mode():  # no autograd state at all: fewer costs per op than no_grad
            return torch.sigmoid(self.model(make_input(batch, inverse, rows))).numpy()

    def predict_rows(self, ids: np.ndarray, dense: np.ndarray | None = None) -> np.ndarray:
        """(B,) click probabilities of a few rows given as (B, F) ids, one per field (values
        1), and their (B, Dd) dense block: a request's rows. The model's forward in numpy
        (`CTRModel.numpy_logits`): torch's per-op dispatch costs a single row ~20 us with LR
        and ~67 with the DNN; ~4 and ~17 here. No SparseBatch either."""
        if dense is None:
            dense = np.zeros((len(ids), 0), np.float32)
        pos = None
        if self.rare is not None:  # ids never admitted (no row) read their field's rare row
            ids, pos = self._rare_swapped(ids, self.rare)
        rows = self.lookup(ids.reshape(-1), None if pos is None else pos.reshape(-1))
        return _few_sigmoid(self.model.numpy_logits(rows, len(ids), dense))

    def _rare_swapped(self, ids: np.ndarray, rare: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """`ids` with those never admitted (no row) swapped for their field's rare id (`rare`,
        broadcast to the ids' shape); for frozen tables also their `RowIndex.positions`, found
        in the same pass (`lookup` takes them). Looking each id up to learn whether it has a row,
        then again for the row, cost LR at bits 26 with admission 29 us a lone request and 116
        for 10 rows, against 26.5 and 103 now (15 and 72 from dense tables)."""
        first = next(iter(self.tables.values()))
        if not isinstance(first, FrozenTable):
            return np.where(first.touched[ids], ids, rare), None
        pos = first.index.positions(ids)
        out = pos == first.index.n
        if out.any():
            ids = np.where(out, rare, ids)
            pos[out] = first.index.positions(ids[out])
        return ids, pos

    def lookup(self, ids: np.ndarray, pos: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Every table's rows of `ids` (a copy; untouched rows read as `HashedTable.lookup` reads
        them). Frozen tables that share an index (all of a version's) find the ids once; `pos`:
        the ids' positions in the first table's index, found already (`_rare_swapped`)."""
        out, found = {}, {}
        if pos is not None:
            found[id(next(iter(self.tables.values())).index)] = pos
        for name, t in self.tables.items():
            if isinstance(t, FrozenTable):
                pos = found.get(id(t.index))
                if pos is None:
                    pos = found[id(t.index)] = t.index.positions(ids)
                out[name] = t.lookup(ids, pos)
            else:
                out[name] = t.lookup(ids)
        return out

    def lone_scorer(self):
        """A function from one row's ids (a list, one per field, as `Encoder.instance_ids` gives
        them) to its pCTR with as few numpy calls as the model allows (`lone_scorer` of LR: none;
        of the DNN's "dot" interaction: the embeddings' gather and the MLP's), for a model
        without a dense block, admission or image features; None for the others, which score
        through `predict_rows`. For a bundle that trains no more (a server's): the biases are
        read now, the weights are views of the tables. Frozen tables: the ids' rows are found in
        plain Python (`RowIndex.rows_of`, ~0.1-0.2 us an id, once for tables that share an index)
        and the scorer reads those."""
        linear = self.tables.get("linear")
        make = getattr(self.model, "lone_scorer", None)
        if make is None or linear is None or linear.init_scale or self.rare is not None or self.images is not None:
            return None
        if isinstance(linear, FrozenTable):
            rows_of = {name: t.index.rows_of for name, t in self.tables.items()}
            return make(memoryview(linear.values.reshape(-1)), self.tables, rows_of)
        return make(memoryview(linear.weights.reshape(-1)), self.tables)

    def _lr_logits(self, batch: SparseBatch) -> np.ndarray:
        """LR's logits (`LogisticRegression.logits`) of each entry's weight: looked up per
        distinct id when the batch has them (a parsed block's), else per entry (a read
        needs no distinct ids)."""
        table = self.tables["linear"]
        if self.rare is None and batch._unique is not None:  # a parsed block's: each distinct id once
            uniq, inverse = batch._unique
            w = table.lookup(uniq)[:, 0].take(inverse)
        else:
            ids, pos = batch.ids, None
            if self.rare is not None:  # ids never admitted (no row) read their field's rare row
                ids, pos = self._rare_swapped(ids, self.rare[batch.fields])
            w = (table.lookup(ids) if pos is None else table.lookup(ids, pos))[:, 0]
        return self.model.logits(batch, w)

    @property
    def touched(self) -> np.ndarray:
        """(num_ids,) bool: ids with rows (every table materializes the same ids)."""
        return next(iter(self.tables.values())).touched

    def admit(self, batch: SparseBatch) -> SparseBatch:
        """The batch a training step trains on: with hashing.min_count > 1, the ids are
        counted and those not admitted read and train their field's rare row."""
        if self.counts is None:
            return batch
        return admission.admit(batch, self.counts, self.touched, self.rare)

    def load_counts(self, arrays: dict[str, np.ndarray]) -> None:
        """Pending counts saved in a version's optimizer state (admission.IDS_KEY /
        COUNTS_KEY) or a shard's export; nothing when the job does not count."""
        if self.counts is not None:
            admission.load_arrays(self.counts, arrays)

    # ---- persistence ------------------------------------------------------------

    def save(self, model_dir: str, extra: dict | None = None, make_current: bool = True) -> str:
        weights, optim, table_rows = {}, {}, {}
        for name, t in self.tables.items():
            rows, table_weights, state = t.saved_arrays()
            w, o = table_export(name, rows, table_weights, state)
            weights.update(w)
            optim.update(o)
            table_rows[name] = int(len(rows))
        for (pname, p), state in zip(dense_params(self.model), self.dense_opt.state):
            weights[f"dense.{pname}"] = p
            for key, arr in state.items():
                optim[f"dense.{pname}.{key}"] = arr
        if self.counts is not None:  # ids seen but not admitted yet: a warm start goes on counting
            optim.update(admission.to_arrays(self.counts, self.touched))
        _check_finite(weights)
        image_arrays = self.images.to_arrays() if self.images is not None else {}
        weights.update(image_arrays)
        manifest = {
            "config": self.config.to_dict(),
            "schema": self.schema.to_dict(),
            "fields": list(self.encoder.sparse_fields),
            "dense_fields": list(self.encoder.dense_fields),
            "model": {"kind": self.config.model.kind,
                      "tables": [dataclasses.asdict(t) for t in self.model.tables],
                      "dense_parameters": dense_size(self.model),
                      "table_rows": table_rows},
            "rows_trained": self.rows_trained,
            "steps": self.steps,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch_version(),
            **({"parent": self.parent} if self.parent else {}),
            **(extra or {}),
        }
        if self.images is not None:  # what serving must do: look each row's creative id up in this table
            manifest["images"] = {**manifest.get("images", {}), "field": self.config.images.field,
                                  "dim": self.images.dim, "width": self.images.width,
                                  "creatives": len(self.images.ids), "arrays": sorted(image_arrays),
                                  "dense_layout": "numeric dense, then image features, then unknown flag"}
        return checkpoint.save_version(model_dir, manifest, weights, optim, make_current=make_current,
                                       reason="trained")

    @classmethod
    def from_shard_exports(cls, config: JobConfig, schema: Schema, exports: list[dict[str, np.ndarray]],
                           images: CreativeFeatures | None = None) -> "ModelBundle":
        """One bundle from every parameter-server shard's export (`ParamShard.snapshot`: its
        tables by global id in the `table_export` layout, pending counts; the dense parameters
        and their optimizer state as flat vectors, from shard 0). Its tables are frozen, with
        their ids and state: it predicts (a test set, a validation) and saves, in memory that
        follows the rows the shards hold. Dense tables took the coordinator 1.8-3.5 GB for an
        LR at bits 28 that saves 4 MB."""
        bundle = cls(config, schema, images)
        for name in list(bundle.tables):
            bundle.tables[name] = _assembled(bundle, name, [table_arrays(arrays, name) for arrays in exports])
        for arrays in exports:
            bundle.load_counts(arrays)  # min_count > 1: the ids each shard counted but did not admit
        params = [a for _, a in dense_params(bundle.model)]
        if params:
            set_dense(bundle.model, exports[0]["dense"])
            offset = 0
            for p, state in zip(params, bundle.dense_opt.state):
                n = p.size
                for key, arr in state.items():
                    if f"dense.{key}" in exports[0]:
                        arr[...] = exports[0][f"dense.{key}"][offset:offset + n].reshape(arr.shape)
                offset += n
        return bundle

    @classmethod
    def load(cls, model_dir: str, version: str | None = None, with_optimizer: bool = False,
             tables: str = "dense") -> "ModelBundle":
        """The bundle of `version` (default: CURRENT's) with its optimizer state and pending counts
        when `with_optimizer` (a warm start). Every array is checked against the model its
        manifest's config describes before it is used: ModelDirError naming the version dir and
        the array otherwise, as for an unreadable version. `tables` (TABLE_FORMS): "dense", the
        HashedTables a job trains; "frozen", FrozenTables, whose memory follows the rows saved,
        for a bundle that only predicts (it cannot train or save); "auto", frozen when
        `frozen_pays` (a server's, `mariana predict`'s)."""
        if tables not in TABLE_FORMS:
            raise ConfigError(f"tables must be one of {', '.join(TABLE_FORMS)}, got {tables!r}")
        version = version or checkpoint.current_version(model_dir)
        manifest, weights, optim = checkpoint.load_version(model_dir, version, with_optimizer)
        vdir = os.path.join(model_dir, version)
        if manifest.get("kind") == SPEECH_KIND:
            raise ModelDirError(f"{model_dir}: {manifest.get('version')} is a speech model (mariana train speech), "
                                "not a click model (`mariana evaluate`, `predict` and `serve` take it as a speech "
                                "model)")
        try:
            config = from_dict(JobConfig, manifest["config"])
            schema = Schema.from_dict(manifest["schema"])
        except KeyError as e:
            raise ModelDirError(f"{model_dir}: manifest lacks {e}") from None
        except ModelDirError:
            raise
        except MarianaError as e:  # a config or schema no job writes: the manifest's, not the user's own config
            raise ModelDirError(f"{vdir}/{checkpoint.MANIFEST}: {e}") from None
        images = None
        if config.images.creatives:
            _check_images(vdir, weights)
            images = CreativeFeatures.from_arrays(weights)
        bundle = cls(config, schema, images)
        bundle.manifest = manifest
        bundle.rows_trained = manifest.get("rows_trained", 0)
        bundle.steps = manifest.get("steps", 0)
        _load_dense(vdir, bundle, weights, optim)
        arrays = {**weights, **optim}
        frozen = tables == "frozen" or (tables == "auto" and _frozen_pays(bundle, arrays))
        for name in list(bundle.tables):
            _load_table(vdir, bundle, name, arrays, frozen)
        if bundle.counts is not None:
            _check_pending(vdir, optim, config.hashing.num_ids)
        bundle.load_counts(optim)  # ids counted but not admitted yet (a warm start goes on counting)
        return bundle


# ---- a version's arrays, checked against the model its manifest describes ----------------------

def _load_dense(vdir: str, bundle: ModelBundle, weights: dict[str, np.ndarray], optim: dict[str, np.ndarray]) -> None:
    """The dense parameters and the state of those that have one saved (else it starts fresh)."""
    for (pname, p), st in zip(dense_params(bundle.model), bundle.dense_opt.state):
        name = f"dense.{pname}"
        if name not in weights:
            raise ModelDirError(f"{vdir}: weights lack {name}: the version was saved by a mariana whose model had "
                                "other parameters (e.g. an 'fm' model from before its FM term became a mean over "
                                "field pairs), or its manifest's model config was edited; train it again")
        _check_floats(vdir, name, weights[name], p.shape)
        p[...] = weights[name]
        for key in st:
            if f"{name}.{key}" in optim:
                _check_floats(vdir, f"{name}.{key}", optim[f"{name}.{key}"], st[key].shape)
                st[key][...] = optim[f"{name}.{key}"]


def _check_floats(vdir: str, name: str, arr: np.ndarray, shape: tuple) -> None:
    if arr.dtype.kind != "f" or arr.shape != tuple(shape):
        raise ModelDirError(f"{vdir}: {name} is {arr.dtype} of shape {arr.shape}, expected floats of shape "
                            f"{tuple(shape)} (the model the manifest's config describes)")


def _assembled(bundle: ModelBundle, name: str, parts: list[tuple]) -> FrozenTable:
    """Table `name` as a FrozenTable of the shards' (ids, weights, state) `parts`, ids ascending
    (as a version saves them), its index shared with the tables before it of the same ids. A
    shard that never applied a push has no state arrays: its rows' state is zeros, as a dense
    table's unwritten state is."""
    table = bundle.tables[name]
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64, copy=False)
    order = np.argsort(ids, kind="stable")
    ids, weights = ids[order], np.concatenate([p[1] for p in parts])[order]
    keys = sorted({key for p in parts for key in p[2]})
    state = {key: np.concatenate([p[2][key] if key in p[2] else np.zeros((len(p[0]), table.dim), np.float32)
                                  for p in parts])[order] for key in keys}
    problem = table.rows_problem(ids, weights, state)
    if problem:
        raise ModelDirError(f"the shards' exports of table {name}: table.{name}.{problem[0]} {problem[1]}")
    return FrozenTable.of(table, _index_of(bundle, ids), weights, ids, state)


def _index_of(bundle: ModelBundle, ids: np.ndarray) -> RowIndex:
    """The RowIndex of `ids`: a frozen table's of the bundle made of the same ids (all of a
    version's tables hold the same rows), else a new one."""
    return next((t.index for t in bundle.tables.values() if isinstance(t, FrozenTable) and t.index.holds(ids)),
                None) or RowIndex(ids)


def _frozen_pays(bundle: ModelBundle, arrays: dict[str, np.ndarray]) -> bool:
    rows = arrays.get(f"{TABLE_PREFIX}{next(iter(bundle.tables))}.rows")
    dims = sum(t.dim for t in bundle.tables.values())
    return rows is not None and frozen_pays(bundle.config.hashing.num_ids, dims, len(rows))


def _load_table(vdir: str, bundle: ModelBundle, name: str, arrays: dict[str, np.ndarray], frozen: bool) -> None:
    """Table `name`'s rows, weights and the optimizer state saved for it: all of its optimizer's
    state keys or none (a version saved without state: it starts fresh). `frozen`: the table
    becomes a FrozenTable of its rows (`_index_of`), its optimizer state left out."""
    table, opt = bundle.tables[name], bundle.optimizers[name]
    prefix = f"{TABLE_PREFIX}{name}."
    for key in ("rows", "weights"):
        if prefix + key not in arrays:
            raise ModelDirError(f"{vdir}: weights lack {prefix + key} (the model has a table {name!r})")
    rows, weights, state = table_arrays(arrays, name)
    unknown = sorted(set(state) - set(opt.state_keys))
    missing = [key for key in opt.state_keys if key not in state]
    if unknown or (state and missing):
        bad = prefix + (unknown or missing)[0]
        raise ModelDirError(f"{vdir}: {bad} is {'unknown' if unknown else 'missing'}: table {name}'s optimizer "
                            f"({opt.name}) keeps {', '.join(prefix + k for k in opt.state_keys)}")
    try:
        if not frozen:
            table.load_rows(rows, weights, state)
            return
        problem = table.rows_problem(rows, weights, {})
        if problem:
            raise ModelDirError(f"table.{name}.{problem[0]} {problem[1]}")
    except ModelDirError as e:
        raise ModelDirError(f"{vdir}: {e} (the manifest's config: hashing.bits {bundle.config.hashing.bits}, "
                            f"so {table.num_rows:,} rows of width {table.dim})") from None
    bundle.tables[name] = FrozenTable.of(table, _index_of(bundle, rows), weights)


def _check_pending(vdir: str, optim: dict[str, np.ndarray], num_ids: int) -> None:
    """The pending counts (admission.IDS_KEY, COUNTS_KEY): both or neither; (n,) ids in
    [0, num_ids) and (n,) counts >= 0."""
    ids_key, counts_key = admission.IDS_KEY, admission.COUNTS_KEY
    ids, counts = optim.get(ids_key), optim.get(counts_key)
    if ids is None and counts is None:
        return
    if ids is None or counts is None:
        have, lack = (ids_key, counts_key) if counts is None else (counts_key, ids_key)
        raise ModelDirError(f"{vdir}: optimizer state holds {have} but lacks {lack}")
    for key, arr in ((ids_key, ids), (counts_key, counts)):
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) != len(ids):
            raise ModelDirError(f"{vdir}: {key} is {arr.dtype} of shape {arr.shape}, expected ({len(ids)},) "
                                "integers: one per pending id")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_ids):
        raise ModelDirError(f"{vdir}: {ids_key} holds ids from {ids.min()} to {ids.max()}, expected "
                            f"0 <= id < {num_ids:,} (2**hashing.bits of the manifest's config)")
    if len(counts) and counts.min() < 0:
        raise ModelDirError(f"{vdir}: {counts_key} holds {counts.min()}, expected counts >= 0")


def _check_images(vdir: str, weights: dict[str, np.ndarray]) -> None:
    """The creative features table (`CreativeFeatures.to_arrays`): (C, d) float features and
    the C ids as bytes cut at (C + 1,) ascending offsets from 0 to the bytes' end."""
    for key in ("images.features", "images.id_bytes", "images.id_offsets"):
        if key not in weights:
            raise ModelDirError(f"{vdir}: an image model whose weights lack {key!r}")
    feats, raw, off = weights["images.features"], weights["images.id_bytes"], weights["images.id_offsets"]
    if feats.ndim != 2 or feats.dtype.kind != "f":
        raise ModelDirError(f"{vdir}: images.features is {feats.dtype} of shape {feats.shape}, expected "
                            "(creatives, features) floats")
    if raw.ndim != 1 or raw.dtype != np.uint8:
        raise ModelDirError(f"{vdir}: images.id_bytes is {raw.dtype} of shape {raw.shape}, expected (n,) uint8")
    if off.ndim != 1 or off.dtype.kind not in "iu" or len(off) != len(feats) + 1 or off[0] != 0 \
            or off[-1] != len(raw) or (np.diff(off.astype(np.int64)) < 0).any():
        raise ModelDirError(f"{vdir}: images.id_offsets is {off.dtype} of shape {off.shape}, expected "
                            f"({len(feats) + 1},) ascending integers from 0 to {len(raw)} (the creative ids' "
                            "ends in images.id_bytes)")


TABLE_PREFIX = "table."  # a table's arrays, in a saved version and in a shard's export


def table_export(name: str, ids: np.ndarray, weights: np.ndarray, state: dict[str, np.ndarray]
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The arrays of table `name`'s rows `ids` (with their weights and optimizer state by key)
    as a version's weights and optimizer state hold them: ({table.<name>.rows, .weights},
    {table.<name>.<key>}). A shard's export holds both in one map. Inverse of `table_arrays`.

    >>> w, o = table_export("linear", np.array([3]), np.ones((1, 1)), {"acc": np.zeros((1, 1))})
    >>> sorted(w), sorted(o), table_arrays({**w, **o}, "linear")[0].tolist()
    (['table.linear.rows', 'table.linear.weights'], ['table.linear.acc'], [3])
    """
    prefix = f"{TABLE_PREFIX}{name}."
    return ({prefix + "rows": ids, prefix + "weights": weights},
            {prefix + key: arr for key, arr in state.items()})


def table_arrays(arrays: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(ids, weights, optimizer state by key) of table `name` in a version's arrays (weights and
    optimizer state together) or a shard's export: `table.<name>.rows`, `.weights`, `.<key>`."""
    prefix = f"{TABLE_PREFIX}{name}."
    state = {k[len(prefix):]: v for k, v in arrays.items()
             if k.startswith(prefix) and k[len(prefix):] not in ("rows", "weights")}
    return arrays[prefix + "rows"], arrays[prefix + "weights"], state


def version_export(weights: dict[str, np.ndarray], optim: dict[str, np.ndarray], dense_names: list[str],
                   dense_keys: list[str]) -> dict[str, np.ndarray]:
    """A saved version's arrays in the layout of a shard's export (`ParamShard.snapshot`, which
    `ModelBundle.from_shard_exports` reads): the tables by global id with their optimizer state
    and the pending counts as they are; the dense parameters (`dense_names`, in `parameters()`
    order) and each of their optimizer states (`dense_keys`) as one flat vector."""
    out = {k: v for k, v in {**weights, **optim}.items() if k.startswith((TABLE_PREFIX, "admission."))}
    out["dense"] = _flat([weights[f"dense.{n}"] for n in dense_names])
    for key in dense_keys:
        if all(f"dense.{n}.{key}" in optim for n in dense_names):  # as `load`: a state not saved starts fresh
            out[f"dense.{key}"] = _flat([optim[f"dense.{n}.{key}"] for n in dense_names])
    return out


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32, copy=False) if arrays \
        else np.zeros(0, np.float32)


def parse_init_from(spec: str, flag: str = "--init-from") -> tuple[str, str | None]:
    """'models' -> ('models', None): CURRENT; 'models:v000003' -> ('models', 'v000003').
    (`--init-from`'s, and `--model`'s of evaluate and predict: `flag` names it in the error.)

    >>> parse_init_from("runs/m:v000012"), parse_init_from("runs/m")
    (('runs/m', 'v000012'), ('runs/m', None))
    """
    head, sep, tail = spec.rpartition(":")
    if sep and checkpoint.VERSION_RE.match(tail):
        return head, tail
    if sep and not tail and head:  # 'DIR:' with the version left out
        raise ModelDirError(f"{flag} {spec!r}: name a version after the ':' (DIR:v000003), or DIR alone for the "
                            "version its CURRENT names")
    if sep and head and os.path.isdir(head) and not os.path.exists(spec):  # 'DIR:1', 'DIR:latest'
        raise ModelDirError(f"{flag} {spec!r}: {tail!r} is not a version name: DIR:vNNNNNN (e.g. {head}:v000001; "
                            "'mariana model list' names them), or DIR alone for the version its CURRENT names")
    return spec, None


# What a warm start must share with its parent: the ids, the model's shape, the
# optimizer state's meaning. Learning rates, epochs and data may change.
WARM_START_KEYS = ("hashing", "model", "optim.linear", "images.field", "images.tower")
INITS = ("model.init_bias", "model.init_scale", "model.seed")  # how a fresh model starts: a warm start does not


def config_differences(parent: JobConfig, child: JobConfig, keys=WARM_START_KEYS) -> list[str]:
    """'hashing.bits: the version has 20, this job 22' per differing key.

    >>> config_differences(JobConfig(), from_dict(JobConfig, {"hashing": {"bits": 20}}))
    ['hashing.bits: the version has 22, this job 20']
    """
    return [f"{key}: the version has {a!r}, this job {b!r}" for key, a, b in differing(parent, child, keys)]


def differing(parent: JobConfig, child: JobConfig, keys=WARM_START_KEYS) -> list[tuple[str, object, object]]:
    """(dotted key, the version's value, this job's) per key of `keys` that differs (a
    section: each of its keys, the fresh model's inits left out)."""
    out = []
    for key in keys:
        a, b = _dotted_value(parent, key), _dotted_value(child, key)
        if dataclasses.is_dataclass(a):
            out += [(f"{key}.{k}", v, getattr(b, k)) for k, v in dataclasses.asdict(a).items()
                    if v != getattr(b, k) and f"{key}.{k}" not in INITS]
        elif a != b:
            out.append((key, a, b))
    return out


def set_options(pairs: list[tuple[str, object, object]]) -> str:
    """The --set options that give a job the version's values.

    >>> set_options([("hashing.numeric", "both", "bucket"), ("model.hidden", [64, 32], [128, 64])])
    "--set hashing.numeric=both --set 'model.hidden=[64, 32]'"
    """
    def one(key, value) -> str:
        text = f"{key}={value if isinstance(value, str) else json.dumps(value)}"
        return f"--set '{text}'" if any(c in text for c in " [],'\"") else f"--set {text}"
    return " ".join(one(key, value) for key, value, _ in pairs)


def _dotted_value(config: JobConfig, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def parent_version(spec: str) -> tuple[str, str]:
    """(model dir, version) a warm start `spec` names: 'DIR:vNNNNNN', or 'DIR' for the version
    CURRENT names now (one version, even if CURRENT moves later)."""
    model_dir, version = parse_init_from(spec)
    if version is None:
        return model_dir, checkpoint.current_version(model_dir)
    checkpoint.require_version(model_dir, version, "to warm-start from")
    return model_dir, version


def check_parent(spec: str, parent: JobConfig, parent_schema: Schema, config: JobConfig, schema: Schema,
                 flag: str = "--init-from") -> None:
    """ConfigError naming every difference that rules out going on from the version `spec`
    (`flag`: what the user called it) with `config`: the hashing, the model, the linear
    optimizer, the schema and whether there are image features must be the same."""
    pairs = differing(parent, config)
    diffs = [f"{key}: the version has {a!r}, this job {b!r}" for key, a, b in pairs]
    if parent_schema.fields != schema.fields:
        diffs.append(f"schema fields: the version has {list(parent_schema.fields)}, this job {list(schema.fields)}")
    if bool(parent.images.creatives) != bool(config.images.creatives):
        diffs.append("images: " + ("the version has image features, this job none" if parent.images.creatives
                                   else "this job has image features, the version none"))
    if diffs:
        fix = (f"give this job the version's settings ({set_options(pairs)}, or its whole config: "
               "`mariana model config --model-dir DIR VERSION > job.toml`, then --config job.toml)"
               if len(pairs) == len(diffs) else "train from scratch instead")
        raise ConfigError(f"{flag} {spec}: the version does not match this job ({'; '.join(diffs)}): "
                          f"a warm start needs the same ids and model: {fix}")


def warm_start(config: JobConfig, schema: Schema, spec: str) -> ModelBundle:
    """A bundle that goes on from version `spec` ('DIR' for its CURRENT, or 'DIR:vNNNNNN'):
    its weights, optimizer state and counts, trained further under `config` (new rates,
    epochs and data are fine; the hashing, the model, the linear optimizer and the
    schema must match, or the error names what differs: `check_parent`)."""
    model_dir, version = parent_version(spec)
    parent = ModelBundle.load(model_dir, version, with_optimizer=True)
    check_parent(spec, parent.config, parent.schema, config, schema)
    for key, before, now in differing(parent.config, config, ("optim", "train.batch_size")):
        log.info("warm start: %s = %r (the version trained with %r)", key, now, before)
    ignored = [f"images.{key} {now!r}" for key, now, before in zip(("creatives", "featurizer"),
                                                                   image_sources(config), image_sources(parent.config))
               if now != before]
    if config.images.creatives and ignored:  # the table is the version's: what a server of it knows
        log.warning("warm start: the version's creative table (%d creatives) is kept; %s not read (a server adds "
                    "new creatives from the Redis cache: mariana featurize-creatives)",
                    len(parent.images.ids) if parent.images is not None else 0, " and ".join(ignored))
    parent.config = config
    parent.optimizers = {t.name: table_optimizer(config, t.role) for t in parent.model.tables}
    parent.dense_opt.opt = AdaGrad(lr=config.optim.dense_lr, initial_accumulator=config.optim.initial_accumulator)
    parent.parent = {"model_dir": os.path.abspath(model_dir),
                     "version": version,
                     "rows_trained": parent.rows_trained,
                     "learned": checkpoint.learned_paths(parent.manifest)}  # known after a prune of the parent
    return parent


def image_sources(config: JobConfig) -> tuple[str, str]:
    """(the creatives dir, the featurizer dir) a job's image features come from, absolute.

    >>> image_sources(from_dict(JobConfig, {"images": {"creatives": "/ads"}}))
    ('/ads', '/ads/featurizer')
    """
    creatives = os.path.abspath(config.images.creatives) if config.images.creatives else ""
    featurizer = config.images.featurizer or (os.path.join(creatives, "featurizer") if creatives else "")
    return creatives, os.path.abspath(featurizer) if featurizer else ""


class Snapshot:
    """A bundle's trainable state at one moment (the best epoch so far): the touched
    rows of every table with their optimizer state, and the dense parameters with
    theirs. `restore` puts it back, rows touched since become untouched again."""

    def __init__(self, bundle: ModelBundle):
        self.tables = {name: t.saved_arrays() for name, t in bundle.tables.items()}
        self.dense = [p.copy() for _, p in dense_params(bundle.model)]
        self.dense_state = [{k: v.copy() for k, v in st.items()} for st in bundle.dense_opt.state]
        self.steps, self.rows_trained = bundle.steps, bundle.rows_trained
        self.counts = bundle.counts.array.copy() if bundle.counts is not None else None

    def restore(self, bundle: ModelBundle) -> None:
        for name, t in bundle.tables.items():
            rows, weights, state = self.tables[name]
            t.weights[t.touched] = 0.0
            for arr in t.state.values():
                arr[t.touched] = 0.0
            t.touched[:] = False
            t.load_rows(rows, weights, state)
        for (_, p), saved in zip(dense_params(bundle.model), self.dense):
            p[...] = saved
        for st, saved in zip(bundle.dense_opt.state, self.dense_state):
            for k, v in saved.items():
                st[k][...] = v
        bundle.steps, bundle.rows_trained = self.steps, self.rows_trained
        if self.counts is not None:
            bundle.counts.array[...] = self.counts


def torch_version() -> str:
    """The installed torch's version, recorded in a manifest, without importing torch."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def _few_sigmoid(logits: np.ndarray) -> np.ndarray:
    """Click probabilities of a request's few logits: scipy's expit, one ufunc call (~0.2 us
    a row against ~2 for torch's or numpy's formula), imported the first time (a server's
    warm-up prediction), so training and evaluation never import scipy."""
    global _EXPIT
    if _EXPIT is None:
        from scipy.special import expit as _EXPIT
    return _EXPIT(logits)


_EXPIT = None


def _check_finite(weights: dict[str, np.ndarray]) -> None:
    """A model with NaN or infinite weights predicts NaN: it is never written."""
    bad = finite.nonfinite(weights)
    if bad:
        raise MarianaError(f"the trained model holds {finite.describe(bad)} (training diverged): "
                           f"nothing to publish; {LOWER_RATES}")


def table_memory(bundle: ModelBundle) -> dict:
    """A loaded bundle's tables as /v1/model shows them: "frozen" (FrozenTables) or "dense"
    (HashedTables), and their bytes (a dense table's: all of its rows', which the OS maps as
    they are written)."""
    tables = list(bundle.tables.values())
    if tables and isinstance(tables[0], FrozenTable):
        indexes = {id(t.index): t.index.nbytes for t in tables}
        return {"form": "frozen", "rows": tables[0].index.n,
                "bytes": sum(t.nbytes for t in tables) + sum(indexes.values())}
    return {"form": "dense", "bytes": sum(t.weights.nbytes + t.touched.nbytes for t in tables)}


def table_bytes(num_ids: int, tables: list[tuple[int, int]]) -> int:
    """Bytes a model's tables take once every row is written: per table of (dim, optimizer
    slots), weights and each slot float32 (num_ids x dim) and a touched flag per row. The
    arrays are made zero and take memory as rows are written, so a job on few distinct ids
    runs in less; one that writes most rows needs all of it.

    >>> table_bytes(2 ** 32, [(1, 2)]) / 2 ** 30  # LR with FTRL (z, n) at hashing.bits = 32
    52.0
    """
    return sum(num_ids * (4 * dim * (1 + slots) + 1) for dim, slots in tables)


def machine_memory() -> int | None:
    """The memory this process may use, in bytes: the machine's, or its cgroup's limit when
    lower (a unit's MemoryMax=, a container's); None where the OS does not say."""
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        have = None
    limits = [n for n in (have, memory_limit()) if n]
    return min(limits) if limits else None


def say_if_too_big(bundle: "ModelBundle") -> None:
    """A warning, before training, when the tables would outgrow the machine once written: an
    exploratory tester's LR at hashing.bits = 32 (52 GiB) crept to 20 GB resident at 275 rows/s
    on a 24 GB machine without a word; a DNN at bits 28 (~34 GiB) would have been killed by the
    kernel part-way."""
    say_if_tables_too_big(bundle.config, bundle.model.tables, bundle.optimizers, bundle.config.hashing.num_ids,
                          "the model's tables")


def say_if_tables_too_big(config: JobConfig, specs, optimizers: dict[str, SparseOptimizer], num_rows: int,
                          whose: str, limit: int = 0) -> str | None:
    """`say_if_too_big` for `num_rows` rows of the tables `specs` (the model's TableSpecs) trained
    by `optimizers` (by table name), `whose` they are in the warning (a parameter-server shard's
    share, say); `limit` (bytes, 0: none) is the service's `cluster.memory_max_bytes`, where it
    is below the machine's. The warning when it warned (a shard hands it on to the job's submitter)."""
    tables = [(t.dim, len(optimizers[t.name].state_keys)) for t in specs]
    need, have = table_bytes(num_rows, tables), machine_memory()
    configured = limit > 0 and (not have or limit < have)
    have = limit if configured else have
    if not have or need <= have:
        return None
    bits, whole = config.hashing.bits, num_rows == config.hashing.num_ids
    room = (f"its limit of {_size(have)} (cluster.memory_max_bytes)" if configured
            else f"this machine's {_size(have)} of memory")
    text = (f"{whose} take up to {_size(need)} once written (hashing.bits = {bits}: 2^{bits} rows each"
            f"{'' if whole else f', {num_rows:,} here'}), more than {room}: lower hashing.bits"
            f"{'' if whole else ' or add shards'}, or expect swapping and the kernel's OOM killer")
    log.warning("%s", text)
    return text


def _size(n: int) -> str:
    """Bytes for a warning line.

    >>> _size(52 * 2 ** 30), _size(40 * 2 ** 20)
    ('52.0 GiB', '40.0 MiB')
    """
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def table_optimizer(config: JobConfig, role: str) -> SparseOptimizer:
    o = config.optim
    if role == "embedding":
        return AdaGrad(lr=o.embed_lr, initial_accumulator=o.initial_accumulator)
    if o.linear == "ftrl":
        return FTRL(alpha=o.ftrl_alpha, beta=o.ftrl_beta, l1=o.ftrl_l1, l2=o.ftrl_l2)
    return AdaGrad(lr=o.lr, initial_accumulator=o.initial_accumulator)
