"""The Python API behind `mariana.train`, `mariana.load` and `mariana.load_config`
(mariana/__init__.py shows them; docs/python-api.md walks through them).

Every call goes through the code the CLI runs, so a notebook and a shell get the
same model and the same numbers:

- `train` -> `trainer.job.run_local_job` (`mariana train`);
- `Model.predict(path)` -> `trainer.data.BatchStream` + `ModelBundle.predict`
  (`mariana predict`); `Model.predict(rows)` -> `sparse.records.parse_records` +
  `Encoder.encode_rows` + `ModelBundle.predict` (what the HTTP endpoint does);
- `Model.evaluate` -> `trainer.strategies.local.evaluate` (`mariana evaluate`);
- `load_config` -> `trainer.config.load_config` (`--config`, `MARIANA_...`, `--set`).

Torch loads on the first `train` or `load`, not on `import mariana`. Bad input
raises the CLI's errors (`MarianaError` subclasses, with the CLI's messages: an
unwritable `out` too, named as the CLI's `--out`; an unknown override is said to
come from "a keyword argument", not from `--set`). A DNN job sets torch's threads
for its run only, no call reseeds torch's global generator, and a child forked with torch
imported predicts and trains on one torch thread (`mariana._one_torch_thread`).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Union

import numpy as np

import mariana
from mariana.sparse.errors import ConfigError, DataFormatError, MarianaError
from mariana.sparse.settings import from_dict, shown
from mariana.trainer.config import JobConfig
from mariana.trainer.config import load_config as _load_job_config

if TYPE_CHECKING:
    from mariana.sparse.schema import Schema
    from mariana.trainer.bundle import ModelBundle

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
Data = Union[PathLike, Sequence[PathLike]]
# Keyword shortcuts for config keys: the CLI's flags of `mariana train` (services/cli.py, _job_config).
SHORTCUTS = {"model": "model.kind", "epochs": "train.epochs", "format": "data.format",
             "valid_fraction": "train.valid_fraction", "patience": "train.patience",
             "batch_size": "train.batch_size", "bits": "hashing.bits", "images": "images.creatives",
             "featurizer": "images.featurizer"}
CHUNK_ROWS = 65_536  # dict rows parsed and scored at a time: bounds memory for a big DataFrame
SHOWN_BAD = 5        # bad rows named in one error message


# ---- config ---------------------------------------------------------------------

def load_config(path: PathLike | None = None, **overrides: Any) -> JobConfig:
    """A job config loaded as `mariana train` loads it: defaults <- the TOML file at
    `path` <- `MARIANA_<SECTION>__<KEY>` environment variables <- `overrides`.

    An override is a dotted key (`**{"train.epochs": 2}`, as `--set` takes it), the
    same with `__` (`train__epochs=2`, as the environment spells it) or one of the
    CLI's flags (`epochs`, `bits`, `model`, ...: `SHORTCUTS`); a None value leaves
    the key as loaded. Unknown keys and wrong types raise ConfigError naming the key.

    >>> cfg = load_config(train__epochs=2, bits=18, model="dnn")
    >>> cfg.train.epochs, cfg.hashing.bits, cfg.model.kind
    (2, 18, 'dnn')
    >>> load_config(**{"train.epoch": 2})
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.ConfigError: train: unknown key 'train.epoch' (known: ...) ... (a keyword argument)
    """
    return _load_job_config(path, overrides=dotted_overrides(overrides), overrides_from="a keyword argument")


def dotted_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword overrides as the dotted keys `--set` takes.

    A numpy scalar is the Python number it holds (a sweep's `np.arange` values).

    >>> dotted_overrides({"train.epochs": 2, "optim__lr": np.float32(0.05), "bits": np.int64(20), "patience": None})
    {'train.epochs': 2, 'optim.lr': 0.05, 'hashing.bits': 20}
    """
    out = {}
    for key, value in overrides.items():
        if value is None:
            continue
        value = _numbers(value)
        if "." not in key and "__" not in key and key not in SHORTCUTS:
            raise ConfigError(f"unknown override {key!r}: name a config key as section.key "
                              f"(**{{'train.epochs': 2}} or train__epochs=2) or use one of {', '.join(SHORTCUTS)}")
        dotted = SHORTCUTS.get(key, key.replace("__", "."))
        if dotted in out and out[dotted] != value:  # epochs=1 and train.epochs=2: the last one won, unsaid
            raise ConfigError(f"two overrides of {dotted} disagree: {out[dotted]!r} and {value!r} ({key}); give one")
        out[dotted] = value
    return out


