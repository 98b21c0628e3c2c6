"""One parameter-server shard's state and math, without sockets.

Shard s of S owns the ids with `id % S == s` of every hashed table (local row
`id // S`, so `HashedTable` initializes a row exactly as a whole table would)
and their optimizer state; shard 0 also owns the dense parameters. A push is
applied at most once per step id: a retried or replayed step is a no-op.

    shard = ParamShard(config, schema, shard=0, num_shards=1)
    shard.warm_start(weights, optim)                 # a warm start: its slice of a saved version
    rows, dense = shard.pull(ids)                    # table -> (n, dim), flat dense params
    shard.push("e1/c0:0", 4096, ids, grads, dense_grad)  # True: applied; False: seen before
    weights, manifest = shard.snapshot()               # a consistent checkpoint

With `hashing.min_count` K > 1 the shard also counts, for the ids it owns, the
occurrences of ids not admitted yet (sparse/admission.py): a pull that brings
each id's occurrences in the batch (`gather_admitted`) learns which ids are
admitted (a row, or count + occurrences >= K) and materializes only those; the
push brings the occurrences of the ids that were not (`seen`) and counts them
once per step, like its gradients. So counts are exact with any number of
workers, and survive a checkpoint (the pending ones; an admitted id has a row).
"""
from __future__ import annotations

import re

import numpy as np

from mariana.sparse import admission
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import DataFormatError
from mariana.sparse.optim import AdaGrad
from mariana.sparse.schema import Schema
from mariana.sparse.table import HashedTable
from mariana.trainer.bundle import (TABLE_PREFIX, say_if_tables_too_big, table_arrays, table_export, table_optimizer,
                                    version_export)
from mariana.trainer.config import JobConfig
from mariana.trainer.models.registry import build_model, dense_params, dense_vector
from mariana.trainer.strategies.ps_step import DenseOptimizer


STEP_RE = re.compile(r"^e(\d+)/.+")


