"""Job configuration: one dataclass per concern, loaded from defaults, then a
TOML file, then `MARIANA_<SECTION>__<KEY>` environment variables, then
command-line overrides. Unknown keys and wrong types are errors that name
the key.

>>> cfg = load_config(overrides={"model.kind": "dnn", "train.epochs": 2}, env={})
>>> cfg.model.kind, cfg.train.epochs, cfg.hashing.bits
('dnn', 2, 22)
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from mariana.sparse.errors import ConfigError
from mariana.sparse.hashing import HashSpec
from mariana.sparse.schema import FORMATS, Schema, builtin

ENV_PREFIX = "MARIANA_"
AUTO = "auto"  # train.epochs: stop on the validation logloss


@dataclass
class DataConfig:
    format: str = "criteo"
    schema: dict | None = None  # the column layout, for format = "csv"
    block_bytes: int = 4 << 20  # bytes parsed at a time; bounds memory with the table size
    parse_workers: int = 2      # threads that parse + hash blocks while the trainer trains
    parse_threads: bool = False  # also let pyarrow split each block over its own threads

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"data.format: unknown format {self.format!r} (use one of {list(FORMATS)})")
        if self.format == "csv" and not self.schema:
            raise ConfigError("data.format = 'csv' needs a [data.schema] table (columns, label, numeric, categorical)")
        if self.block_bytes < 1024:
            raise ConfigError(f"data.block_bytes must be >= 1024, got {self.block_bytes}")
        if self.parse_workers < 1:
            raise ConfigError(f"data.parse_workers must be >= 1, got {self.parse_workers}")

    def resolve_schema(self) -> Schema:
        if self.format == "csv":
            return Schema.from_dict({"name": "csv", **(self.schema or {})})
        return builtin(self.format)


@dataclass
class ModelConfig:
    kind: str = "lr"                   # lr | dnn
    # dnn defaults: DLRM's pairwise dots of 16-wide embeddings, chosen on both generators and three
    # real logs (issue 15); they need AdaGrad's initial accumulator near 0 to leave the saddle at a
    # small init (with 0.1 the deep part stays at its init and the DNN ends level with LR).
    interaction: str = "dot"           # dnn: "dot" (DLRM), "proj" (dots of K field mixtures), "fm" (DeepFM)
    slots: int = 16                    # dnn, interaction "proj": K
    embed_dim: int = 16                # dnn: embedding width per field (8: -0.01..0.02 AUC on the generators)
    hidden: list[int] = field(default_factory=lambda: [64, 32])  # dnn: MLP widths
    init_scale: float = 0.1            # dnn: embeddings start uniform in [-s, s)
    init_bias: float | str = AUTO      # the bias's first value: a logit, or "auto": the log-odds of the
                                       # click rate of the training data's first block (set before training)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("lr", "dnn"):
            raise ConfigError(f"model.kind: unknown model {self.kind!r} (use 'lr' or 'dnn')")
        if self.interaction not in ("fm", "dot", "proj"):
            raise ConfigError(f"model.interaction: unknown {self.interaction!r} (use 'fm', 'dot' or 'proj')")
        if self.embed_dim < 1 or any(h < 1 for h in self.hidden):
            raise ConfigError("model.embed_dim and model.hidden must be positive")
        if self.slots < 2:
            raise ConfigError(f"model.slots must be >= 2 (pairs of slots are dotted), got {self.slots}")
        if self.init_scale < 0:
            raise ConfigError(f"model.init_scale must be >= 0, got {self.init_scale}")
        if isinstance(self.init_bias, str) and self.init_bias != AUTO:
            raise ConfigError(f"model.init_bias must be a logit or 'auto', got {self.init_bias!r}")
        if not isinstance(self.init_bias, str) and not math.isfinite(self.init_bias):
            raise ConfigError(f"model.init_bias must be finite, got {self.init_bias}")


@dataclass
class OptimConfig:
    # The per-id linear weights: FTRL-Proximal with L1/L2 by default, chosen on three real
    # logs and two generators (docs/benchmarks.md, "Defaults"); adagrad is the other choice.
    linear: str = "ftrl"               # ftrl | adagrad
    lr: float = 0.1                    # adagrad on linear weights
    # AdaGrad's starting sum of squared gradients (embeddings, the MLP, and an adagrad linear
    # part). Near 0, as torch's Adagrad: at 0.1 the DNN's deep part, whose gradients are
    # 1e-3..1e-4, took steps of about 3 lr g and stayed where it started (docs/benchmarks.md).
    initial_accumulator: float = 1e-8
    ftrl_alpha: float = 0.2
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.5
    ftrl_l2: float = 1.0
    embed_lr: float = 0.05             # adagrad on embedding rows (0.1: -0.01..0.02 AUC on the generators)
    # adagrad on dense (MLP) parameters. 0.01 gains 0.002-0.0035 mean AUC over 8 seeds in local
    # mode and showed no gain with two asynchronous cluster workers, so 0.005 stays; 0.02: up
    # to -0.01 AUC (docs/benchmarks.md).
    dense_lr: float = 0.005

    def __post_init__(self) -> None:
        if self.linear not in ("adagrad", "ftrl"):
            raise ConfigError(f"optim.linear: unknown optimizer {self.linear!r} (use 'adagrad' or 'ftrl')")
        for name in ("ftrl_alpha", "initial_accumulator"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"optim.{name} must be > 0, got {getattr(self, name)}")
        for name in ("lr", "embed_lr", "dense_lr"):  # 0 freezes that part (a warm start may tune only some)
            if not getattr(self, name) >= 0:
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("ftrl_beta", "ftrl_l1", "ftrl_l2"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class TrainConfig:
    """`epochs = "auto"`: train until the validation logloss has not improved for
    `patience` epochs (at most `max_epochs`), then keep the best epoch's weights.
    Validation rows come from `--valid-data` or, with `valid_fraction` F > 0, the last
    F of the training files' data lines in file order (time order for a log): those
    rows are held out of training."""

    epochs: int | str = 1              # passes over the data, or "auto" (early stopping)
    batch_size: int | str = AUTO       # rows per step, or "auto": about rows/200, a power of 2 in 256..4096
    prefetch: int = 2                  # encoded blocks queued ahead of the trainer
    threads: int = 0                   # torch intra-op threads; 0 = auto (lr: 1, dnn: every core)
    valid_fraction: float = 0.0        # hold out the last F of the training rows for validation
    patience: int = 1                  # epochs = "auto": stop after this many epochs without a better valid logloss
    max_epochs: int = 10               # epochs = "auto": the most epochs it may run

    def __post_init__(self) -> None:
        if isinstance(self.epochs, str) and self.epochs != AUTO:
            raise ConfigError(f"train.epochs must be a number of passes or 'auto', got {self.epochs!r}")
        if isinstance(self.batch_size, str) and self.batch_size != AUTO:
            raise ConfigError(f"train.batch_size must be a number of rows or 'auto', got {self.batch_size!r}")
        if (self.batch_size != AUTO and self.batch_size < 1) or self.prefetch < 1 or self.threads < 0 or (
                self.epochs != AUTO and self.epochs < 1):
            raise ConfigError("train.epochs, train.batch_size and train.prefetch must be >= 1, train.threads >= 0")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ConfigError(f"train.valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.patience < 1 or self.max_epochs < 1:
            raise ConfigError(f"train.patience and train.max_epochs must be >= 1, got {self.patience} and "
                              f"{self.max_epochs}")

    @property
    def auto(self) -> bool:
        return self.epochs == AUTO

    @staticmethod
    def auto_batch_size(rows: int) -> int:
        """About 200 steps an epoch, as a power of 2 between 256 and 4096: small logs get the
        updates they need to converge, large ones the throughput of big batches.

        >>> [TrainConfig.auto_batch_size(n) for n in (2_000, 115_000, 200_000, 1_000_000)]
        [256, 512, 1024, 4096]
        """
        return 2 ** min(12, max(8, round(math.log2(max(rows, 1) / 200))))

    @property
    def epoch_limit(self) -> int:
        """The most epochs this run may take."""
        return self.max_epochs if self.auto else int(self.epochs)


@dataclass
class ImagesConfig:
    """Image features of ad creatives (issue 6): off unless `creatives` names a dir."""

    creatives: str = ""    # `gen ads-with-images` OUT dir or its creatives/ dir; "" = no image features
    featurizer: str = ""   # frozen featurizer dir; "" = CREATIVES/featurizer, trained there on first use
    mnist: str = ""        # MNIST dir that first-use training reads; "" = the one the creatives came from
    field: str = "C26"     # the categorical column holding a row's creative id
    tower: int = 32        # dnn: hidden width of the image tower (features -> embedding)

    def __post_init__(self) -> None:
        if self.tower < 1:
            raise ConfigError(f"images.tower must be >= 1, got {self.tower}")


# What a diverged training run's error tells the user to change.
LOWER_RATES = "lower the learning rates (optim.lr, optim.embed_lr, optim.dense_lr)"

# The keys of a job config that name files or directories ("" = not set).
PATH_KEYS = ("images.creatives", "images.featurizer", "images.mnist")


@dataclass
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    hashing: HashSpec = field(default_factory=HashSpec)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def paths(self) -> dict[str, str]:
        """The set path keys and their values: {"images.creatives": "ads/", ...}."""
        out = {}
        for key in PATH_KEYS:
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if value:
                out[key] = value
        return out

    def resolve_paths(self, base: str | None = None) -> "JobConfig":
        """Make every path key absolute against `base` (default: the working directory),
        in place: a job submitted elsewhere (a coordinator) must not read them relative
        to its own directory. Returns self.

        >>> JobConfig(images=ImagesConfig(creatives="ads")).resolve_paths("/data").images.creatives
        '/data/ads'
        """
        for key, value in self.paths().items():
            section, name = key.split(".")
            setattr(getattr(self, section), name, os.path.abspath(os.path.join(base or os.getcwd(), value)))
        return self


# ---- strict loading -----------------------------------------------------------

def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key {_dotted(where, unknown[0])!r} "
                          f"(known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(hints[k], v, _dotted(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from None


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(args[0], value, key)
        for arg in args:  # the first type the value is (int | str: 3 stays 3, "auto" a string)
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                pass
        whats = " or ".join(_SCALARS[a][1] if a in _SCALARS else a.__name__ for a in args)
        raise ConfigError(f"{key}: expected {whats}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if tp in _SCALARS:
        accepted, what = _SCALARS[tp]
        # bool is an int subclass in Python, but `epochs = true` is a mistake
        if not isinstance(value, accepted) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        return tp(value)
    return value


_SCALARS = {bool: (bool, "true or false"), int: (int, "an integer"),
            float: ((int, float), "a number"), str: (str, "a string")}


def _parse_scalar(raw: str) -> Any:
    """A TOML value if it parses as one (3, 0.5, true, [1, 2], "x"), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a table")
    node[parts[-1]] = value


def _merge(base: dict, top: Mapping) -> dict:
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict) and k != "schema":
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def read_toml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def env_overrides(env: Mapping[str, str], sections: set[str] | None = None) -> dict:
    """`MARIANA_TRAIN__EPOCHS=3` -> {"train": {"epochs": 3}} (double underscore nests).

    With `sections`, only variables of those top-level sections count: the
    job config and the cluster config share the prefix, not their sections.
    """
    tree: dict = {}
    for name, raw in env.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            if sections is None or dotted.split(".", 1)[0] in sections:
                _set_dotted(tree, dotted, _parse_scalar(raw))
    return tree


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, cls: type = JobConfig) -> Any:
    """Defaults <- TOML file <- environment <- overrides ({"train.epochs": 2, ...})."""
    tree: dict = {}
    if path:
        _merge(tree, read_toml(path))
    sections = {f.name for f in dataclasses.fields(cls)}
    _merge(tree, env_overrides(os.environ if env is None else env, sections))
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    return from_dict(cls, tree)


def parse_set_option(item: str) -> tuple[str, Any]:
    """'train.epochs=3' -> ('train.epochs', 3), for --set flags."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    return key.strip(), _parse_scalar(raw.strip())
