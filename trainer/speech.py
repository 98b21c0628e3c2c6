"""Speech mode: the frame-level DNN (trainer/models/speech_dnn.py) on FSDD's
spoken digits, in one process or in N with synchronous data parallel
(trainer/strategies/data_parallel.py). Read top to bottom:

    features = load_features(archive, front_end)     cached log-mel frames (featurizer/speech.py)
    train, test = split_features(features, split)    official: index 0-4 held out; speaker:NAME;
                                                      an empty part is an error, before any training
    x, y = context windows of the training frames     (frames, (2K+1) * n_mels), digit per frame
    model = SpeechDNN, inputs standardised by the training frames' mean and std
    join the process group; wrap the model in DDP with the exchange's hook
    for epoch: for each global batch (one seeded order): this rank's slice, loss of the
               global mean, backward (the exchange), optimizer step; progress ~1/s on rank 0
               evaluate on the test utterances: the sum of frame log-posteriors per utterance
    check the replicas are identical (a digest of every parameter, gathered)
    rank 0 publishes a version (trainer/checkpoint.py): weights, optimizer state, and the
    front-end, model and exchange in the manifest; SpeechRecognizer loads it
"""
from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mariana.featurizer.speech import MODEL_KIND, FrontEnd, SpeechFeatures, fsdd_archive, load_features
from mariana.sparse.errors import ConfigError, MarianaError
from mariana.trainer.checkpoint import save_version
from mariana.trainer.config import DenseConfig
from mariana.trainer.dense import make_optimizer, resolve_backend, resolve_device
from mariana.trainer.models.speech_dnn import SpeechDNN, SpeechDNNConfig, frozen_ops, utterance_scores
from mariana.trainer.strategies import data_parallel as dp

log = logging.getLogger(__name__)


@dataclass
class SpeechConfig:
    """A speech job. `batch_size` is the global batch (frames per step over all ranks)."""

    split: str = "official"
    epochs: int = 6
    batch_size: int = 2048        # frames per global step: 99.0-99.7% on the official split (docs/benchmarks.md)
    optimizer: str = "adam"       # sgd | adam | adagrad (trainer/dense.py makes it)
    lr: float = 3e-3
    seed: int = 0
    exchange: str = "exact"       # exact | fp16 | powersgd:R | onebit | approx
    device: str = "cpu"           # cpu | cuda | cuda:N | auto
    threads: int = 0              # torch threads per rank; 0: the cores / the ranks
    timeout_s: float = 120.0      # every collective; a lost rank fails the job after at most this
    hidden: tuple[int, ...] = (512, 512, 512)
    front_end: FrontEnd = field(default_factory=FrontEnd)

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"speech: --{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        try:
            dp.check_rank_flags(self.threads, self.timeout_s)
            self.exchange = str(dp.parse_exchange(self.exchange))
            self.dense(named="--")  # checks the optimizer, lr and device, named by this command's flags
        except ConfigError as e:
            raise ConfigError(f"speech: {e}") from None

    def dense(self, named: str = "dense.") -> DenseConfig:
        return DenseConfig(device=self.device, loss="cross_entropy", optimizer=self.optimizer, lr=self.lr,
                           batch_size=self.batch_size, epochs=self.epochs, seed=self.seed, named=named)

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden": list(self.hidden), "front_end": self.front_end.to_dict()}


@dataclass
class SpeechProgress:
    epoch: int
    epochs: int
    frames: int            # of this epoch so far, over all ranks
    loss: float            # this rank's mean loss since the last report
    frames_per_s: float    # over all ranks


