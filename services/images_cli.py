"""The image commands of `mariana` (issue 6), registered by services/cli.py
(numpy and torch load inside the commands: `mariana --help` stays light):

    mariana gen ads-with-images --rows N --seed S --images MNIST_DIR --out DIR
                                [--test-rows N] [--creatives C] [--model-seed M]
    mariana gen images --rows N [--seed S] [--size 64] --out DIR   (drawn shapes, MNIST-named IDX files)
    mariana featurizer train --data MNIST_DIR --out DIR [--epochs E] [--json]
    mariana featurize --model FEATURIZER_DIR --images FILE --out FILE.npy
    mariana featurize-creatives --images CREATIVES_DIR [--featurizer DIR] [--redis-url URL | --config FILE]

FILE is an IDX file (gz or plain) or a .npy of uint8 (N, 28, 28); the output
is a .npy of float32 (N, d). Bad input is one line and exit code 2 (cli.main).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from mariana.services.cli_parser import Parser
from mariana.sparse.errors import MarianaError
from mariana.sparse.settings import count_arg, seed_arg


def cmd_gen_images(args: argparse.Namespace) -> int:
    from mariana.featurizer.shapes import generate_images

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise MarianaError(f"{args.out}: exists and is not a directory; --out names the directory to write")
    if args.quality is not None and args.format != "jpeg":  # it was taken and ignored
        raise MarianaError(f"--quality is for --format jpeg, not {args.format}")
    try:
        result = generate_images(args.out, args.rows, args.seed, args.size, args.format,
                                 **({} if args.quality is None else {"quality": args.quality}))
    except ValueError as e:
        raise MarianaError(str(e)) from None
    print(json.dumps(result))
    return 0


def cmd_gen_ads(args: argparse.Namespace) -> int:
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images

    if args.rows < 1 or (args.test_rows is not None and args.test_rows < 0):
        raise MarianaError("--rows must be >= 1 and --test-rows >= 0")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise MarianaError(f"{args.out}: exists and is not a directory; --out names the directory to write")
    _need_dir(args.images, "--images")
    spec = AdsSpec(rows=args.rows, seed=args.seed, test_rows=args.test_rows, creatives=args.creatives,
                   model_seed=args.model_seed)
    try:
        result = generate_ads_with_images(args.out, spec, args.images)
    except ValueError as e:
        raise MarianaError(str(e)) from None
    print(json.dumps(result))
    return 0


def cmd_featurizer_train(args: argparse.Namespace) -> int:
    from mariana.featurizer.image import load_mnist
    from mariana.trainer.featurizer_train import (FeaturizerTrainConfig, check_featurizer_out, progress_logger,
                                                  train_and_export)

    _need_dir(args.data, "--data")
    if args.epochs < 1:
        raise MarianaError("--epochs must be >= 1")
    check_featurizer_out(args.out)
    report = train_and_export(load_mnist(args.data), args.out, FeaturizerTrainConfig(epochs=args.epochs,
                              seed=args.seed), progress_logger(), name=f"--data {args.data}")
    print(json.dumps(report) if args.json else
          f"featurizer written to {report['featurizer']}: test accuracy {report['test_accuracy']:.4f} "
          f"on {report['test_images']} held-out images ({report['train_seconds']} s)")
    return 0


def cmd_featurize(args: argparse.Namespace) -> int:
    import numpy as np

    from mariana.featurizer.image import ImageFeaturizer

    if not args.out.endswith(".npy"):
        raise MarianaError(f"--out {args.out}: the output is a .npy file")
    _check_out_file(args.out)
    featurizer = ImageFeaturizer.load(args.model)
    images = read_images(args.images, featurizer.size)
    t0 = time.perf_counter()
    features = featurizer.embed(images, batch_size=args.batch_size)
    seconds = time.perf_counter() - t0
    np.save(args.out, features, allow_pickle=False)
    print(json.dumps({"images": len(images), "dim": featurizer.dim, "out": os.path.abspath(args.out),
                      "seconds": round(seconds, 3), "images_per_s": round(len(images) / max(seconds, 1e-9))}))
    return 0


def cmd_featurize_creatives(args: argparse.Namespace) -> int:
    """The featurizer stage's batch job on its own: cache the features of every creative
    of a dir that Redis lacks (new uploads, say), for cluster jobs and model servers."""
    import asyncio
    from collections import Counter

    from mariana.services import launcher
    from mariana.services.creative_cache import featurize_creatives
    from mariana.services.runtime.config import load_cluster_config
    from mariana.services.runtime.redis_url import check_redis_url
    from mariana.services.sample_cache import SampleCache
    from mariana.trainer.config import ImagesConfig

    _need_dir(args.images, "--images")
    cfg = load_cluster_config(args.config)
    if args.redis_url:
        check_redis_url(args.redis_url, "--redis-url")
        cfg.redis.url = args.redis_url
    else:
        running = launcher.cluster_info(cfg.cluster.path)
        if running is None:
            raise MarianaError("no --redis-url given and no cluster is up (`mariana up`) to take its Redis from")
        cfg.redis.url = load_cluster_config(running["config"], env={}).redis.url  # its resolved port
    images = ImagesConfig(creatives=os.path.abspath(args.images), featurizer=args.featurizer or "")

    async def run() -> dict:
        cache = SampleCache(cfg, Counter())
        try:
            return await featurize_creatives(cache, images, Counter())
        finally:
            await cache.close()

    info = asyncio.run(run())
    info.pop("ids")
    print(json.dumps(info))
    return 0


IMAGES_TAKEN = "featurize --images takes an IDX file (gz or plain) or a .npy of uint8 (N, {size}, {size}) images"


def read_images(path: str, size: int = 28):
    """uint8 (N, size, size) from an IDX file or a .npy (never pickled objects)."""
    from mariana.featurizer.idx import BadImage, NotIdxError, load_npy, read_idx
    from mariana.featurizer.image import check_images

    if os.path.isdir(path):
        raise MarianaError(f"{path}: a directory; {IMAGES_TAKEN.format(size=size)} (the images of a creatives "
                           "dir: 'mariana featurize-creatives')")
    if not os.path.isfile(path):  # /dev/zero was "no such file"
        raise FileNotFoundError(2, "not a regular file" if os.path.exists(path) else "no such file", path)
    if path.endswith(".npy"):
        try:
            images = load_npy(path, path)  # its header checked first: a lying one was a MemoryError ("out of memory")
        except BadImage as e:  # numpy's words for a header it cannot read invite an unsafe load: not repeated
            why = "it holds Python objects, which are never loaded" if "pickle" in str(e) else \
                str(e).removeprefix(f"{path}: ")
            raise MarianaError(f"{path}: not a plain .npy array of images ({why})") from None
    else:
        try:
            images = read_idx(path, ndim=3)
        except NotIdxError as e:
            kind = _image_kind(path)
            raise MarianaError(f"{path}: {f'a {kind} image, not an IDX file' if kind else e.why}; "
                               f"{IMAGES_TAKEN.format(size=size)}") from None
    return check_images(images, path, size)


def _image_kind(path: str) -> str | None:
    """The format Pillow reads `path` as (PNG, JPEG, ...), from its header; None when none."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.format
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None


