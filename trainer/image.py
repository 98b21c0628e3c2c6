"""Image mode: the image CNN (trainer/models/image_cnn.py) trained as G data-parallel
groups of P pipelined partitions (trainer/strategies/model_parallel.py). Read top
to bottom:

    data = load_mnist(DIR)                      MNIST, or `mariana gen images` (same files); or
           load_image_folder(DIR)               image files, one sub-directory per class
                                                (featurizer/image_folder.py), decoded batch by batch
    split 8k/2k (featurizer.image.split_indices), pixel stats of the training images (files: of
            up to 2,000 of them, spread over the set)
    model = ImageCNN(preset), seeded; each stage measured on one micro-batch and the stages
            cut into P partitions (`balance` memory: state bytes + saved activations x the
            micro-batches the partition holds in flight; or time)
    step = PipelineStep(my partition, Layout(G, P), ...)
    batches: one seeded global order; each global batch augmented (random +-shift px,
             drawn from (seed, epoch, step): the same in any layout), prepared by a
             background thread `prefetch` batches ahead (image files decoded there, in
             `decode_workers` slices on a thread pool); group g takes (and decodes) its share
    every rank counts the bytes its gradient exchange hands to all-reduce (and, with
    `memory`, measures its memory by component on the first steps: trainer/memory.py);
    rank 0 gathers these, and the partitions (point-to-point), evaluates on the held-out 2k
    and exports the weights as a frozen featurizer (trainer/featurizer_train.export_featurizer)
"""
from __future__ import annotations

import gc
import logging
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mariana.featurizer.augment import KINDS as AUGMENTS
from mariana.featurizer.augment import augment
from mariana.featurizer.image import ImageSet, pixel_stats, split_indices, to_input
from mariana.featurizer.image_folder import EncodedImages
from mariana.sparse.errors import ConfigError
from mariana.trainer import memory
from mariana.trainer.data import put_until_stopped
from mariana.trainer.dense import evaluate_dense, loss_fn, resolve_backend, resolve_device, tensor_batches
from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig
from mariana.trainer.strategies import data_parallel as dp
from mariana.trainer.strategies.model_parallel import (Layout, Partition, PipelineStep, StageCost, cut_partitions,
                                                       in_flight, probe_stages, recompute_plan)

log = logging.getLogger(__name__)

STATS_IMAGES = 2000  # images read from files: the pixel statistics' sample (stats_sample)
PRESETS = {"small": ImageCNNConfig(), "mnist": ImageCNNConfig(channels=(32, 64), embed_dim=128),
           "wide": ImageCNNConfig.wide()}