def train_speech(cfg: SpeechConfig, data: str | os.PathLike | None, out: str | os.PathLike | None,
                 ctx: dp.DistContext = dp.DistContext(), init_method: str | None = None,
                 progress: Callable[[SpeechProgress], None] | None = None) -> dict:
    """Train as rank `ctx.rank` of `ctx.world_size` (joining the process group when there are
    several) and return the result record; rank 0 publishes a version to `out` (None: not)."""
    device, threads = dp.place_rank(resolve_device(cfg.device), cfg.threads, ctx)
    dp.init_distributed(ctx, resolve_backend("auto", device), init_method, cfg.timeout_s)
    archive = fsdd_archive(data)
    feats = load_features(archive, cfg.front_end)
    train, test = split_features(feats, cfg.split, archive)
    x, y, _ = train.windows()
    xt, _, ut = test.windows()
    x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    xt, ut = torch.from_numpy(xt).to(device), torch.from_numpy(ut).to(device)
    model = _model(cfg, x, device)
    opt = make_optimizer(cfg.dense(), model.parameters())
    exchange = dp.parse_exchange(cfg.exchange)
    if ctx.rank == 0:
        log.info("speech: %s, %d train / %d test utterances (%s / %s frames), %d rank(s) x %d thread(s), "
                 "exchange %s, %d epochs of %d steps", cfg.split, len(train), len(test), f"{len(x):,}",
                 f"{len(xt):,}", ctx.world_size, threads, exchange, cfg.epochs, -(-len(x) // cfg.batch_size))
    counter = dp.CollectiveBytes()
    try:
        fit = _fit(model, opt, exchange, counter, (x, y), (xt, ut, test), cfg, ctx, device, progress)
        identical = replicas_identical(model) if ctx.distributed else True
        if not identical:  # every rank knows it: each gathered every digest
            spread = replica_spread(model)
            if ctx.rank == 0:
                log.warning("speech: the %d ranks' parameters differ at the end (by up to %.3g; exchange %s): "
                            "rank 0's are published", ctx.world_size, spread, exchange)
        gc.collect()  # the DDP wrapper of _fit (its reducer, the hooks' state) goes before the group
        if ctx.distributed:
            dist.barrier()  # every rank is done with the group before any leaves it
    finally:
        dp.stop_counting(counter)
        dp.shutdown_distributed()
    epochs, train_seconds, steps, acc = fit["epochs"], fit["seconds"], fit["steps"], fit["accuracy"]
    io_before, io_after = fit["io"]
    sent = counter.snapshot()
    result = {"mode": "speech", "split": cfg.split, "nproc": ctx.world_size, "threads": threads,
              "device": str(device), "exchange": str(exchange), "epochs": cfg.epochs, "steps": steps,
              "train_frames": len(x), "test_utterances": len(test), "test_accuracy": acc["accuracy"],
              "test_errors": acc["utterances"] - acc["correct"], "frame_accuracy": acc["frame_accuracy"],
              "train_seconds": round(train_seconds, 3),
              "samples_per_s": round(len(x) * cfg.epochs / train_seconds, 1),
              "bytes_per_step": round(sent["sent"] / max(steps, 1), 1),
              "payload_bytes_per_step": round(sent["payload"] / max(steps, 1), 1),
              "io_bytes_per_step": (round((io_after - io_before) / max(steps, 1), 1)
                                    if io_before is not None and ctx.distributed else None),
              "replicas_identical": identical, "per_epoch": epochs,
              "parameters": sum(p.numel() for p in model.parameters())}
    if ctx.rank == 0 and out is not None:
        result["version"] = publish_speech(out, model, opt, cfg, result, feats)
        result["model_dir"] = os.path.abspath(out)
    return result


def split_features(feats: SpeechFeatures, split: str, archive: os.PathLike) -> tuple[SpeechFeatures, SpeechFeatures]:
    """(train, test) of `split`, or a MarianaError when either part is empty: no training
    recordings left the model's input statistics undefined (a std() warning, then a division by
    zero in the first step), and no test recordings published a version of accuracy 0.0 that
    no test had measured. The docs promise neither, so both are refused before any training."""
    train, test = feats.split(split)
    if not len(train):
        why = "each has recording index 0-4, the official test part" if split == "official" else \
            f"the archive holds only {split.split(':', 1)[1]}'s recordings"
        raise MarianaError(f"--split {split} leaves no recordings to train on in {archive}: all {len(feats)} are "
                           f"held out ({why})")
    if not len(test):
        why = "none has recording index 0-4, the official test part" if split == "official" else "none is held out"
        raise MarianaError(f"--split {split} leaves no recordings to test on in {archive}: {why}; use an archive "
                           "with held-out recordings, or another --split")
    return train, test


def _fit(model, opt, exchange, counter, train, test, cfg: SpeechConfig, ctx: dp.DistContext, device,
         progress) -> dict:
    """The epochs, with the gradient exchange counted; the DDP wrapper lives only in here."""
    x, y = train
    xt, ut, feats = test
    net = dp.wrap_model(model, exchange, -(-len(x) // cfg.batch_size) * cfg.epochs, device)
    dp.count_collectives(counter)
    epochs, seconds, steps = [], 0.0, 0
    io_before = dp.io_written()
    for epoch in range(cfg.epochs):
        rec = _train_epoch(net, opt, x, y, cfg, ctx, epoch, device, progress)
        seconds += rec["seconds"]
        steps += rec["steps"]
        acc = evaluate_utterances(model, xt, ut, feats)
        epochs.append({"epoch": epoch + 1, "loss": rec["loss"], "seconds": round(rec["seconds"], 3),
                       "frames_per_s": round(rec["frames"] / rec["seconds"], 1), "test_accuracy": acc["accuracy"]})
        if ctx.rank == 0:
            log.info("speech epoch %d/%d: loss %.4f, test accuracy %.4f (%d/%d), %s frames/s", epoch + 1,
                     cfg.epochs, rec["loss"], acc["accuracy"], acc["correct"], acc["utterances"],
                     f"{rec['frames'] / rec['seconds']:,.0f}")
    io_after = dp.io_written()
    dp.stop_counting(counter)  # what follows is no gradient
    return {"epochs": epochs, "seconds": seconds, "steps": steps, "accuracy": acc, "io": (io_before, io_after)}


def _model(cfg: SpeechConfig, x: torch.Tensor, device: torch.device) -> SpeechDNN:
    torch.manual_seed(cfg.seed)
    model = SpeechDNN(SpeechDNNConfig(input_dim=cfg.front_end.input_dim, hidden=tuple(cfg.hidden))).to(device)
    model.set_input_stats(x)
    return model


def _train_epoch(net, opt, x, y, cfg: SpeechConfig, ctx: dp.DistContext, epoch: int, device,
                 progress) -> dict:
    net.train()
    t0 = last = time.perf_counter()
    steps = frames = my_frames = window_frames = 0
    total = window = 0.0
    for batch in dp.global_batches(len(x), cfg.batch_size, cfg.seed, epoch):
        mine = dp.rank_slice(batch, ctx).to(device)
        value = float(dp.train_step(net, opt, _ce_sum, x[mine], y[mine], len(batch), ctx.world_size))
        total, window = total + value, window + value
        steps, frames = steps + 1, frames + len(batch)
        my_frames, window_frames = my_frames + len(mine), window_frames + len(mine)
        now = time.perf_counter()
        if progress and now - last >= 1.0:
            progress(SpeechProgress(epoch + 1, cfg.epochs, frames, window / max(window_frames, 1), frames / (now - t0)))
            window, window_frames, last = 0.0, 0, now
    seconds = time.perf_counter() - t0
    return {"steps": steps, "frames": frames, "loss": round(total / max(my_frames, 1), 5), "seconds": seconds}


def _ce_sum(logits: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, digits, reduction="sum")


def evaluate_utterances(model: SpeechDNN, x: torch.Tensor, utterance: torch.Tensor,
                        feats: SpeechFeatures) -> dict:
    """Utterance accuracy (the digit with the largest sum of frame log-posteriors) and frame accuracy."""
    model.eval()
    with torch.inference_mode():
        logits = torch.cat([model(part) for part in x.split(8192)]) if len(x) else x.new_zeros(0, 10)
    model.train()
    scores = utterance_scores(logits, utterance, len(feats))
    guess = scores.argmax(1).cpu().numpy()
    digits = feats.digits
    frames_right = (logits.argmax(1) == torch.from_numpy(digits).to(logits.device)[utterance]).float().mean()
    correct = int((guess == digits).sum())
    return {"accuracy": round(correct / max(len(feats), 1), 4), "correct": correct, "utterances": len(feats),
            "frame_accuracy": round(float(frames_right), 4) if len(x) else None}


def replicas_identical(model: torch.nn.Module) -> bool:
    """Every rank's parameters and buffers hash to the same digest (gathered as bytes)."""
    h = hashlib.sha256()
    for t in list(model.parameters()) + list(model.buffers()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(dp.comm_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(bool(torch.equal(e, everyone[0])) for e in everyone)


def replica_spread(model: torch.nn.Module) -> float:
    """The largest difference of any rank's parameters and buffers from rank 0's (every rank calls it)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in list(model.parameters()) + list(model.buffers())])
    mine = flat.to(dp.comm_device())
    first = mine.clone()
    dist.broadcast(first, src=0)
    spread = (mine - first).abs().max().reshape(1)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return float(spread)


def publish_speech(out: str | os.PathLike, model: SpeechDNN, opt: torch.optim.Optimizer, cfg: SpeechConfig,
                   result: dict, feats: SpeechFeatures) -> str:
    """Rank 0: a version with the weights, the optimizer state and a manifest that the frozen
    recognizer (featurizer.speech.SpeechRecognizer) runs from: front-end, ops, config."""
    weights = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value):
                    optimizer[f"{names[id(p)]}.{key}"] = value.detach().cpu().reshape(value.shape).numpy()
    manifest = {"kind": MODEL_KIND, "model": {**model.cfg.to_dict(), "kind": MODEL_KIND},
                "front_end": cfg.front_end.to_dict(),
                "ops": frozen_ops(model), "classes": list(range(model.cfg.classes)),
                "train": {"config": cfg.to_dict(), "split": cfg.split, "archive_sha256": feats.archive_sha256,
                          "recordings": sorted(feats.split(cfg.split)[0].names),  # what it learned, by name
                          "nproc": result["nproc"], "exchange": result["exchange"], "optimizer": cfg.optimizer},
                "metrics": {k: result[k] for k in ("test_accuracy", "test_errors", "test_utterances",
                                                   "frame_accuracy", "train_seconds", "samples_per_s",
                                                   "bytes_per_step")},
                "torch": torch.__version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return save_version(out, manifest, weights, optimizer, reason=f"speech {cfg.split}: accuracy "
                                                                   f"{result['test_accuracy']:.4f}")