class ParamShard:
    def __init__(self, config: JobConfig, schema: Schema, shard: int, num_shards: int, image_width: int = 0,
                 memory_limit: int = 0):
        """`image_width`: columns of creative features (+ the unknown flag) in the dense block;
        `memory_limit`: the service's `cluster.memory_max_bytes` (0: none), in its warning when
        the tables would outgrow it."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards}")
        self.config, self.schema, self.shard, self.num_shards = config, schema, shard, num_shards
        encoder = Encoder(schema, config.hashing)
        model = build_model(config.model, encoder.num_fields, encoder.dense_dim, image_width, config.images.tower)
        self.specs = {t.name: t for t in model.tables}
        self.dense_names = [name for name, _ in dense_params(model)]  # the flat vector's parts, in order
        num_ids = config.hashing.num_ids
        local_rows = (num_ids - shard + num_shards - 1) // num_shards
        self.tables = {t.name: HashedTable(t.name, local_rows, t.dim, t.init_scale, seed=config.model.seed,
                                           id_offset=shard, id_stride=num_shards) for t in model.tables}
        self.optimizers = {t.name: table_optimizer(config, t.role) for t in model.tables}
        # what the shard's start answers the coordinator, which shows it to whoever follows the job
        self.memory_warning = say_if_tables_too_big(config, model.tables, self.optimizers, local_rows,
                                                    f"parameter-server shard {shard} of {num_shards}: its tables",
                                                    memory_limit)
        # Dense parameters live on shard 0, as one flat vector (AdaGrad is per element).
        self.dense = dense_vector(model) if shard == 0 else np.zeros(0, np.float32)
        self.dense_opt = DenseOptimizer(AdaGrad(lr=config.optim.dense_lr,
                                                initial_accumulator=config.optim.initial_accumulator),
                                        [self.dense])
        self.applied: dict[str, int] = {}  # step id -> rows, for every step applied here
        k = config.hashing.min_count
        self.counts = admission.Counts(local_rows, k) if k > 1 else None

    # ---- requests ---------------------------------------------------------------

    def local_rows(self, ids: np.ndarray) -> np.ndarray:
        """Global ids -> rows of this shard; ids of another shard are an error."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.config.hashing.num_ids):
            raise DataFormatError(f"ids must lie in [0, {self.config.hashing.num_ids})")
        if self.num_shards == 1:
            return ids
        if ids.size and bool((ids % self.num_shards != self.shard).any()):
            raise DataFormatError(f"ids of another shard sent to shard {self.shard} of {self.num_shards}")
        return ids // self.num_shards

    def pull(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """table -> (len(ids), dim) rows for unique global `ids` (materialized on first pull)."""
        return self.gather(self.local_rows(ids))

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """table -> the rows at local positions `rows` (from `local_rows`)."""
        return {name: t.gather(rows) for name, t in self.tables.items()}

    def gather_admitted(self, rows: np.ndarray, occ: np.ndarray,
                        step: str | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(table -> rows, (n,) admitted) for local `rows` that occur `occ` times in a batch
        (min_count > 1): the admitted ones are materialized, the others read without
        (a rare id's row, before a push brings its first gradient). Nothing is counted.
        A pull for a `step` applied here already (issued again after its lease lapsed) admits
        nothing new: that push counted these occurrences, and its repeat will be ignored."""
        if self.counts is None:
            raise DataFormatError("a pull with occurrences sent to a shard of a job without hashing.min_count")
        if occ.shape != rows.shape:
            raise DataFormatError(f"occurrences of shape {occ.shape} for {len(rows)} ids")
        if step is not None and step in self.applied:
            return {name: t.lookup(rows) for name, t in self.tables.items()}, self.touched[rows]
        ok = self.counts.admitted(rows, occ.astype(np.int64), self.touched[rows])
        for t in self.tables.values():
            t.materialize(rows[ok])
        return {name: t.lookup(rows) for name, t in self.tables.items()}, ok

    @property
    def table0(self) -> HashedTable:
        """Any table: every table has the same rows, and materializes them alike."""
        return next(iter(self.tables.values()))

    @property
    def touched(self) -> np.ndarray:
        """(local rows,) bool: rows this shard has materialized."""
        return self.table0.touched

    def push(self, step: str, num_rows: int, ids: np.ndarray, grads: dict[str, np.ndarray],
             dense_grad: np.ndarray | None, seen: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
        """Apply one step's gradients for unique `ids`; False (and no change) if
        `step` was applied before. `seen`: (unique ids, occurrences) of the step's
        ids that were not admitted, counted here (min_count > 1)."""
        if step in self.applied:
            return False
        if not STEP_RE.match(step):
            raise DataFormatError(f"step id {step!r} is not e<epoch>/<batch>")
        rows = self.local_rows(ids)
        for name, g in grads.items():
            table = self.tables.get(name)
            if table is None:
                raise DataFormatError(f"no table {name!r} (tables: {', '.join(self.tables)})")
            if g.shape != (len(rows), table.dim):
                raise DataFormatError(f"grads of {name!r} have shape {g.shape}, expected {(len(rows), table.dim)}")
        if dense_grad is not None and dense_grad.shape != self.dense.shape:
            raise DataFormatError(f"dense grads have shape {dense_grad.shape}, expected {self.dense.shape}")
        seen_rows = None
        if seen is not None:
            if self.counts is None:
                raise DataFormatError("occurrences pushed to a shard of a job without hashing.min_count")
            seen_rows = self.local_rows(seen[0])
            if seen[1].shape != seen_rows.shape:
                raise DataFormatError(f"occurrences of shape {seen[1].shape} for {len(seen_rows)} seen ids")
        for name, g in grads.items():
            table = self.tables[name]
            table.materialize(rows)  # rows first touched by this push (e.g. after a restore)
            self.optimizers[name].apply(table, rows, g, unique=True)
        if dense_grad is not None and self.dense.size:
            self.dense_opt.apply([dense_grad])
        if seen_rows is not None:
            self.counts.add(seen_rows, seen[1].astype(np.int64))
        self.applied[step] = int(num_rows)
        return True

    def rows_by_epoch(self) -> dict[int, int]:
        """Rows applied per epoch; step ids start with 'e<epoch>/'."""
        out: dict[int, int] = {}
        for step, rows in self.applied.items():
            epoch = int(STEP_RE.match(step).group(1))
            out[epoch] = out.get(epoch, 0) + rows
        return out

    # ---- checkpoints and export ----------------------------------------------------

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, manifest) of everything this shard owns, copied: write them
        on another thread while pushes go on."""
        arrays: dict[str, np.ndarray] = {}
        for name, t in self.tables.items():
            rows, weights, state = t.saved_arrays()
            for part in table_export(name, t.global_ids(rows), weights, state):
                arrays.update(part)
        arrays["dense"] = self.dense.copy()
        for key, st in self.dense_opt.state[0].items():
            arrays[f"dense.{key}"] = st.copy()
        if self.counts is not None:  # global ids: an export is assembled with the other shards'
            arrays.update(admission.to_arrays(self.counts, self.touched, self.table0.global_ids))
        manifest = {"shard": self.shard, "num_shards": self.num_shards,
                    "applied": dict(self.applied), "config": self.config.to_dict(),
                    "schema": self.schema.to_dict()}
        return arrays, manifest

    def restore(self, arrays: dict[str, np.ndarray], manifest: dict) -> None:
        if (manifest.get("shard"), manifest.get("num_shards")) != (self.shard, self.num_shards):
            raise DataFormatError(f"checkpoint of shard {manifest.get('shard')}/{manifest.get('num_shards')} "
                                  f"loaded into shard {self.shard}/{self.num_shards}")
        self.load(arrays)
        self.applied = {str(k): int(v) for k, v in manifest.get("applied", {}).items()}

    def warm_start(self, weights: dict[str, np.ndarray], optim: dict[str, np.ndarray]) -> None:
        """Start from a saved version (`ModelBundle.save`'s weights and optimizer state) instead
        of the init: this shard's slice of its tables, optimizer state and pending counts, and
        on shard 0 its dense parameters with their state. KeyError names an array it lacks."""
        self.load(self.own(version_export(weights, optim, self.dense_names, list(self.dense_opt.state[0]))))

    def own(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The part of a whole model's export (every shard's ids) that this shard owns."""
        out = {k: v for k, v in arrays.items() if k == "dense" or k.startswith("dense.")}
        for name in self.tables:
            mine = table_arrays(arrays, name)[0] % self.num_shards == self.shard
            out.update({k: v[mine] for k, v in arrays.items() if k.startswith(f"{TABLE_PREFIX}{name}.")})
        if admission.IDS_KEY in arrays:
            mine = arrays[admission.IDS_KEY] % self.num_shards == self.shard
            out.update({k: arrays[k][mine] for k in (admission.IDS_KEY, admission.COUNTS_KEY)})
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Rows, optimizer state and pending counts of this shard's ids (global), and the dense
        parameters with their state (used on shard 0), in the layout `snapshot` writes."""
        for name, t in self.tables.items():
            ids, weights, state = table_arrays(arrays, name)
            t.load_rows(self.local_rows(ids), weights, state)
        if self.dense.size:
            self.dense[...] = arrays["dense"]
            for key, st in self.dense_opt.state[0].items():
                if f"dense.{key}" in arrays:
                    st[...] = arrays[f"dense.{key}"]
        if self.counts is not None:
            admission.load_arrays(self.counts, arrays, self.local_rows)