def _numbers(value: Any) -> Any:
    """numpy scalars (also in a list or an array, as `model.hidden` takes one) as Python
    numbers; a float32 as the decimal it prints as (0.05, not 0.05000000074505806)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_numbers(v) for v in value]
    if isinstance(value, np.floating) and not isinstance(value, np.float64):
        return float(str(value))
    return value.item() if isinstance(value, np.generic) else value


def job_config(config: JobConfig | PathLike | Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> JobConfig:
    """The config a job trains with: `config` (a JobConfig, taken as it is; a TOML path or
    None, loaded as the CLI loads them; a dict of dotted keys, any spelling overrides take)
    and then `overrides` on top. Always a new object: a job settles its "auto" values in place."""
    if isinstance(config, JobConfig):
        tree = config.to_dict()
        for key, value in dotted_overrides(overrides).items():
            _set_dotted(tree, key, value)
        return from_dict(JobConfig, tree)
    if config is None or isinstance(config, (str, os.PathLike)):
        return load_config(config, **overrides)
    if isinstance(config, Mapping):  # overrides on top: `epochs=3` over {"train.epochs": 2} was "two ... disagree"
        return load_config(None, **{**dotted_overrides(config), **dotted_overrides(overrides)})
    raise TypeError(f"config: expected a mariana.Config, a TOML path or a dict of dotted keys, "
                    f"got {type(config).__name__}")


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    *sections, name = key.split(".")
    node = tree
    for part in sections:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a table")
    node[name] = value


# ---- train ------------------------------------------------------------------------

@dataclass(frozen=True)
class Result:
    """What `train` did: the numbers of `mariana train --json` that matter, and `record`,
    its whole record (the same keys; NaN stays NaN where the CLI prints null).
    `temporary`: `model_dir` is a fresh temporary directory (train's `out=None`),
    which is never removed for you."""

    model_dir: str
    version: str
    kind: str                      # "lr" | "dnn"
    auc: float | None              # on test_data (None without it)
    logloss: float | None
    calibration: float | None      # mean pCTR / CTR on test_data
    rows: int                      # training rows, every epoch counted
    test_rows: int
    epochs: int
    train_seconds: float
    temporary: bool = False
    record: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, record: dict, temporary: bool = False) -> "Result":
        return cls(record["model_dir"], record["model_version"], record["model"], record["auc"],
                   record["logloss"], record["calibration"], record["train_rows"], record["test_rows"],
                   record["epochs"], record["train_seconds"], temporary, record)

    def load(self) -> "Model":
        """The version this job published (even after CURRENT has moved on)."""
        return load(self.model_dir, self.version)


def train(data: Data, model: str | None = None, config: JobConfig | PathLike | Mapping[str, Any] | None = None,
          out: PathLike | None = None, *, test_data: Data | None = None, valid_data: Data | None = None,
          init_from: str | None = None, **overrides: Any) -> Result:
    """Train in this process and publish a version, as `mariana train` (local mode) does.

    `data`, `test_data`, `valid_data`: a file, directory or glob, a comma-separated
    string of them (as `--data`), or a list. `model`: "lr" or "dnn" (None: the
    config's, lr by default). `config`: see `job_config`; `overrides` as in
    `load_config`. `out`: the model directory (a version is added; CURRENT moves to
    it); None makes a fresh temporary directory (`Result.temporary`). `init_from`:
    warm start from 'DIR' (its CURRENT) or 'DIR:vNNNNNN', as `--init-from`.
    """
    from mariana.trainer.job import run_local_job
    from mariana.trainer.models.registry import kind_uses_torch

    cfg = job_config(config, {**overrides, "model": model})
    if mariana._forked_after_torch and cfg.train.threads != 1 and kind_uses_torch(cfg.model.kind):
        log.warning("this process was forked after torch ran in its parent, and OpenMP's threads do not survive "
                    "a fork: train.threads = 1 here (more would wait forever); start it with the spawn method "
                    "for more")
        cfg.train.threads = 1
    train_paths = data_paths(data)
    test_paths, valid_paths = data_paths(test_data, "test_data"), data_paths(valid_data, "valid_data")
    temporary = out is None
    out_dir = tempfile.mkdtemp(prefix="mariana-model-") if temporary else _path("out", out)
    with _torch_threads_kept():
        record = run_local_job(cfg, train_paths, test_paths, out_dir, valid_paths=valid_paths,
                               init_from=None if init_from is None else _path("init_from", init_from))
    return Result.of(record, temporary)


@contextmanager
def _torch_threads_kept():
    """torch's intra-op thread count as the caller had it: a DNN job sets it to
    `train.threads` (or the cores) for its run, as `mariana train` does, and a
    notebook's own `torch.set_num_threads` stays its own. (A torch not yet imported
    has no setting of the caller's to keep.)"""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else 0
    try:
        yield
    finally:
        if before and torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _path(name: str, value: Any) -> str:
    """`value` as a path, or ConfigError naming the argument (os.fspath's TypeError did not).

    >>> _path("out", None)
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: out: expected a path (str or os.PathLike), got None
    """
    try:
        return os.fspath(value)
    except TypeError:
        raise ConfigError(f"{name}: expected a path (str or os.PathLike), got {_shown(value)}") from None


def _shown(value: Any) -> str:
    """A scalar as `shown` gives it (10**5000 was a ValueError from repr), else its type."""
    return shown(value) if isinstance(value, (int, float, bool, type(None))) else f"a {type(value).__name__}"


def data_paths(data: Data | None, what: str = "data") -> list[str]:
    """The files `data` names, expanded as the CLI expands `--data` (sparse/inputs.py);
    NoDataFiles (a MarianaError) names an item that names no file, and a MarianaError
    says so when `data` (the argument `what`) is rows, not paths.

    >>> data_paths([{"label": 1, "I1": 3}])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.MarianaError: data: a list of dicts is rows, not data paths: ...; write the rows to a ...
    """
    from mariana.sparse.inputs import expand_data_paths, split_spec

    if data is None:
        return []
    if isinstance(data, str):
        items = split_spec(data)
    elif isinstance(data, os.PathLike):
        items = [os.fspath(data)]
    else:
        items = list(data) if _is_rows_or_paths(data) else None
        if items is None or not all(isinstance(p, (str, os.PathLike)) for p in items):
            raise MarianaError(_not_paths(data, what, items))
        items = [os.fspath(p) for p in items]
    return expand_data_paths(items)


def _is_rows_or_paths(data: Any) -> bool:
    """An iterable of items (paths, or rows by mistake), not a frame, a dict or bytes."""
    return (isinstance(data, Iterable) and not isinstance(data, (bytes, Mapping))
            and not (hasattr(data, "to_dict") and hasattr(data, "columns")))


def _not_paths(data: Any, what: str, items: list | None = None) -> str:
    """Why `data` (its `items`, where it is an iterable) is not what `data_paths` takes,
    and what to do instead."""
    files = "training and evaluation read files (a file, directory or glob, a comma-separated string or a list)"
    if hasattr(data, "to_dict") and hasattr(data, "columns"):
        return (f"{what}: a DataFrame is rows, not data paths: {files}; write it to a Parquet or TSV file first, "
                "e.g. frame.to_parquet('train.parquet')")
    if items and all(isinstance(r, Mapping) for r in items):
        return (f"{what}: a list of dicts is rows, not data paths: {files}; write the rows to a Parquet or TSV "
                "file first")
    return f"{what}: expected data paths, got {type(data).__name__}: {files}"


# ---- load, predict, evaluate --------------------------------------------------------

def load(model_dir: PathLike, version: str | None = None) -> "Model":
    """A published version of `model_dir` (default: the one CURRENT names; 'DIR:vNNNNNN'
    names one, as `--model` and `init_from` take it), loaded as `mariana predict` and the
    server load it. ModelDirError when there is none."""
    from mariana.trainer import checkpoint
    from mariana.trainer.bundle import ModelBundle, parse_init_from

    model_dir = _path("model_dir", model_dir)
    if version is not None and not isinstance(version, str):
        raise ConfigError(f"version: expected a version name such as 'v000001', got {_shown(version)}")
    model_dir, named = parse_init_from(model_dir, "model_dir")  # (it said "no such model directory")
    if named is not None and version not in (None, named):
        raise ConfigError(f"model_dir names {named} and version {version!r}: name the version once")
    version = named or version
    if version is None:
        version = checkpoint.current_version(model_dir)
    else:
        checkpoint.require_version(model_dir, version)
    return Model(ModelBundle.load(model_dir, version, tables="auto"), model_dir, version)


class Model:
    """One loaded version. `predict` takes a data file (in the model's format), a list
    of dicts (field -> value, as the HTTP endpoint takes them) or a DataFrame (columns
    named as the schema's fields); `evaluate` takes labeled data files."""

    def __init__(self, bundle: ModelBundle, model_dir: str, version: str):
        self.bundle, self.model_dir, self.version = bundle, os.path.abspath(model_dir), version

    @property
    def config(self) -> JobConfig:
        """The job config the version was trained with (as its manifest records it)."""
        return self.bundle.config

    @property
    def kind(self) -> str:
        return self.bundle.config.model.kind

    @property
    def schema(self) -> Schema:
        """The rows' layout (`sparse.schema.Schema`): `.numeric`, `.categorical`, `.label`."""
        return self.bundle.schema

    @property
    def manifest(self) -> dict:
        """The version's manifest: config, metrics, training data, parent."""
        return self.bundle.manifest

    def __repr__(self) -> str:
        return f"Model({self.model_dir!r}, version={self.version!r}, kind={self.kind!r})"

    def predict(self, rows: Any) -> np.ndarray:
        """(n,) float64 pCTR, one per row in order.

        - a path (file, directory, glob, comma-separated or a list of paths): the
          rows of `mariana predict`, with NaN for a line that cannot be read;
        - a list of dicts: the instances of a `/v1/predict` request; a bad one
          raises DataFormatError naming it;
        - a DataFrame (anything with `.to_dict("records")`): its rows as dicts, with
          NaN/None/NA as missing and numpy scalars as Python numbers (an integer
          column with gaps comes as floats: a whole float in a categorical field is
          taken as that integer).
        """
        if isinstance(rows, (str, os.PathLike)) or _is_path_list(rows):
            return self._predict_files(data_paths(rows))
        if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
            schema = self.bundle.schema
            return self._predict_records(frame_records(rows, (*schema.categorical, *filter(None, [schema.hour]))))
        if isinstance(rows, Mapping):
            raise TypeError("rows: a dict is one row; pass a list of them")
        if isinstance(rows, Iterable) and not isinstance(rows, (bytes, np.ndarray)):
            return self._predict_records(list(rows))
        raise TypeError(f"rows: expected a data path, a list of dicts or a DataFrame, got {type(rows).__name__}")

    def _predict_files(self, paths: list[str]) -> np.ndarray:
        """`mariana predict`'s loop (services/cli.py, cmd_predict): NaN where a line is unreadable."""
        from mariana.sparse.parse import describe_bad
        from mariana.trainer.data import BatchStream

        self._check_data(paths, labeled=None)
        stream = BatchStream(paths, self.bundle.encoder, self.bundle.config.data.block_bytes, labeled=None,
                             slots=True)
        parts = []
        for batch, (lines, slots) in stream:
            probs = np.full(lines, np.nan)
            if batch is not None:
                probs[slots] = self.bundle.predict(batch)
            parts.append(probs)
        if stream.stats.rows_bad:
            log.warning("%d malformed rows predicted as nan (%s)", stream.stats.rows_bad,
                        describe_bad(stream.stats.to_dict()["first_bad"]))
        return np.concatenate(parts) if parts else np.empty(0)

    def _predict_records(self, records: list) -> np.ndarray:
        """The HTTP endpoint's path (serving/predictor.py) without HTTP: every row checked by
        the parser's rules, hashed as a file row is, scored by the same bundle."""
        from mariana.sparse.records import parse_records

        out, bad, unknown = [], [], 0
        for start in range(0, len(records), CHUNK_ROWS):
            chunk, wrong, extra = parse_records(self.bundle.schema, records[start:start + CHUNK_ROWS])
            bad += [(start + i, why) for i, why in wrong]
            unknown += extra
            if not bad and chunk.num_rows:
                out.append(self.bundle.predict(self.bundle.encoder.encode_rows(chunk)).astype(np.float64))
        if bad:
            shown = "; ".join(f"rows[{i}]: {why}" for i, why in bad[:SHOWN_BAD])
            more = f" (and {len(bad) - SHOWN_BAD} more)" if len(bad) > SHOWN_BAD else ""
            raise DataFormatError(f"{len(bad)} of {len(records)} rows cannot be scored: {shown}{more}")
        if unknown:
            self._unknown_fields(records, unknown)
        return np.concatenate(out) if out else np.empty(0)

    def _unknown_fields(self, records: list, unknown: int) -> None:
        """Fields the model does not know are ignored, as the endpoint ignores them: said, with
        their names; and when no row has any field the model knows, every pCTR would be that of
        an empty row: DataFormatError (columns numbered 0..39, names in another case). A label or
        ignored column is known but no feature: rows holding only those are refused too."""
        schema = self.bundle.schema
        known = set(schema.columns)
        features = {*schema.numeric, *schema.categorical, *([schema.hour] if schema.hour else [])}
        names = sorted({str(k) for r in records[:1000] for k in r if k not in known})
        if not any(not features.isdisjoint(r) for r in records):
            theirs = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise DataFormatError(f"no row has a field of the model's ({', '.join(self.bundle.schema.fields[:4])}, "
                                  f"...): its rows' fields are {theirs}; name the columns as the model's schema does")
        log.warning("%d values of fields the model does not know were ignored (%s%s)", unknown,
                    ", ".join(names[:6]), ", ..." if len(names) > 6 else "")

    def evaluate(self, data: Data) -> dict:
        """The record of `mariana evaluate --json` on labeled `data` (services/cli.py,
        cmd_evaluate): auc, logloss, calibration, ne, ece, rows, bad_rows, seconds,
        model_dir, model_version, reliability."""
        from mariana.sparse.parse import describe_bad
        from mariana.trainer.strategies.local import evaluate

        paths = data_paths(data)
        self._check_data(paths, labeled=True)
        t0 = time.perf_counter()
        metrics, parse = evaluate(self.bundle, paths)
        if not metrics["count"]:
            bad = (f" ({parse['rows_bad']} malformed: {describe_bad(parse['first_bad'], 3)})"
                   if parse["rows_bad"] else "")
            raise MarianaError(f"no valid rows in {', '.join(os.path.basename(p) for p in paths)}{bad}: "
                               "nothing to evaluate")
        if parse["rows_bad"]:
            log.warning("skipped %d malformed rows (%s)", parse["rows_bad"], describe_bad(parse["first_bad"]))
        return {"auc": metrics["auc"], "logloss": metrics["logloss"], "calibration": metrics["calibration"],
                "ne": metrics["ne"], "ece": metrics["ece"], "rows": metrics["count"], "bad_rows": parse["rows_bad"],
                "seconds": round(time.perf_counter() - t0, 3), "model_dir": self.model_dir,
                "model_version": self.bundle.manifest.get("version"), "reliability": metrics["reliability"]}

    def _check_data(self, paths: list[str], labeled: bool | None) -> None:
        """The CLI's checks before any work (services/cli.py, _model_and_data): files that
        exist and parse as the model's format."""
        from mariana.sparse.parse import Reader
        from mariana.trainer.job import check_inputs

        if not paths:
            raise MarianaError("data names no files")
        check_inputs(paths)
        Reader(paths, self.bundle.schema, labeled=labeled).probe()


def _is_path_list(rows: Any) -> bool:
    return isinstance(rows, (list, tuple)) and bool(rows) and all(isinstance(r, (str, os.PathLike)) for r in rows)


def frame_records(frame: Any, categorical: Sequence[str] = ()) -> list[dict]:
    """A DataFrame's rows as the dicts `parse_records` takes: missing values (NaN, None,
    pandas' NA and NaT) left out, numpy scalars as Python numbers. A `categorical` column
    (an id or hour column) of floats, booleans or timestamps is read as a Parquet file's is
    (`sparse.parse._as_text`, on the whole column: a whole float is its integer, as in an
    integer column with gaps, which is float64; any other float its shortest text; a
    boolean true or false; a timestamp Arrow's text of it, 2024-01-02 03:04:05.000000 for
    pandas' microseconds). Duplicated column names are a DataFormatError (pandas would
    keep the last column of each name and say so once, in a warning).

    >>> import pandas as pd
    >>> frame_records(pd.DataFrame({"I1": [3.0, None], "C1": [7.0, None], "C2": [0.25, 1e20]}), ["C1", "C2"])
    [{'I1': 3.0, 'C1': b'7', 'C2': b'0.25'}, {'C2': b'1e+20'}]
    """
    twice = sorted(c for c, n in Counter(str(c) for c in frame.columns).items() if n > 1)
    if twice:
        raise DataFormatError(f"the DataFrame has {len(twice)} duplicated column name(s): {', '.join(twice[:6])}; "
                              "a row would take one of the columns of each, unsaid: rename or drop the others")
    dtypes, cats = getattr(frame, "dtypes", None), set(categorical)  # no dtypes (a frame-like object): value by value
    kinds = {c: _dtype_kind(dtypes[c]) if dtypes is not None else "" for c in frame.columns}
    typed = {c: _typed_column(frame[c]) for c in frame.columns
             if c in cats and (kinds[c] in ("f", "b", "M") or kinds[c] == "object" and _arrow_typed(frame[c]))}
    typed = {c: texts for c, texts in typed.items() if texts is not None}
    for c in typed:
        if kinds[c] == "f":
            _say_lost_digits(c, frame[c])
    out = []
    for i, rec in enumerate(frame.to_dict("records")):
        row = {}
        for key, value in rec.items():
            value = typed[key][i] if key in typed else _plain(value)
            if value is not None:
                row[key] = value
        out.append(row)
    return out


def _dtype_kind(dtype: Any) -> str:
    """A column dtype's kind ("f", "b", "M", ...), "object" for numpy's object dtype (pandas'
    "string" dtype, kind "O" too, holds text only)."""
    return "object" if str(dtype) == "object" else str(getattr(dtype, "kind", ""))


def _arrow_typed(column: Any) -> bool:
    """Whether an object column holds values a Parquet column types (decimal.Decimal, a date):
    pandas' default reading of a Parquet file's decimal and date32 columns, refused here while
    the file itself was read."""
    import datetime
    import decimal

    first = next((v for v in column if _plain(v) is not None), None)  # (None, NaN, pandas' NA: missing)
    return isinstance(first, decimal.Decimal) or type(first) is datetime.date


def _say_lost_digits(name: Any, column: Any) -> None:
    """Warn when a float id column holds whole values of 2**53 or more: pandas makes an integer
    column with gaps float64, whose 64-bit ids (hashes of users, devices) lose their last digits
    and so hash as ids other than the file's, unsaid (an exploratory run: 3,139 of 5,000 pCTRs)."""
    values = np.asarray(column, dtype=np.float64)
    if np.any(np.abs(values[np.isfinite(values)]) >= 2.0 ** 53):
        log.warning("DataFrame column %s: float ids of 2**53 or more have lost their last digits (pandas makes an "
                    "integer column with gaps float64), and hash as other ids than the file's: read it with "
                    "dtype_backend='numpy_nullable' (or 'pyarrow') to keep them whole", name)


def _typed_column(column: Any) -> list | None:
    """A float, boolean or timestamp column's values as the bytes a Parquet column of them hashes to
    (None: missing); None when Arrow cannot take it (its values then go one by one)."""
    import pyarrow as pa

    from mariana.sparse.parse import _as_text

    try:
        return _as_text(pa.array(column)).to_pylist()
    except (pa.ArrowException, TypeError, ValueError):  # an odd extension dtype: value by value, as any other
        return None


def _plain(value: Any) -> Any:
    """A DataFrame cell as a plain Python value; None for a missing one."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