@dataclass
class ImageConfig:
    """An image job. `batch_size` is the global batch (images per step over all groups)."""

    preset: str = "mnist"         # small (the featurizer's) | mnist (32/64 channels) | wide (6 blocks, 64x64)
    partitions: int = 1
    groups: int = 1
    schedule: str = "1f1b"        # 1f1b | gpipe
    microbatches: int = 4
    recompute: bool = False
    balance: str = "time"         # cut the stages so the largest partition's time (or memory) is least
    cut_after: tuple[str, ...] = ()  # or by hand: the last stage of each partition but the last
    prefetch: int = 2             # batches prepared ahead by a background thread; 0: none
    decode_workers: int = 2       # image files: threads decoding each batch (with the prefetch; 0/1: that thread)
    classes: int = 0              # the head's classes; 0: the preset's (10)
    channels_last: bool = True    # NHWC images and conv weights inside each partition (NCHW across ranks):
                                  # faster on CPU at the same accuracy (docs/image-mode.md)
    augment: str = "shift"        # shift | elastic (featurizer/augment.py)
    shift: int = 3                # augmentation: random shifts of up to this many pixels
    epochs: int = 20
    batch_size: int = 128
    lr: float = 2e-3
    seed: int = 0
    test_images: int = 2000
    device: str = "cpu"
    threads: int = 0
    timeout_s: float = 120.0
    memory: bool = False          # each rank's memory by component (trainer/memory.py), steps 1-2
    profile_memory: bool = False  # and torch's profiler over step 3, as a cross-check

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"--preset {self.preset!r}: use one of {list(PRESETS)}")
        Layout(self.groups, self.partitions)
        for key in ("epochs", "batch_size", "microbatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.batch_size % (self.groups * self.microbatches):
            raise ConfigError(f"--batch-size {self.batch_size} must split evenly into --groups {self.groups} x "
                              f"--microbatches {self.microbatches}")
        if self.augment not in AUGMENTS:
            raise ConfigError(f"--augment {self.augment!r}: use one of {list(AUGMENTS)}")
        if self.balance not in ("memory", "time"):
            raise ConfigError(f"--balance {self.balance!r}: use memory or time")
        stages = [name for name, _ in ImageCNN(self.cnn).fine_stages()]
        if self.partitions > len(stages):  # else found by every rank, after the ranks started
            raise ConfigError(f"--partitions {self.partitions}: the model has {len(stages)} stages, so 1 to "
                              f"{len(stages)} partitions")
        if self.cut_after:
            if self.balance != "time":  # "time" is the default: the only balance the user asked for
                raise ConfigError(f"--cut-after {','.join(self.cut_after)} and --balance {self.balance}: cuts given "
                                  "by hand use no balance; drop one of the two")
            manual_cuts(stages, self.cut_after, self.partitions)
        for key in ("prefetch", "decode_workers", "shift"):  # one message named all four and no value
            if getattr(self, key) < 0:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(self, key)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):  # inf trained to NaN weights and exported them
            raise ConfigError(f"--lr must be a positive number, got {self.lr:g}")
        if self.schedule == "1f1b" and self.microbatches < self.partitions:  # each rank's traceback from torch
            raise ConfigError(f"--microbatches {self.microbatches}: the 1f1b schedule needs at least one per "
                              f"partition (--partitions {self.partitions}); give --microbatches "
                              f"{self.partitions} or more, or --schedule gpipe")
        if self.classes == 1 or self.classes < 0:
            raise ConfigError(f"classes {self.classes}: at least 2 (0: the preset's)")
        if self.shift >= self.cnn.size:  # every pixel moved out of the frame: blank images, a useless featurizer
            raise ConfigError(f"--shift {self.shift}: at most {self.cnn.size - 1} for the {self.cnn.size}x"
                              f"{self.cnn.size} images of preset {self.preset!r} (a shift of {self.cnn.size} px or "
                              "more trains on blank images; the default is 3)")
        dp.check_rank_flags(self.threads, self.timeout_s)

    @property
    def cnn(self) -> ImageCNNConfig:
        return replace(PRESETS[self.preset], classes=self.classes) if self.classes else PRESETS[self.preset]


def batches(load: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor, cfg: ImageConfig, epoch: int,
            augment_them: bool, group: int = 0, pin: bool = False):
    """(group `group`'s share of a global batch of images, or None; its labels; the step) of
    an epoch in the seeded order, augmented with the global batch's draws (the same in any
    layout). `load(rows)`: the normalised (B, 1, S, S) images of training rows `rows` (from
    memory, or decoded from their files). A last batch smaller than the others is left out
    (a pipeline's stages keep one shape). `pin`: in page-locked memory, for non-blocking
    copies to CUDA."""
    start = int(torch.arange(cfg.batch_size).tensor_split(cfg.groups)[group][0])
    for step, idx in enumerate(dp.global_batches(len(y), cfg.batch_size, cfg.seed, epoch)):
        if len(idx) < cfg.batch_size:
            continue
        seed = cfg.seed * 1_000_003 + epoch * 10_007 + step
        mine = idx.tensor_split(cfg.groups)[group]
        xb = augment(load(mine), cfg.augment, cfg.shift, seed, of=(start, len(idx))) if augment_them else None
        yb = y[mine]
        if pin:
            xb, yb = (None if xb is None else xb.pin_memory()), yb.pin_memory()
        yield xb, yb, step


def stats_sample(train_idx: np.ndarray, most: int = STATS_IMAGES) -> np.ndarray:
    """The training images whose pixels give the input normalisation of a set read from
    files: all of them up to `most`, else `most` spread evenly over the set.

    >>> stats_sample(np.arange(10), most=4).tolist(), len(stats_sample(np.arange(3)))
    ([0, 3, 6, 9], 3)
    """
    if len(train_idx) <= most:
        return train_idx
    return train_idx[np.linspace(0, len(train_idx) - 1, most).round().astype(np.int64)]


