"""Speech mode of `mariana` (issue 17): `mariana train speech` and the speech
branch of `evaluate` and `predict` (services/cli.py routes to them):

    mariana train speech [--data FSDD] [--split official|speaker:NAME] [--nproc N]
                         [--exchange exact|fp16|powersgd:R|onebit|approx] [--device cpu|cuda]
                         --out MODEL_DIR [--json]
    torchrun --nproc-per-node N -m mariana train speech ...      (the same job under torchrun)
    mariana evaluate --model MODEL_DIR --data FSDD [--split ...]  (a speech version: utterance accuracy)
    mariana predict --model MODEL_DIR --data WAVS [--skip-bad]   (the digit and its posteriors per file; WAVS:
                                                                  files, directories or globs, comma-separated)

FSDD is the archive fsdd_recordings.tar.gz or the directory holding it (default
$MARIANA_DATA/fsdd, else ../shared/data/fsdd). With --nproc N > 1 this process
starts N ranks of itself (trainer/strategies/data_parallel.run_ranks) and prints
rank 0's result. Bad input is one line and exit code 2 (cli.main).
"""
from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys

from mariana.services.cli_parser import Parser
from mariana.sparse.errors import MarianaError
from mariana.sparse.settings import seed_arg


def build_train_parser() -> argparse.ArgumentParser:
    from mariana.services.ranks import add_rank_flags

    p = Parser(prog="mariana train speech",
               description="train the frame-level speech DNN on spoken digits (FSDD), in one "
                           "process or N with synchronous data parallel")
    p.add_argument("--data", help="fsdd_recordings.tar.gz or its directory (default: $MARIANA_DATA/fsdd, "
                                  "else ../shared/data/fsdd)")
    p.add_argument("--split", default="official", help="official (recording index 0-4 held out: 2,700 / 300) "
                                                       "or speaker:NAME (one speaker held out)")
    p.add_argument("--nproc", type=int, default=1, help="ranks of synchronous data parallel on this machine "
                                                        "(one per GPU with --device cuda; on the CPU up to 4 per core)")
    p.add_argument("--exchange", default="exact", help="how gradients are exchanged: exact (fp32 all-reduce), "
                   "fp16, powersgd:R, onebit, or approx (the default approximate one: onebit)")
    p.add_argument("--epochs", type=int, default=6, help="passes over the training frames (default 6)")
    p.add_argument("--batch-size", type=int, default=2048, help="frames per step over all ranks (default 2048)")
    p.add_argument("--optimizer", choices=("adam", "adagrad", "sgd"), default="adam",
                   help="fed the exchanged gradient on every rank; its state is never sent (default adam)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the weights and of the global batch order")
    add_rank_flags(p, "model directory (rank 0 adds a version)")
    return p


def train_main(argv: list[str]) -> int:
    """`mariana train speech ARGV`: one rank (under torchrun or run_ranks), one process, or N ranks."""
    from mariana.services.ranks import run_job
    from mariana.services.runtime import report
    from mariana.services.runtime.logs import setup_logging
    from mariana.trainer.job import check_out_dir
    from mariana.trainer.strategies import data_parallel as dp

    args = build_train_parser().parse_args(argv)
    setup_logging(-1 if args.quiet or dp.DistContext.from_env().rank > 0 else args.verbose)
    cfg = _config(args)
    check_out_dir(args.out)  # as `mariana train` does: before any epoch (and any rank), not at the publish

    def check() -> None:  # fill the feature cache once, not in every rank, and check the split
        from mariana.featurizer.speech import fsdd_archive, load_features
        from mariana.trainer.speech import split_features
        archive = fsdd_archive(args.data)
        split_features(load_features(archive, cfg.front_end), cfg.split, archive)

    result = run_job(["train", "speech"], argv, args.nproc, cfg.device, lambda ctx, init: _train(cfg, args, ctx, init),
                     check)
    if result is not None:
        report.print_record(_shown(result, args.json), args.json)
    return 0


