"""`ModelBundle`: everything one model is — its job config, schema, encoder,
torch model, hashed tables and optimizer state — with save, load and predict.

Training, evaluation, `mariana predict` and serving all hold a bundle, so a
row takes the same path from bytes to pCTR everywhere.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from featurizer.creatives import CreativeFeatures, ImageFeatureEncoder
from sparse.batch import SparseBatch
from sparse.encode import Encoder
from sparse.errors import ConfigError, MarianaError, ModelDirError
from sparse.optim import AdaGrad, FTRL, SparseOptimizer
from sparse.schema import Schema
from sparse.table import HashedTable
from trainer import checkpoint
from trainer.config import LOWER_RATES, JobConfig, from_dict
from trainer.models.base import build_model, make_input, unique_ids
from trainer.strategies.ps_step import DenseOptimizer


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
                                        [p.data.numpy() for p in self.model.parameters()])
        self.rows_trained = 0
        self.steps = 0
        self.manifest: dict = {}  # of the version this bundle was loaded from

    # ---- inference ------------------------------------------------------------

    def predict(self, batch: SparseBatch) -> np.ndarray:
        """(B,) click probabilities; reads tables without changing them."""
        if batch._unique is None and batch.nnz <= FEW_ENTRIES:
            # A request's few rows: look every entry up as it comes. Reads need no
            # distinct ids, each entry gets the same row values in the same order,
            # and a hash-based unique costs more than the duplicate lookups it saves.
            uniq, inverse = batch.ids, torch.arange(batch.nnz)
        else:
            uniq, inverse = unique_ids(batch)
        rows = {name: torch.from_numpy(t.lookup(uniq)) for name, t in self.tables.items()}
        with torch.no_grad():
            logits = self.model(make_input(batch, inverse, rows))
        return torch.sigmoid(logits).numpy()

    # ---- persistence ------------------------------------------------------------

    def save(self, model_dir: str, extra: dict | None = None, make_current: bool = True) -> str:
        weights, optim = {}, {}
        for name, t in self.tables.items():
            rows = t.touched_rows()
            weights[f"table.{name}.rows"] = rows
            weights[f"table.{name}.weights"] = t.weights[rows]
            for key, arr in t.state.items():
                optim[f"table.{name}.{key}"] = arr[rows]
        for (pname, p), state in zip(self.model.named_parameters(), self.dense_opt.state):
            weights[f"dense.{pname}"] = p.detach().numpy()
            for key, arr in state.items():
                optim[f"dense.{pname}.{key}"] = arr
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
                      "dense_parameters": sum(p.numel() for p in self.model.parameters()),
                      "table_rows": {n: int(len(weights[f"table.{n}.rows"])) for n in self.tables}},
            "rows_trained": self.rows_trained,
            "steps": self.steps,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__,
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
    def load(cls, model_dir: str, version: str | None = None, with_optimizer: bool = False) -> "ModelBundle":
        manifest, weights, optim = checkpoint.load_version(model_dir, version, with_optimizer)
        try:
            config = from_dict(JobConfig, manifest["config"])
            schema = Schema.from_dict(manifest["schema"])
        except KeyError as e:
            raise ModelDirError(f"{model_dir}: manifest lacks {e}") from None
        images = None
        if config.images.creatives:
            try:
                images = CreativeFeatures.from_arrays(weights)
            except KeyError as e:
                raise ModelDirError(f"{model_dir}: an image model whose weights lack {e}") from None
        bundle = cls(config, schema, images)
        bundle.manifest = manifest
        bundle.rows_trained = manifest.get("rows_trained", 0)
        bundle.steps = manifest.get("steps", 0)
        params = dict(bundle.model.named_parameters())
        for pname, p in params.items():
            try:
                p.data.copy_(torch.from_numpy(weights[f"dense.{pname}"]))
            except KeyError:
                raise ModelDirError(f"{model_dir}: weights lack dense.{pname}: the version was saved by a mariana "
                                    "whose model had other parameters (e.g. an 'fm' model from before its FM term "
                                    "became a mean over field pairs); train it again") from None
        for name, t in bundle.tables.items():
            state = {k.rsplit(".", 1)[1]: v for k, v in optim.items() if k.startswith(f"table.{name}.")}
            try:
                t.load_rows(weights[f"table.{name}.rows"], weights[f"table.{name}.weights"], state)
            except KeyError as e:
                raise ModelDirError(f"{model_dir}: weights lack {e}") from None
        for (pname, _), st in zip(bundle.model.named_parameters(), bundle.dense_opt.state):
            for key in st:
                if f"dense.{pname}.{key}" in optim:
                    st[key][...] = optim[f"dense.{pname}.{key}"]
        return bundle


def _check_finite(weights: dict[str, np.ndarray]) -> None:
    """A model with NaN or infinite weights predicts NaN: it is never written."""
    for name, arr in weights.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise MarianaError(f"the trained model's {name} holds NaN or infinite values (training diverged): "
                               f"nothing to publish; {LOWER_RATES}")


def table_optimizer(config: JobConfig, role: str) -> SparseOptimizer:
    o = config.optim
    if role == "embedding":
        return AdaGrad(lr=o.embed_lr, initial_accumulator=o.initial_accumulator)
    if o.linear == "ftrl":
        return FTRL(alpha=o.ftrl_alpha, beta=o.ftrl_beta, l1=o.ftrl_l1, l2=o.ftrl_l2)
    return AdaGrad(lr=o.lr, initial_accumulator=o.initial_accumulator)
