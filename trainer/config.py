"""Job configuration: one dataclass per concern, loaded from defaults, then a
TOML file, then `MARIANA_<SECTION>__<KEY>` environment variables, then
command-line overrides (sparse/settings.py). Unknown keys and wrong types are
errors that name the key. `JobConfig` is a CTR job's; `DenseJobConfig` a dense
model's (trainer/dense.py trains it).

>>> cfg = load_config(overrides={"model.kind": "dnn", "train.epochs": 2}, env={})
>>> cfg.model.kind, cfg.train.epochs, cfg.hashing.bits
('dnn', 2, 22)
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from mariana.sparse.errors import ConfigError
from mariana.sparse.hashing import HashSpec
from mariana.sparse.schema import FORMATS, Schema, builtin
from mariana.sparse.settings import MAX_THREADS, check_seed, load_settings

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
        if self.format != "csv" and self.schema:  # it was read as the built-in layout, the table ignored
            raise ConfigError(f"data.schema is for data.format = 'csv', but data.format is {self.format!r} (its "
                              "layout is built in): set format = \"csv\" to read the files with the schema, or drop it")
        if not 1024 <= self.block_bytes <= 1 << 30:
            raise ConfigError(f"data.block_bytes must be in [1024, 2^30], got {self.block_bytes}")
        if not 1 <= self.parse_workers <= MAX_THREADS:
            raise ConfigError(f"data.parse_workers must be in 1..{MAX_THREADS}, got {self.parse_workers}")

    def resolve_schema(self) -> Schema:
        if self.format == "csv":
            return Schema.from_dict({"name": "csv", **(self.schema or {})})
        return builtin(self.format)


MAX_WIDTH = 1 << 14  # embedding and layer widths
MAX_LOGIT = 69.0  # |model.init_bias|: sigmoid(-69) is 1e-30


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
        if self.embed_dim > MAX_WIDTH or any(h > MAX_WIDTH for h in self.hidden) or self.slots > MAX_WIDTH:
            raise ConfigError(f"model.embed_dim, model.hidden and model.slots must be at most {MAX_WIDTH:,} "
                              f"(an embedding table is 2^hashing.bits rows of embed_dim floats), got "
                              f"{self.embed_dim}, {self.hidden} and {self.slots}")
        if self.slots < 2:
            raise ConfigError(f"model.slots must be >= 2 (pairs of slots are dotted), got {self.slots}")
        if self.init_scale < 0:
            raise ConfigError(f"model.init_scale must be >= 0, got {self.init_scale}")
        if isinstance(self.init_bias, str) and self.init_bias != AUTO:
            raise ConfigError(f"model.init_bias must be a logit or 'auto', got {self.init_bias!r}")
        if not isinstance(self.init_bias, str) and not abs(self.init_bias) <= MAX_LOGIT:  # 1e300 diverged,
            raise ConfigError(f"model.init_bias must be a logit in [-{MAX_LOGIT:g}, {MAX_LOGIT:g}] (a pCTR "  # "lower
                              f"of 1e-30 to 1 - 1e-30), got {self.init_bias}")  # the learning rates"
        check_seed("model.seed", self.seed)


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
        for name in ("ftrl_alpha", "initial_accumulator", "lr", "embed_lr", "dense_lr", "ftrl_beta", "ftrl_l1",
                     "ftrl_l2"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"optim.{name} must be a finite number, got {getattr(self, name)}")
        for name in ("lr", "embed_lr", "dense_lr"):  # 0 freezes that part (a warm start may tune only some)
            if not getattr(self, name) >= 0:
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("ftrl_beta", "ftrl_l1", "ftrl_l2"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")


MAX_BATCH = 1 << 24  # rows per step: 16.8M rows x 39 ids is already ~5 GB of int64 ids
MAX_COUNT = 1_000_000  # epochs, patience, threads, ...


@dataclass
class TrainConfig:
    """`epochs = "auto"`: train until the validation logloss has not improved for
    `patience` epochs (at most `max_epochs`), then keep the best epoch's weights.
    Validation rows come from `--valid-data` or, with `valid_fraction` F > 0, the last
    F of the training files' data lines in file order (time order for a log): those
    rows are held out of training."""

    epochs: int | str = 1              # passes over the data, or "auto" (early stopping)
    batch_size: int | str = AUTO       # rows per step, or "auto": about rows/200, a power of 2 in 256..4096
                                       # (a DNN cluster job of W workers: rows/W's; trainer.job.resolve_auto)
    prefetch: int = 2                  # encoded blocks queued ahead of the trainer
    threads: int = 0                   # the DNN's torch intra-op threads; 0 = every CPU it may use
                                       # (affinity, cgroup quota: sparse/host.py; LR's step: numpy, 1)
    valid_fraction: float = 0.0        # hold out the last F of the training rows for validation
    patience: int = 1                  # epochs = "auto": stop after this many epochs without a better valid logloss
    max_epochs: int = 10               # epochs = "auto": the most epochs it may run
    ramp_steps: int | str = AUTO       # a cluster job of W >= 2 workers: at most 1 + isqrt(n / ramp_steps) steps out
                                       # at once while that is under W, n the job's steps done; 0: off; "auto":
                                       # 12 for a model with dense layers, 0 for LR (services/ledger.py: lease_cap)

    def __post_init__(self) -> None:
        if isinstance(self.epochs, str) and self.epochs != AUTO:
            raise ConfigError(f"train.epochs must be a number of passes or 'auto', got {self.epochs!r}")
        if isinstance(self.batch_size, str) and self.batch_size != AUTO:
            raise ConfigError(f"train.batch_size must be a number of rows or 'auto', got {self.batch_size!r}")
        if isinstance(self.ramp_steps, str) and self.ramp_steps != AUTO or (
                isinstance(self.ramp_steps, int) and self.ramp_steps < 0):
            raise ConfigError(f"train.ramp_steps must be a number of steps >= 0 or 'auto', got {self.ramp_steps!r}")
        if isinstance(self.batch_size, int) and self.batch_size > MAX_BATCH:
            raise ConfigError(f"train.batch_size must be at most {MAX_BATCH:,} rows, got {self.batch_size:,}")
        for key, low in (("epochs", 1), ("batch_size", 1), ("prefetch", 1), ("threads", 0)):
            value = getattr(self, key)
            if value != AUTO and value < low:  # it said all four keys, not which one
                raise ConfigError(f"train.{key} must be >= {low}, got {value}")
        if self.threads > MAX_THREADS:  # a worker took 2,000 threads, and kept them after the job
            raise ConfigError(f"train.threads must be at most {MAX_THREADS} (0: every CPU), got {self.threads:,}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ConfigError(f"train.valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.patience < 1 or self.max_epochs < 1:
            raise ConfigError(f"train.patience and train.max_epochs must be >= 1, got {self.patience} and "
                              f"{self.max_epochs}")
        for key in ("epochs", "max_epochs", "patience", "prefetch", "threads", "ramp_steps"):
            value = getattr(self, key)
            if isinstance(value, int) and value > MAX_COUNT:  # past any real run; C ints overflow beyond
                raise ConfigError(f"train.{key} must be at most {MAX_COUNT:,}, got {value:,}")

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
        if not 1 <= self.tower <= MAX_WIDTH:
            raise ConfigError(f"images.tower must be in 1..{MAX_WIDTH:,}, got {self.tower}")


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


# ---- dense jobs (the speech DNN, the image CNN) ----------------------------------

DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")
BACKENDS = ("gloo", "nccl", "auto")
LOSSES = ("cross_entropy", "bce", "mse")     # trainer/dense.py's loss_fn makes them
OPTIMIZERS = ("sgd", "adam", "adagrad")      # trainer/dense.py's make_optimizer makes them


@dataclass
class DenseConfig:
    """How a dense model trains: where, in how many processes, with which loss and optimizer.
    "auto": the device is CUDA when there is one, the backend nccl on CUDA and gloo on
    the CPU (trainer/dense.py resolves them).

    >>> DenseConfig(device="cuda:1", optimizer="sgd", momentum=0.9).backend
    'auto'
    >>> DenseConfig(device="cpu", backend="nccl")
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.ConfigError: dense.backend = 'nccl' needs a CUDA device, not dense.device = 'cpu'
    """

    device: str = "auto"          # cpu | cuda | cuda:N | auto
    world_size: int = 1           # processes of synchronous data parallel training; 1: one process
    backend: str = "auto"         # torch.distributed's: gloo | nccl | auto
    loss: str = "cross_entropy"   # cross_entropy (class ids) | bce (0/1 targets, on logits) | mse
    optimizer: str = "adam"       # sgd | adam | adagrad
    lr: float = 1e-3
    momentum: float = 0.0         # sgd only
    weight_decay: float = 0.0     # L2 on every parameter, as torch.optim's weight_decay
    batch_size: int = 64          # rows per step of one process
    epochs: int = 1
    seed: int = 0
    # how its errors name a setting: "dense." + key in a config file; a command that makes one
    # from its own flags (train speech) gives "--", and its errors name the flags
    named: dataclasses.InitVar[str] = "dense."

    def __post_init__(self, named: str) -> None:
        if not DEVICE_RE.match(self.device):
            raise ConfigError(f"{named}device: unknown device {self.device!r} (use 'cpu', 'cuda', 'cuda:N' or 'auto')")
        for key, known in (("backend", BACKENDS), ("loss", LOSSES), ("optimizer", OPTIMIZERS)):
            if getattr(self, key) not in known:
                raise ConfigError(f"{named}{key}: unknown {key} {getattr(self, key)!r} (use one of {list(known)})")
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError(f"{named}backend = 'nccl' needs a CUDA device, not {named}device = 'cpu'")
        for key in ("world_size", "batch_size", "epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{named}{key} must be >= 1, got {getattr(self, key)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"{named}lr must be a positive number, got {self.lr}")
        for key in ("momentum", "weight_decay"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise ConfigError(f"{named}{key} must be >= 0, got {getattr(self, key)}")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError(f"{named}momentum is for optimizer 'sgd', not {self.optimizer!r}")
        check_seed(f"{named}seed", self.seed)


@dataclass
class DenseJobConfig:
    """A dense job's config file: its [dense] table, loaded like every config
    (sparse.settings: TOML <- `MARIANA_DENSE__LR=...` <- overrides).

    >>> cfg = load_settings(DenseJobConfig, env={"MARIANA_DENSE__LR": "0.01"}, overrides={"dense.device": "cpu"})
    >>> cfg.dense.lr, cfg.dense.device, cfg.dense.optimizer
    (0.01, 'cpu', 'adam')
    """

    dense: DenseConfig = field(default_factory=DenseConfig)


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, overrides_from: str = "--set") -> JobConfig:
    """A JobConfig: defaults <- TOML file <- environment <- overrides ({"train.epochs": 2, ...})."""
    return load_settings(JobConfig, path, env, overrides, overrides_from)