def _config(args: argparse.Namespace):
    from mariana.trainer.speech import SpeechConfig

    return SpeechConfig(split=args.split, epochs=args.epochs, batch_size=args.batch_size, optimizer=args.optimizer,
                        lr=args.lr, seed=args.seed, exchange=args.exchange, device=args.device,
                        threads=args.threads, timeout_s=args.timeout)


def _train(cfg, args: argparse.Namespace, ctx, init_method: str | None) -> dict:
    from mariana.trainer.speech import train_speech

    return train_speech(cfg, args.data, args.out, ctx, init_method, _progress_logger() if ctx.rank == 0 else None)


def _progress_logger():
    import logging
    import time

    log = logging.getLogger("mariana")
    last = [0.0]

    def report(p) -> None:
        if time.perf_counter() - last[0] >= 1.0:
            last[0] = time.perf_counter()
            log.info("speech epoch %d/%d: %s frames, loss %.4f, %s frames/s", p.epoch, p.epochs, f"{p.frames:,}",
                     p.loss, f"{p.frames_per_s:,.0f}")
    return report


def _shown(result: dict, as_json: bool) -> dict:
    return result if as_json else {k: v for k, v in result.items() if k != "per_epoch"}


# ---- evaluate and predict on a speech version ------------------------------------------

def _check_unseen(test: list, utterances: list, split: str, trained: dict, archive) -> None:
    """MarianaError when --split holds out recordings the model was trained on (cut by another
    split): they were scored as held out, and the accuracy was inflated (0.986 for a model
    whose held-out accuracy is 0.963). By name, from the names its manifest lists, whatever
    archive holds them (a subset of the archive, or the same one uncompressed, passed the
    check when it compared the archives' sha256); a version from before the list, only in
    the archive it was trained from."""
    from mariana.featurizer.speech import split_utterances
    from mariana.sparse.files import file_sha256

    own = trained.get("split")
    if not own or own == split:
        return
    if isinstance(trained.get("recordings"), list):
        learned = {posixpath.basename(str(n)) for n in trained["recordings"]}
    elif trained.get("archive_sha256") == file_sha256(archive):
        learned = {posixpath.basename(u.name) for u in split_utterances(utterances, own)[0]}
    else:
        return
    # by the file's own name: the archive's paths (./recordings/x.wav, or x.wav at its top) passed
    seen = sum(posixpath.basename(u.name) in learned for u in test)
    if seen:
        raise MarianaError(f"--split {split}: {seen} of its {len(test)} held-out recordings are ones this model "
                           f"was trained on (it was trained with --split {own}): scored on them, the accuracy says "
                           f"nothing; evaluate with --split {own}, or on recordings it never saw")


