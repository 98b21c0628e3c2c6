"""Train the image CNN (trainer/models/image_cnn.py) on MNIST and export it as
a frozen featurizer (featurizer/image.py reads it). Read top to bottom:

    split the 10k images 8k/2k (fixed permutation, featurizer.image.split_indices)
    for epoch: train_dense over the 8k in a random order: cross-entropy, Adam step;
               progress ~1/s (trainer/dense.py, on the CPU)
               evaluate_dense: accuracy on the 2k held out (logged)
    export: the stages up to "embed" as frozen ops, weights in safetensors,
            the output standardisation measured on the 8k
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

from mariana.featurizer.image import (FORMAT, MANIFEST, SPLIT_SEED, TEST_IMAGES, WEIGHTS, ImageFeaturizer, ImageSet,
                              pixel_stats, split_indices, to_input)
from mariana.sparse.errors import MarianaError
from mariana.sparse.files import file_sha256, loads_json
from mariana.trainer.checkpoint import publish_dir
from mariana.trainer.dense import DenseProgress, evaluate_dense, loss_fn, tensor_batches, train_dense
from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig, frozen_ops
from mariana.trainer.paths import check_can_create_in, check_path_name

log = logging.getLogger(__name__)


@dataclass
class FeaturizerTrainConfig:
    epochs: int = 5
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0
    test_images: int = TEST_IMAGES
    train_limit: int = 0            # use only the first N training images (0: all); for quick tests
    cnn: ImageCNNConfig = field(default_factory=ImageCNNConfig)


@dataclass
class TrainProgress:
    epoch: int
    epochs: int
    images: int          # seen in this epoch
    loss: float          # mean cross-entropy since the last report
    images_per_s: float


def progress_logger(every: float = 0.0) -> Callable[[TrainProgress], None]:
    """A progress callback that logs a line at most every `every` seconds (epoch ends log
    themselves, with the held-out accuracy)."""
    last = [0.0]

    def report(p: TrainProgress) -> None:
        if time.perf_counter() - last[0] >= every:
            last[0] = time.perf_counter()
            log.info("featurizer epoch %d/%d: %s images, loss %.4f, %s images/s", p.epoch, p.epochs,
                     f"{p.images:,}", p.loss, f"{p.images_per_s:,.0f}")
    return report


def train_featurizer(data: ImageSet, cfg: FeaturizerTrainConfig = FeaturizerTrainConfig(),
                     progress: Callable[[TrainProgress], None] | None = None,
                     report_every: float = 1.0) -> tuple[ImageCNN, dict]:
    """Train on the train split; returns (model in eval mode, report with the test accuracy)."""
    train_idx, test_idx = split_indices(len(data.images), cfg.test_images)
    if cfg.train_limit:
        train_idx = train_idx[:cfg.train_limit]
    mean, std = pixel_stats(data.images[train_idx])
    x_train = to_input(data.images[train_idx], mean, std)                    # (N, 1, 28, 28)
    y_train = torch.from_numpy(data.labels[train_idx].astype(np.int64))
    torch.manual_seed(cfg.seed)
    model = ImageCNN(cfg.cnn)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    x_test = to_input(data.images[test_idx], mean, std)
    y_test = torch.from_numpy(data.labels[test_idx].astype(np.int64))
    loss, cpu = loss_fn("cross_entropy"), torch.device("cpu")  # the CPU: the same featurizer on every machine
    t0 = time.perf_counter()
    log.info("featurizer: training a CNN on %d images (%d held out), %d epochs", len(train_idx), len(test_idx),
             cfg.epochs)
    for epoch in range(1, cfg.epochs + 1):
        t_epoch = time.perf_counter()
        train_dense(model, tensor_batches(x_train, y_train, cfg.batch_size, gen), loss, opt, cpu,
                    _epoch_progress(progress, epoch, cfg.epochs), report_every)
        accuracy = evaluate_dense(model, tensor_batches(x_test, y_test, 512), loss, cpu).accuracy
        log.info("featurizer epoch %d/%d done: held-out accuracy %.4f, %.1fs", epoch, cfg.epochs, accuracy,
                 time.perf_counter() - t_epoch)
    report = {"test_accuracy": round(accuracy, 4), "train_images": len(train_idx), "test_images": len(test_idx),
              "epochs": cfg.epochs, "batch_size": cfg.batch_size, "lr": cfg.lr, "seed": cfg.seed,
              "split_seed": SPLIT_SEED, "train_seconds": round(time.perf_counter() - t0, 2),
              "pixel_mean": mean, "pixel_std": std, "train_index": train_idx}
    return model, report


def _epoch_progress(progress: Callable[[TrainProgress], None] | None, epoch: int,
                    epochs: int) -> Callable[[DenseProgress], None] | None:
    if progress is None:
        return None
    return lambda p: progress(TrainProgress(epoch, epochs, p.rows, p.loss, p.rows_per_s))


def export_featurizer(model: ImageCNN, report: dict, data: ImageSet, out_dir: str | Path) -> Path:
    """Write the frozen featurizer: the ops up to "embed" (+ the head, for `classify`),
    their weights, and the output standardisation measured on the training images."""
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest = {"dim": model.cfg.embed_dim, "cnn": model.cfg.to_dict(),
                "ops": frozen_ops(model), "head_ops": frozen_ops(model, "head", "head"),
                "input": {"size": model.cfg.size, "dtype": "uint8", "layout": "(N, size, size)",
                          "pixel_mean": report["pixel_mean"], "pixel_std": report["pixel_std"],
                          "normalise": "(pixels / 255 - pixel_mean) / pixel_std"},
                "output": {"stage": "embed", "standardise": "(features - output.mean) / output.std, "
                                                            "measured on the train split"},
                "accuracy": report["test_accuracy"], "source": data.source,
                "train": {k: v for k, v in report.items() if k not in ("train_index", "source")}}
    raw = ImageFeaturizer(manifest, weights).embed(data.images[report["train_index"]])  # (N, d) unstandardised
    std = raw.std(0)
    weights["output.mean"] = torch.from_numpy(raw.mean(0))
    weights["output.std"] = torch.from_numpy(np.where(std > 1e-6, std, 1.0).astype(np.float32))  # dead units: 1
    return write_featurizer(out_dir, manifest, weights)


def train_and_export(data: ImageSet, out_dir: str | Path, cfg: FeaturizerTrainConfig = FeaturizerTrainConfig(),
                     progress: Callable[[TrainProgress], None] | None = None, name: str = "the image set") -> dict:
    """Train, export, and return the report (with the featurizer dir); `name` says which
    images an error is about ("--data DIR")."""
    check_featurizer_out(out_dir)  # before the training, not after it
    check_featurizer_data(data, cfg, name)
    model, report = train_featurizer(data, cfg, progress)
    out = export_featurizer(model, report, data, out_dir)
    return {"featurizer": str(out), **{k: v for k, v in report.items() if k != "train_index"}}


def check_featurizer_data(data: ImageSet, cfg: FeaturizerTrainConfig, name: str) -> None:
    """MarianaError, before any training, for images the featurizer cannot train on (else a
    traceback deep in torch or the split): of the model's side, and more of them than the
    `cfg.test_images` it holds out."""
    side, (n, h, w) = cfg.cnn.size, data.images.shape
    if (h, w) != (side, side):
        raise MarianaError(f"{name}: {h}x{w} images; featurizer train takes {side}x{side}: `mariana train image` "
                           "trains other sides (--preset wide: 64x64)")
    if n <= cfg.test_images:
        raise MarianaError(f"{name}: {n:,} images; featurizer train holds out {cfg.test_images:,} and trains on the "
                           "rest, so it needs more: `mariana train image --test-images N` takes smaller sets")


def write_featurizer(out_dir: str | os.PathLike, manifest: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write DIR/weights.safetensors and DIR/manifest.json, replacing DIR: built in a temp dir
    beside it, then published as model versions are (trainer.checkpoint.publish_dir: fsynced,
    the umask's modes, two renames a moment apart, the old DIR aside and the new one in), so a
    reader finds the old featurizer or the new one, never part of one. When another writer
    puts its DIR in place first, that one stays and this one is dropped. A DIR holding anything
    but a featurizer is refused (check_featurizer_out): the replacement would delete it."""
    out = Path(out_dir)
    bad = sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:  # it replaced a good featurizer with one that loads nowhere (an image run at --lr 1e6)
        raise MarianaError(f"{out}: not written: the trained weights hold NaN or infinite values (in "
                           f"{', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}): training diverged; lower --lr"
                           f"{'; the featurizer there is kept' if (out / MANIFEST).exists() else ''}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-featurizer-", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS))
        body = {**manifest, "format": FORMAT, "weights_sha256": file_sha256(tmp / WEIGHTS), "torch": torch.__version__,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True))
        check_featurizer_out(out)  # again: the dir may have been filled while the featurizer trained
        if not publish_dir(tmp, out, replace=True):
            log.info("%s: another writer put a featurizer there first; keeping it", out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_featurizer_out(path: str | os.PathLike, what: str = "--out") -> None:
    """MarianaError unless `path` may take a featurizer: new, an empty directory, or a
    featurizer directory (its manifest and weights, nothing else), which the new one replaces
    whole. Anything else there would be deleted with it.

    The featurizer is built beside it, so its parent must be a directory where one can be
    made (`check_can_create_in`), or become one: found before the training, not after it.

    >>> import tempfile
    >>> check_featurizer_out(tempfile.gettempdir() + "/no/such/dir")   # new: written there
    >>> check_featurizer_out("")
    Traceback (most recent call last):
    mariana.sparse.errors.MarianaError: --out: empty; name the featurizer directory to write
    """
    p = os.fspath(path)
    if not p:
        raise MarianaError(f"{what}: empty; name the featurizer directory to write")
    check_path_name(p, what)
    check_can_create_in(os.path.dirname(os.path.abspath(p)), what, shown=p)
    if not os.path.lexists(p):
        return
    if not os.path.exists(p):
        check_can_create_in(p, what)  # a dangling symbolic link: named as one
    if not os.path.isdir(p):
        raise MarianaError(f"{what} {p}: exists and is not a directory; name the featurizer directory to write")
    names = sorted(os.listdir(p))
    other = [n for n in names if n not in (MANIFEST, WEIGHTS)]
    if not names or (not other and _is_featurizer(Path(p))):
        return
    if _is_featurizer(Path(p)):
        raise MarianaError(f"{what} {p}: a featurizer with {len(other)} other files beside it ({_listed(other)}), "
                           "which replacing it would delete: move them, or name another directory")
    raise MarianaError(f"{what} {p}: a directory that holds no featurizer ({len(names)} files: {_listed(names)}): "
                       f"{what} takes a featurizer directory (replaced), or a new or empty one")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _is_featurizer(d: Path) -> bool:
    """`d` holds a featurizer's manifest (its format named) and a weights file."""
    try:
        manifest = loads_json((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT and (d / WEIGHTS).is_file()