def prefetched(items, depth: int):
    """`items` produced by a background thread up to `depth` ahead (0: in this thread). An
    error while producing them is raised here, where its item would have come (never an
    epoch that ends early in silence); a consumer that stops early stops the producer.

    >>> def two_then_fail():
    ...     yield from (1, 2)
    ...     raise ValueError("image 3 would not decode")
    >>> got = []
    >>> for x in prefetched(two_then_fail(), 2):
    ...     got.append(x)
    Traceback (most recent call last):
    ValueError: image 3 would not decode
    >>> got
    [1, 2]
    """
    if depth == 0:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def produce() -> None:  # as BatchStream's reader: an error goes through the queue, in order
        try:
            for item in items:
                if not put_until_stopped(q, item, stop):
                    return  # the consumer has gone
        except BaseException as e:
            put_until_stopped(q, e, stop)
            return
        put_until_stopped(q, done, stop)
    threading.Thread(target=produce, daemon=True, name="prefetch").start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def plan_partitions(model: ImageCNN, sample: torch.Tensor, cfg: ImageConfig,
                    ctx: dp.DistContext) -> tuple[list[tuple[int, int]], list[StageCost]]:
    """The cuts of the model's stages into `cfg.partitions`, by `cfg.balance`, from each stage
    measured on one micro-batch (`sample`). Every rank must cut alike: bytes are the same
    everywhere, and measured times are averaged over the ranks first."""
    costs = probe_stages(model.fine_stages(), sample)
    if cfg.cut_after:
        return manual_cuts([c.name for c in costs], cfg.cut_after, cfg.partitions), costs
    if cfg.balance == "time" and ctx.distributed:
        times = torch.tensor([[c.seconds, c.forward_seconds] for c in costs], dtype=torch.float64,
                             device=dp.comm_device())
        dist.all_reduce(times)
        costs = [replace(c, seconds=both / ctx.world_size, forward_seconds=fwd / ctx.world_size)
                 for c, (both, fwd) in zip(costs, times.tolist())]
    return cut_partitions(costs, cfg.partitions, cfg.balance, cfg.schedule, cfg.microbatches, cfg.recompute), costs


def manual_cuts(names: list[str], cut_after: tuple[str, ...], parts: int) -> list[tuple[int, int]]:
    """Partitions ending after the named stages (P - 1 names, in order), the last taking the rest.

    >>> manual_cuts(["conv1", "pool1", "conv2", "head"], ("pool1",), 2)
    [(0, 2), (2, 4)]
    """
    if len(cut_after) != parts - 1:
        raise ConfigError(f"--cut-after names the last stage of each partition but the last: {parts - 1} of {names}, "
                          f"got {list(cut_after)}")
    ends = []
    for name in cut_after:
        if name not in names:
            raise ConfigError(f"--cut-after {name!r}: not a stage; the stages are {names}")
        ends.append(names.index(name) + 1)
    if ends != sorted(set(ends)) or ends[-1] >= len(names):
        raise ConfigError(f"--cut-after {list(cut_after)}: stages in order, each partition non-empty, of {names}")
    starts = [0] + ends
    return list(zip(starts, ends + [len(names)]))


def check_data(cfg: ImageConfig, data: ImageSet, name: str = "the images") -> tuple[np.ndarray, np.ndarray]:
    """The (train, test) positions of `data`, or ConfigError where the job could not learn
    from it: the CLI asks before any rank starts, each rank again. Labels of one class alone
    train to accuracy 1.0 and export a featurizer whose features mean nothing.

    >>> one_class = ImageSet(np.zeros((40, 28, 28), np.uint8), np.full(40, 3, np.uint8), {})
    >>> check_data(ImageConfig(batch_size=8, test_images=4), one_class, "d")
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: d: all 36 training images have label 3: a classifier needs images of two ...
    """
    if data.images.shape[1] != cfg.cnn.size:
        raise ConfigError(f"{name}: the images are {data.images.shape[1]}x{data.images.shape[2]}; preset "
                          f"{cfg.preset!r} takes {cfg.cnn.size}x{cfg.cnn.size}")
    if len(data.images) < 2:  # "must be between 1 and -1 (0 images)"
        raise ConfigError(f"{name}: {len(data.images)} images: nothing to train and test on")
    if not 0 < cfg.test_images < len(data.images):
        raise ConfigError(f"--test-images {cfg.test_images}: must be between 1 and {len(data.images) - 1} "
                          f"({len(data.images)} images)")
    train_idx, test_idx = split_indices(len(data.images), cfg.test_images)
    if len(train_idx) < cfg.batch_size:
        raise ConfigError(f"{len(train_idx)} training images ({len(data.images)} less {len(test_idx)} held out), "
                          f"fewer than one batch of {cfg.batch_size}: lower --batch-size or --test-images")
    labels = data.labels[train_idx]
    if int(labels.max()) >= cfg.cnn.classes:
        raise ConfigError(f"{name}: labels up to {int(labels.max())}, but the model has {cfg.cnn.classes} classes")
    if len(kinds := np.unique(labels)) < 2:
        classes = data.source.get("classes")
        which = f"are in class folder {classes[kinds[0]]!r}" if classes else f"have label {kinds[0]}"
        raise ConfigError(f"{name}: all {len(labels)} training images {which}: a classifier needs images of two "
                          "classes at least (with one it learns nothing: accuracy 1.0, features that mean nothing)")
    return train_idx, test_idx