def _held_out(utterances: list, split: str, given: bool) -> list:
    """The held-out part of `split`; a split the data cannot cut is named as --split when the
    user `given` it, else as the model's own (it said "--split speaker:theo" to a user who
    gave none).

    >>> from mariana.featurizer.speech import Utterance
    >>> _held_out([Utterance("1_bob_0.wav", 1, "bob", 0, None)], "speaker:ann", given=False)
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.MarianaError: the split the model was trained with (speaker:ann; --split names another): ...
    """
    from mariana.featurizer.speech import split_utterances

    try:
        return split_utterances(utterances, split)[1]
    except MarianaError as e:
        if given:
            raise
        raise MarianaError(str(e).replace(f"--split {split}:", f"the split the model was trained with ({split}; "
                                          "--split names another):", 1)) from None


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Utterance accuracy of the model's CURRENT version on the held-out recordings of --split
    (default: the split it was trained with)."""
    import time

    import numpy as np

    from mariana.featurizer.speech import SpeechRecognizer, fsdd_archive, read_archive
    from mariana.services.runtime import report

    if getattr(args, "plot", None):
        raise MarianaError("--plot draws a click model's reliability; a speech model reports accuracy and "
                           "confusion (--json)")
    _refuse_row_flags(args)
    model_dir, version = _model_spec(args.model)
    rec = SpeechRecognizer.load(model_dir, version)
    trained = rec.manifest.get("train", {})
    split = getattr(args, "split", None) or trained.get("split", "official")
    t0 = time.perf_counter()
    archive = fsdd_archive(args.data)
    utterances = read_archive(archive, rec.front_end.sample_rate, rec.front_end.min_samples)
    test = _held_out(utterances, split, given=bool(getattr(args, "split", None)))
    if not test:
        raise MarianaError(f"{args.data}: no recording of split {split}'s held-out part (what evaluate scores): "
                           "give the archive the model was trained from, or another --split")
    _check_unseen(test, utterances, split, trained, archive)
    guesses = np.array([rec.classify(u.samples) for u in test])
    digits = np.array([u.digit for u in test])
    confusion = np.zeros((10, 10), np.int64)
    np.add.at(confusion, (digits, guesses), 1)
    record = {"accuracy": round(float((guesses == digits).mean()), 4), "errors": int((guesses != digits).sum()),
              "utterances": len(test), "split": split, "seconds": round(time.perf_counter() - t0, 3),
              "model_dir": os.path.abspath(model_dir), "model_version": rec.manifest.get("version"),
              "confusion": confusion.tolist() if args.json else None}
    report.print_record({k: v for k, v in record.items() if v is not None}, args.json)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """Per wav file of --data (files, directories, globs: expanded as for click models): the digit
    and the posteriors (text: FILE DIGIT p0 .. p9). A file that cannot be read prints FILE nan
    (--skip-bad: nothing) and is counted on stderr; exit code 2 unless --skip-bad."""
    from mariana.featurizer.speech import SpeechRecognizer
    from mariana.sparse.inputs import expand_data_paths, split_spec

    _refuse_row_flags(args)
    paths = expand_data_paths(split_spec(args.data))
    if not paths:
        raise MarianaError("--data names no files")
    rec = SpeechRecognizer.load(*_model_spec(args.model))
    bad = []
    for path in paths:
        out, error = _predict_file(rec, path)
        if error is not None:
            bad.append(error)
            if not args.skip_bad:
                print(json.dumps({"file": path, "error": error}) if args.json else f"{path}\tnan")
            continue
        print(json.dumps({"file": path, **out}) if args.json else
              f"{path}\t{out['digit']}\t" + " ".join(f"{p:.6f}" for p in out["posteriors"]))
    sys.stdout.flush()
    if bad:
        what = "skipped" if args.skip_bad else "could not be read"
        print(f"mariana: {len(bad)} file(s) {what} ({bad[0]})", file=sys.stderr)
    return 2 if bad and not args.skip_bad else 0


def _predict_file(rec, path: str) -> tuple[dict | None, str | None]:
    """(the recognizer's answer, None), or (None, what is wrong with the file, named once)."""
    from mariana.featurizer.speech import BadAudio

    try:
        with open(path, "rb") as f:
            return rec.predict_wav(f.read(), path), None
    except BadAudio as e:
        return None, str(e)  # it names the file already
    except OSError as e:
        return None, f"{path}: {(e.strerror or str(e)).lower()}"


def _refuse_row_flags(args: argparse.Namespace) -> None:
    """Flags of `evaluate` / `predict` that describe a click model's rows mean nothing for wav
    files: one line, not silently ignored."""
    if getattr(args, "format", None):
        raise MarianaError(f"--format is for a click model's rows; {args.model} holds a speech model, which reads "
                           "wav files (drop --format)")


def _model_spec(spec: str) -> tuple[str, str | None]:
    """--model DIR (its CURRENT) or DIR:vNNNNNN, as for click models."""
    from mariana.trainer.bundle import parse_init_from

    return parse_init_from(spec, "--model")