def _check_out_file(path: str) -> None:
    """--out names a file in a directory that exists: found before the work, not after it."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise MarianaError(f"--out {path}: a directory; --out names the .npy file to write")
    if not os.path.isdir(where):
        raise MarianaError(f"--out {path}: no directory {where} to write it in; create it, or name another --out")
    if not os.access(where, os.W_OK | os.X_OK):
        raise MarianaError(f"--out {path}: directory {where} is not writable")


def _need_dir(path: str, flag: str) -> None:
    if not os.path.isdir(path):  # a file was "no such directory"
        raise MarianaError(f"{flag} {path}: " + ("a file, not a directory: name the directory that holds it"
                                                 if os.path.exists(path) else "no such directory"))


def add_gen_ads(gsub) -> None:
    ga = gsub.add_parser("ads-with-images", help="Criteo-style rows whose creatives are real MNIST images "
                                                 "(docs/synthetic-data.md)")
    ga.add_argument("--rows", type=int, required=True, help="training rows")
    ga.add_argument("--test-rows", type=int, help="test rows (default rows / 4)")
    ga.add_argument("--seed", type=seed_arg, default=0, help="seed of the rows")
    ga.add_argument("--model-seed", type=seed_arg, default=20140621, help="seed of the planted click model")
    ga.add_argument("--creatives", type=int, default=2000, help="creatives (held-out MNIST images, at most 2000)")
    ga.add_argument("--images", required=True, help="the MNIST dir (t10k-images/labels IDX files)")
    ga.add_argument("--out", required=True, help="directory: train.tsv, test.tsv, creatives/, planted.json")
    ga.set_defaults(func=cmd_gen_ads)
    gi = gsub.add_parser("images", help="a deterministic synthetic image set: 10 classes of drawn shapes "
                                        "(featurizer/shapes.py), as MNIST-named IDX files")
    gi.add_argument("--rows", type=int, required=True, help="images to write")
    gi.add_argument("--seed", type=seed_arg, default=0, help="seed of the images")
    gi.add_argument("--size", type=int, default=64, help="side in pixels (default 64: the wide CNN's input)")
    gi.add_argument("--format", choices=("idx", "png", "jpeg"), default="idx", help="idx: MNIST-named IDX files; "
                    "png / jpeg: an image folder, OUT/<k>-<class>/<index>.png|.jpg (what `train image` decodes)")
    gi.add_argument("--quality", type=int, help="--format jpeg: the JPEG quality (1-95, default 90)")
    gi.add_argument("--out", required=True, help="directory: t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz "
                                                 "(or the image folder)")
    gi.set_defaults(func=cmd_gen_images)


def add_commands(sub) -> None:
    f = sub.add_parser("featurize", help="embed images with a frozen featurizer")
    f.add_argument("--model", required=True, help="featurizer directory")
    f.add_argument("--images", required=True, help="IDX file (gz or plain) or .npy of uint8 (N, 28, 28)")
    f.add_argument("--out", required=True, help=".npy file of float32 (N, d)")
    f.add_argument("--batch-size", type=count_arg, default=256, help="images embedded at a time (default 256)")
    f.set_defaults(func=cmd_featurize)

    fc = sub.add_parser("featurize-creatives", help="cache the image features of a creatives dir in Redis "
                                                    "(each creative once; for cluster jobs and model servers)")
    fc.add_argument("--images", required=True, help="creatives dir ('gen ads-with-images' OUT, with uploads/)")
    fc.add_argument("--featurizer", help="frozen featurizer dir (default: CREATIVES/featurizer, "
                                         "trained there on first use)")
    fc.add_argument("--redis-url", help="the Redis to cache in (default: the Redis of the cluster that is up)")
    fc.add_argument("--config", help="cluster TOML (which cluster is up; Redis retry settings)")
    fc.set_defaults(func=cmd_featurize_creatives)

    fz = sub.add_parser("featurizer", help="train the image featurizer")
    fsub = fz.add_subparsers(dest="action", required=True, metavar="ACTION")
    ft = fsub.add_parser("train", help="train the CNN on MNIST (8k/2k split) and export it frozen")
    ft.add_argument("--data", required=True, help="the MNIST dir")
    ft.add_argument("--out", required=True, help="featurizer directory to write: new, empty, or a featurizer "
                                                 "(replaced)")
    ft.add_argument("--epochs", type=int, default=5, help="passes over the training images (default 5)")
    ft.add_argument("--seed", type=seed_arg, default=0, help="seed of the initial weights and the order (default 0)")
    ft.add_argument("--json", action="store_true", help="print the report as one JSON line")
    ft.set_defaults(func=cmd_featurizer_train)


# ---- mariana train image (issue 18) -------------------------------------------------------

def build_train_image_parser() -> argparse.ArgumentParser:
    from mariana.services.ranks import add_rank_flags

    p = Parser(prog="mariana train image",
               description="train the image CNN as G data-parallel groups of P pipelined "
                           "partitions (G x P processes) and export it as a featurizer")
    p.add_argument("--data", help="a dir of MNIST-named IDX files, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte "
                                  "(.gz or plain: MNIST's 10k test set, or `mariana gen images`), or an image "
                                  "folder: one sub-directory of PNG/JPEG/GIF/BMP/WebP files per class, decoded as "
                                  "batches need them (default: $MARIANA_DATA/mnist, else ../shared/data/mnist)")
    p.add_argument("--preset", default=None, help="small | mnist (32/64 channels) | wide (6 blocks, 64x64); "
                                                  "default: mnist for 28x28 images, wide for 64x64")
    p.add_argument("--partitions", type=int, default=1, help="P: model partitions per group (pipeline stages)")
    p.add_argument("--groups", type=int, default=1, help="G: data-parallel groups")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=4, help="M: micro-batches per global batch and group")
    p.add_argument("--recompute", action="store_true", help="cut each partition into ~sqrt(stages) segments and "
                   "recompute in the backward those whose recomputation lowers the activations' peak")
    p.add_argument("--balance", choices=("time", "memory"), default="time", help="cut the stages so the largest "
                   "partition's time per micro-batch (measured) or its memory (state + activations in flight) is least")
    p.add_argument("--cut-after", default="", help="cut by hand instead (no --balance then): the last stage of each "
                   "partition but the last, comma-separated (stages: conv1,pool1,...,convN,poolN,embed,head)")
    p.add_argument("--memory", action="store_true", help="measure each rank's memory by component (parameters, "
                   "gradients, optimizer state, saved activations) on the first steps; in the record's `ranks`")
    p.add_argument("--profile-memory", action="store_true", help="with --memory: also torch's profiler over one "
                   "step (a cross-check; slow)")
    p.add_argument("--prefetch", type=int, default=2, help="batches prepared ahead in a background thread (0: off)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="images and conv weights NHWC inside the partitions (the default; what crosses between "
                   "ranks is NCHW): the wide preset ~1.35x and the mnist preset ~1.2x faster at P=1 than NCHW "
                   "(--no-channels-last), the same accuracy (docs/image-mode.md)")
    p.add_argument("--decode-workers", type=int, default=2, help="an image folder: threads decoding each batch's "
                   "files for the prefetch thread (with --prefetch 0 the training thread decodes them)")
    p.add_argument("--augment", choices=("shift", "elastic"), default="shift", help="augmentation: random shifts, "
                   "or elastic distortions with a random affine map (Simard et al. 2003; ~10x the CPU)")
    p.add_argument("--shift", type=int, default=3, help="augmentation: random shifts up to this many pixels")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=count_arg, default=128, help="images per step over all groups")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--test-images", type=int, default=2000, help="images held out (a fixed permutation's last N)")
    add_rank_flags(p, "featurizer directory to write (rank 0)")
    return p


def _log_skipped(source: dict) -> None:
    import logging
    log = logging.getLogger("mariana")
    if source["skipped"]:
        log.warning("%s: %d files left out (not images this job can read): %s",
                    source["dir"], source["skipped"], "; ".join(source["first_skipped"]))
    empty = [c for c, n in zip(source["classes"], source["per_class"]) if n == 0]
    if empty:  # still a class (labels are the sorted folders' positions), one the model never sees an image of
        log.warning("%s: %s no image this job can read (%s): the model gets a class it never sees for each; "
                    "remove them, or put their images in", source["dir"],
                    "1 class folder holds" if len(empty) == 1 else f"{len(empty)} class folders hold", _listed(empty))


DATA_TAKEN = ("--data takes a directory of MNIST-named IDX files (t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, "
              ".gz or plain) or an image folder (one sub-folder of image files per class)")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _train_data(data: str | None):
    """(the --data set, whether it is an image folder, the dir's name for messages): the dir the
    user typed, else the default MNIST dir. What is neither set is one line saying what it holds."""
    from mariana.featurizer.idx import MNIST_IMAGES, MNIST_LABELS, MNIST_TRAIN, mnist_file
    from mariana.featurizer.image import ENCODED_SUFFIXES, load_mnist, mnist_dir
    from mariana.featurizer.image_folder import is_image_folder, load_image_folder

    d = mnist_dir(data)
    shown = f"--data {data}" if data else f"{d} (the default data dir; no --data given)"
    if not d.exists():
        raise MarianaError(f"{shown}: no such directory; {DATA_TAKEN}")
    if not d.is_dir():
        raise MarianaError(f"{shown}: a file, not a directory; {DATA_TAKEN}")
    if is_image_folder(d):
        return load_image_folder(d), True, str(d)
    names = sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
    mnist = [n for n in (MNIST_IMAGES, MNIST_LABELS, *MNIST_TRAIN) if mnist_file(d, n)]
    loose = [n for n in names if os.path.splitext(n)[1].lower() in ENCODED_SUFFIXES]
    if loose and not mnist:
        raise MarianaError(f"{shown}: {len(loose)} image files ({_listed(loose)}) but no class sub-folders: an image "
                           "folder needs one sub-folder per class (DIR/<class>/<files>; the labels are the sorted "
                           "class folders' positions)")
    if not mnist:
        held = f"{len(names)} file{'' if len(names) == 1 else 's'}{': ' if names else ''}{_listed(names)}"
        raise MarianaError(f"{shown}: neither MNIST-named IDX files nor class sub-folders ({held}); {DATA_TAKEN}")
    return load_mnist(d), False, str(d)


def _preset(args, data, folder: bool, name: str) -> str:
    """--preset, else the one whose side the images have (image folders: any size, scaled)."""
    if args.preset:
        return args.preset
    if folder:  # files are scaled to the model's side: the wide model for images of 64 px and more
        return "wide" if max(data.source["first_image_size"]) >= 64 else "mnist"
    side = data.images.shape[1]
    if side in (preset := {64: "wide", 28: "mnist"}):
        return preset[side]
    raise MarianaError(f"{name}: {side}x{data.images.shape[2]} images; {_preset_sides()}")


def _preset_sides() -> str:
    """What the presets take and what to do about other sides (IDX files are not scaled)."""
    from mariana.trainer.image import PRESETS

    sides: dict[int, list[str]] = {}
    for key, cnn in PRESETS.items():
        sides.setdefault(cnn.size, []).append(key)
    takes = " or ".join(f"{s}x{s} ({', '.join(keys)})" for s, keys in sorted(sides.items()))
    return (f"the presets take {takes}: write the IDX files at one of those sizes (`mariana gen images --size`), or "
            "give an image folder, whose files are scaled to the preset's side")


def train_image_main(argv: list[str]) -> int:
    import logging

    from mariana.services.ranks import run_job
    from mariana.services.runtime import report
    from mariana.services.runtime.logs import setup_logging
    from mariana.trainer.featurizer_train import check_featurizer_out
    from mariana.trainer.strategies import data_parallel as dp

    args = build_train_image_parser().parse_args(argv)
    ctx = dp.DistContext.from_env()
    # rank 0, and the last partition of group 0 (rank P - 1): it has the loss, and says each epoch
    setup_logging(-1 if args.quiet or ctx.rank not in (0, args.partitions - 1) else args.verbose)
    check_featurizer_out(args.out)  # before any training: a directory of other files is refused, not replaced
    data, folder, name = _train_data(args.data)
    from mariana.trainer.image import ImageConfig, check_data

    preset = _preset(args, data, folder, name)
    if args.partitions >= 1 and args.groups >= 1 and not ctx.distributed:  # (below 1: ImageConfig names the flag)
        from mariana.services.ranks import check_nproc
        try:  # before the batch's split into groups, which --groups 100 failed first, naming the batch size
            check_nproc(args.partitions * args.groups, args.device)
        except MarianaError as e:
            raise MarianaError(f"--partitions {args.partitions} x --groups {args.groups}: {e}") from None
    cfg = ImageConfig(preset=preset, partitions=args.partitions, groups=args.groups, schedule=args.schedule,
                      microbatches=args.microbatches, recompute=args.recompute, balance=args.balance,
                      cut_after=tuple(n for n in args.cut_after.split(",") if n), prefetch=args.prefetch,
                      decode_workers=args.decode_workers, channels_last=args.channels_last,
                      classes=len(data.source["classes"]) if folder else 0,
                      augment=args.augment, shift=args.shift, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, seed=args.seed,
                      test_images=args.test_images, device=args.device, threads=args.threads, timeout_s=args.timeout,
                      memory=args.memory or args.profile_memory, profile_memory=args.profile_memory)
    if folder:
        data.images.size = cfg.cnn.size
        _log_skipped(data.source)
    if data.images.shape[1] != cfg.cnn.size:
        raise MarianaError(f"{name}: {data.images.shape[1]}x{data.images.shape[2]} images, but preset "
                           f"{preset!r} takes {cfg.cnn.size}x{cfg.cnn.size}; {_preset_sides()}")
    nproc = args.partitions * args.groups
    log = logging.getLogger("mariana")

    def progress(rec: dict) -> None:
        log.info("image epoch %d/%d: loss %s, %s images/s, waiting for input %.1f%% of the time", rec["epoch"],
                 cfg.epochs, rec["loss"], f"{rec['images_per_s']:,.0f}", 100 * rec["input_wait_share"])

    def train_rank(ctx, init_method):
        from mariana.trainer.featurizer_train import export_featurizer
        from mariana.trainer.image import train_image

        model, record = train_image(cfg, data, ctx, init_method, progress, name)
        if model is None:
            return None
        out = export_featurizer(model, record, data, args.out)
        return {"featurizer": str(out), **{k: v for k, v in record.items() if k != "train_index"}}

    result = run_job(["train", "image"], argv, nproc, cfg.device, train_rank, nproc_checked=True,
                     check=lambda: check_data(cfg, data, name))  # the split, the batch, the classes: once, up front
    if result is not None:
        report.print_record(result if args.json else {k: v for k, v in result.items()
                                                      if k not in ("per_epoch", "config")}, args.json)
    return 0