def train_image(cfg: ImageConfig, data: ImageSet, ctx: dp.DistContext = dp.DistContext(),
                init_method: str | None = None,
                progress: Callable[[dict], None] | None = None,
                name: str = "the images") -> tuple[ImageCNN | None, dict]:
    """Train as rank `ctx.rank`; returns (the whole model on rank 0, else None; the record).
    `name`: the data's, as messages give it (check_data)."""
    layout = Layout(cfg.groups, cfg.partitions)
    if ctx.world_size != layout.world_size:
        raise ConfigError(f"--groups {cfg.groups} x --partitions {cfg.partitions} needs {layout.world_size} "
                          f"processes, not {ctx.world_size}")
    device, _ = dp.place_rank(resolve_device(cfg.device), cfg.threads, ctx)
    train_idx, test_idx = check_data(cfg, data, name)
    y = torch.from_numpy(data.labels[train_idx].astype(np.int64))
    files = isinstance(data.images, EncodedImages)
    workers = cfg.decode_workers if files and cfg.prefetch and cfg.decode_workers > 1 else 1
    dp.init_distributed(ctx, resolve_backend("auto", device), init_method, cfg.timeout_s)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers > 1 else None
    try:
        return _train(cfg, data, ctx, layout, device, train_idx, test_idx, y, files, pool, workers, progress)
    finally:
        dp.shutdown_distributed()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _train(cfg: ImageConfig, data: ImageSet, ctx: dp.DistContext, layout: Layout, device: torch.device,
           train_idx: np.ndarray, test_idx: np.ndarray, y: torch.Tensor, files: bool, pool: ThreadPoolExecutor | None,
           workers: int, progress: Callable[[dict], None] | None) -> tuple[ImageCNN | None, dict]:
    """`train_image` once its process group is up (and torn down by it, whatever happens here)."""
    if files:  # decoded batch by batch, on the prefetch thread's pool; the pixel statistics from a spread sample
        mean, std = pixel_stats(data.images.decode(stats_sample(train_idx), pool, workers))

        def load(rows: torch.Tensor) -> torch.Tensor:
            return to_input(data.images.decode(train_idx[rows.numpy()], pool, workers), mean, std)
    else:
        mean, std = pixel_stats(data.images[train_idx])
        x = to_input(data.images[train_idx], mean, std)
        load = x.__getitem__
    torch.manual_seed(cfg.seed)
    layout_of = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = ImageCNN(cfg.cnn).to(device).to(memory_format=layout_of)  # the same values, laid out NHWC or NCHW
    stages = model.fine_stages()
    probe = load(torch.arange(cfg.batch_size // (cfg.groups * cfg.microbatches)))
    cuts, costs = plan_partitions(model, probe.to(device).contiguous(memory_format=layout_of), cfg, ctx)
    g, p = layout.coords(ctx.rank)
    held = in_flight(cfg.schedule, cfg.microbatches, cfg.partitions, p)
    plan = recompute_plan(costs[cuts[p][0]:cuts[p][1]], held, cfg.recompute)
    part = Partition(stages[cuts[p][0]:cuts[p][1]], plan=plan, channels_last=cfg.channels_last)
    step = PipelineStep(part, layout, ctx.rank, cfg.microbatches, cfg.schedule, F.cross_entropy, device)
    opt = torch.optim.Adam(part.parameters(), lr=cfg.lr)
    if cfg.recompute:
        log.info("image rank %d: partition %d recomputes %s", ctx.rank, p,
                 [names for names, r in part.segments if r] or "nothing (it would not lower the peak)")
    if ctx.rank == 0:
        log.info("image: %d train / %d test images, preset %s, %d group(s) x %d partition(s) %s, schedule %s x%d, "
                 "recompute %s, prefetch %d", len(train_idx), len(test_idx), cfg.preset, cfg.groups, cfg.partitions,
                 [part_names(stages, c) for c in cuts], cfg.schedule, cfg.microbatches,
                 cfg.recompute, cfg.prefetch)
    per_epoch, seconds, images, steps, measured = [], 0.0, 0, 0, {}
    counter = dp.CollectiveBytes()
    dp.count_collectives(counter)
    io_before, cpu_before = dp.io_written(), time.process_time()
    to_device = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    try:
        for epoch in range(cfg.epochs):
            t0 = time.perf_counter()
            losses, wait, done = [], 0.0, 0
            source = prefetched(batches(load, y, cfg, epoch, step.first, g, pin=device.type == "cuda"),
                                cfg.prefetch)
            while True:
                t_wait = time.perf_counter()
                item = next(source, None)
                wait += time.perf_counter() - t_wait
                if item is None:
                    break
                xb, yb, _ = item

                def one_step():
                    opt.zero_grad(set_to_none=True)
                    out = step.step(to_device(xb), to_device(yb))
                    opt.step()
                    return out
                loss = measure(steps, one_step, part, opt, step.stage, device, cfg, measured)
                steps += 1
                done += cfg.batch_size
                if loss is not None:
                    losses.append(float(loss))
            took = time.perf_counter() - t0
            seconds, images = seconds + took, images + done
            rec = {"epoch": epoch + 1, "seconds": round(took, 3), "images_per_s": round(done / took, 1),
                   "input_wait_share": round(wait / took, 4),
                   "loss": round(sum(losses) / len(losses), 5) if losses else None}
            per_epoch.append(rec)
            if progress and step.last and g == 0:
                progress(rec)
        io_after = dp.io_written()
        dp.stop_counting(counter)
        last_stage = step.last
        step = None  # the pipeline objects go before the group does
        gc.collect()
        losses_to_rank0(per_epoch, layout, ctx, last_stage and g == 0)
        sent = counter.snapshot()
        mine = {"rank": ctx.rank, "group": g, "partition": p,
                "gradient_bytes": sum(q.numel() * q.element_size() for q in part.parameters()),
                "allreduce_sent_per_step": sent["sent"] / max(steps, 1),
                "allreduce_payload_per_step": sent["payload"] / max(steps, 1),
                "io_written_per_step": (io_after - io_before) / max(steps, 1) if io_before is not None else None,
                "cpu_share": (time.process_time() - cpu_before) / max(seconds, 1e-9),
                **measured}
        if files:  # images whose files passed the listing's check but would not decode: trained as black
            mine["decode_failures"] = len(data.images.failures)
        ranks = stats_to_rank0(mine, ctx)
        whole = gather_model(model, cuts, layout, ctx)
    finally:
        dp.stop_counting(counter)
        dp.shutdown_distributed()  # before rank 0 scores the model: the other ranks are done
    record = {"mode": "image", "preset": cfg.preset, "groups": cfg.groups, "partitions": cfg.partitions,
              "schedule": cfg.schedule, "microbatches": cfg.microbatches, "recompute": cfg.recompute,
              "prefetch": cfg.prefetch, "cuts": [part_names(stages, c) for c in cuts], "balance": cfg.balance,
              "stage_costs": [{"stage": c.name, "state_bytes": c.state_bytes, "activation_bytes": c.activation_bytes,
                               "ms": round(c.seconds * 1e3, 2)} for c in costs], "epochs": cfg.epochs,
              "train_images": len(train_idx), "test_images": len(test_idx), "train_seconds": round(seconds, 3),
              "images_per_s": round(images / seconds, 1) if seconds else None, "per_epoch": per_epoch,
              "ranks": ranks,
              "config": asdict(cfg), "pixel_mean": mean, "pixel_std": std, "train_index": train_idx,
              "source": data.source}
    if whole is not None:
        x_test = to_input(data.images[test_idx], mean, std)
        y_test = torch.from_numpy(data.labels[test_idx].astype(np.int64))
        cpu = torch.device("cpu")
        whole = whole.to(cpu).to(memory_format=torch.contiguous_format)  # as the exported featurizer runs it
        record["test_accuracy"] = round(evaluate_dense(whole, tensor_batches(x_test, y_test, 512),
                                                       loss_fn("cross_entropy"), cpu).accuracy, 4)
        whole.eval()
        if files and data.images.failures:  # rank 0's, the held-out images it has just scored included
            ranks[0]["decode_failures"] = len(data.images.failures)
            record["first_decode_failures"] = [data.images.failures[k] for k in sorted(data.images.failures)][:5]
    return whole, record


def measure(k: int, run: Callable[[], torch.Tensor | None], part: Partition, opt: torch.optim.Optimizer,
            stage, device: torch.device, cfg: ImageConfig, into: dict) -> torch.Tensor | None:
    """Step `k` of the job, measured when `cfg.memory` asks: the first step by the rise of the
    process's peak RSS (nothing to reuse yet; CUDA: max_memory_allocated), the second by
    trainer/memory's components (the pipeline stage's buffers too), the third under torch's
    profiler (`cfg.profile_memory`)."""
    if not cfg.memory or k > 2 or (k == 2 and not cfg.profile_memory):
        return run()
    out: list = []
    if k == 0:
        into["rss_first_step"] = (memory.cuda_peak(device, lambda: out.append(run())) if device.type == "cuda"
                                  else memory.rss_step(lambda: out.append(run())))
    elif k == 1:
        into.update(memory.measure_step(lambda: out.append(run()), part, opt, (stage,) if stage else ()).to_dict())
    else:
        prof = memory.profile_step(lambda: out.append(run()), device)
        into["profiler_peak"] = prof["peak"]
        into["profiler_activations"] = prof["by_category"]["activation"] + prof["by_category"]["input"]
    return out[0]


STAT_KEYS = ("rank", "group", "partition", "gradient_bytes", "allreduce_sent_per_step", "allreduce_payload_per_step",
             "io_written_per_step", "cpu_share", "rss_first_step", "parameters", "gradients", "optimizer",
             "activations", "buffers", "total", "profiler_peak", "profiler_activations", "decode_failures")


def stats_to_rank0(mine: dict, ctx: dp.DistContext) -> list[dict] | None:
    """Every rank's figures (`STAT_KEYS`, numbers or None) in rank order on rank 0, gathered as
    one float64 tensor per rank; None on the others."""
    values = torch.tensor([float("nan") if mine.get(k) is None else float(mine[k]) for k in STAT_KEYS],
                          dtype=torch.float64)
    if not ctx.distributed:
        rows = [values]
    else:
        rows = [torch.empty_like(values, device=dp.comm_device()) for _ in range(ctx.world_size)]
        dist.all_gather(rows, values.to(dp.comm_device()))
    if ctx.rank != 0:
        return None
    out = []
    for row in rows:
        rec = {k: (None if v != v else round(v, 3) if k == "cpu_share" else round(v, 1) if k.endswith("_per_step")
                   else int(v))
               for k, v in zip(STAT_KEYS, row.tolist())}
        out.append({k: v for k, v in rec.items() if v is not None})
    return out


def losses_to_rank0(per_epoch: list[dict], layout: Layout, ctx: dp.DistContext, sender: bool) -> None:
    """The per-epoch losses live on the last stage: group 0's last stage sends them to rank 0."""
    last = layout.partitions - 1
    if not ctx.distributed or last == 0 or ctx.rank not in (0, last):
        return
    buf = torch.tensor([r["loss"] if r["loss"] is not None else float("nan") for r in per_epoch], dtype=torch.float64,
                       device=dp.comm_device())
    if sender:
        dist.send(buf, dst=0)
    else:
        dist.recv(buf, src=last)
        for r, value in zip(per_epoch, buf.tolist()):
            r["loss"] = round(value, 5)


def part_names(stages: list, cut: tuple[int, int]) -> list[str]:
    return [name for name, _ in stages[cut[0]:cut[1]]]


def gather_model(model: ImageCNN, cuts: list[tuple[int, int]], layout: Layout,
                 ctx: dp.DistContext) -> ImageCNN | None:
    """Rank 0 receives the other partitions of group 0 (point to point, in the model's parameter
    order: a partition's modules are the model's own, so their names are the model's) and
    returns the whole model; the other ranks send theirs and get None."""
    if not ctx.distributed:
        return model
    stages = model.fine_stages()  # what `cuts` index

    def owned(partition: int) -> list[tuple[str, torch.nn.Parameter]]:
        prefixes = tuple(f"{name}." for name in part_names(stages, cuts[partition]))
        return [(n, q) for n, q in model.named_parameters() if n.startswith(prefixes)]
    g, p = layout.coords(ctx.rank)
    if ctx.rank == 0:
        for other in range(1, layout.partitions):
            for _, param in owned(other):
                buf = torch.empty(param.shape, dtype=param.dtype, device=dp.comm_device())  # NCHW, as sent
                dist.recv(buf, src=other)
                param.data.copy_(buf.to(param.device))
    elif g == 0:
        for _, param in owned(p):
            dist.send(param.data.to(dp.comm_device()).contiguous(), dst=0)
    dist.barrier()
    return model if ctx.rank == 0 else None
