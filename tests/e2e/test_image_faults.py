"""`mariana train image` (and `featurizer train`) on what users get wrong, as real processes on
tiny sets: every mistake is one `mariana: error:` line and exit code 2 before any training (not
an hour of training lost to an --out under a file, not a traceback, not a featurizer trained on
blank images or one class), and the messages name the flag, the folder read and what to do."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mariana.featurizer.idx import MNIST_IMAGES, MNIST_LABELS, MNIST_TRAIN, read_idx, write_idx
from tests.conftest import data_dir, run_cli, run_cli_cases

TINY = ("--epochs", "1", "--batch-size", "32", "--test-images", "32")


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """160 drawn 28x28 shapes (`mariana gen images`), and what users make of such sets: the IDX
    files unzipped, renamed as MNIST's training files, cropped to 20x20, relabelled as one class;
    PNG files without class folders; a class folder left empty; a data file and a plain file."""
    d = tmp_path_factory.mktemp("image-faults")
    run_cli("gen", "images", "--rows", "160", "--size", "28", "--seed", "1", "--out", d / "shapes", check=True)
    images, labels = read_idx(d / "shapes" / MNIST_IMAGES), read_idx(d / "shapes" / MNIST_LABELS)

    def idx_set(name: str, x: np.ndarray, y: np.ndarray, names=(MNIST_IMAGES, MNIST_LABELS)) -> Path:
        (d / name).mkdir()
        for fname, array in zip(names, (x, y)):
            write_idx(d / name / fname, array)
        return d / name

    out = {"shapes": d / "shapes",
           "plain": idx_set("plain", images, labels, [n.removesuffix(".gz") for n in (MNIST_IMAGES, MNIST_LABELS)]),
           "train_only": idx_set("train_only", images, labels, MNIST_TRAIN),
           "side20": idx_set("side20", np.ascontiguousarray(images[:, 4:24, 4:24]), labels),
           "one_class": idx_set("one_class", images, np.full_like(labels, 4))}
    for name, classes in (("loose", {"": 3}), ("one_full_class", {"a": 72, "b": 0})):
        for cls, n in classes.items():
            (d / name / cls).mkdir(parents=True, exist_ok=True)
            for k in range(n):
                Image.fromarray(images[k]).save(d / name / cls / f"{k:03d}.png")
        out[name] = d / name
    (d / "ctr.tsv").write_text("1\t0.5\tab12\n")
    (d / "afile").write_text("hi\n")
    return out | {"ctr": d / "ctr.tsv", "afile": d / "afile", "tmp": d}


def _cases(s: dict[str, Path]) -> list[tuple[str, list, list[str]]]:
    """(id, argv, what stderr must say): each a fault a user met, each refused before training."""
    t = s["tmp"]
    default_mnist = data_dir() / "mnist"
    train = ["train", "image", *TINY]
    return [
        ("gen-size", ["gen", "images", "--rows", "10", "--size", "100000", "--out", t / "big"],  # "out of memory:
         ["--size in 8..4096, got 10, 100000"]),                                               # lower hashing.bits"
        ("gen-quality-of-idx", ["gen", "images", "--rows", "10", "--quality", "50", "--out", t / "q"],
         ["--quality is for --format jpeg, not idx"]),  # taken, then ignored
        ("gen-too-big", ["gen", "images", "--rows", "1000000", "--size", "4096", "--out", t / "big"],
         ["1,000,000 images of 4096x4096 are 15625.0 GiB, more than the 8 GiB gen images holds at once"]),
        ("out-under-a-file", [*train, "--data", s["shapes"], "--out", s["afile"] / "x"],  # trained, then "file exists"
         [f"--out {s['afile'] / 'x'}: {s['afile']} is a file, not a directory"]),
        ("featurizer-out-under-a-file",
         ["featurizer", "train", "--data", default_mnist, "--epochs", "1", "--out", s["afile"] / "y"],
         [f"--out {s['afile'] / 'y'}: {s['afile']} is a file, not a directory"]),
        ("negative-threads", [*train, "--data", s["shapes"], "--threads", "-1", "--out", t / "o1"],  # a traceback
         ["--threads -1: must be >= 0"]),
        ("zero-timeout", [*train, "--data", s["shapes"], "--timeout", "0", "--out", t / "o2"],  # gloo's error at P=2
         ["--timeout 0: must be a number of seconds > 0"]),
        ("shift-of-the-side", [*train, "--data", s["shapes"], "--shift", "28", "--out", t / "o3"],  # blank images
         ["--shift 28: at most 27 for the 28x28 images of preset 'mnist'"]),
        ("default-data-named", ["train", "image", "--preset", "wide", "--out", t / "o4"],  # "None: 28x28 images"
         [f"{default_mnist}: 28x28 images, but preset 'wide' takes 64x64"]),
        ("side-no-preset-takes", [*train, "--data", s["side20"], "--out", t / "o5"],  # "give --preset"
         [f"{s['side20']}: 20x20 images; the presets take 28x28 (small, mnist) or 64x64 (wide)", "image folder"]),
        ("mnist-train-files", [*train, "--data", s["train_only"], "--out", t / "o6"],  # a t10k message, no why
         ["no t10k-images-idx3-ubyte.gz (or t10k-images-idx3-ubyte)", "MNIST's train-* files are not"]),
        ("data-is-a-file", [*train, "--data", s["ctr"], "--out", t / "o7"],  # "ctr.tsv/t10k-...: no such file"
         [f"--data {s['ctr']}: a file, not a directory; --data takes a directory of MNIST-named IDX files"]),
        ("pngs-without-class-folders", [*train, "--data", s["loose"], "--out", t / "o8"],  # the MNIST message
         [f"--data {s['loose']}: 3 image files (000.png, 001.png, 002.png) but no class sub-folders"]),
        ("one-class-idx", [*train, "--data", s["one_class"], "--out", t / "o9"],  # accuracy 1.0 in silence
         [f"{s['one_class']}: all 128 training images have label 4: a classifier needs images of two classes"]),
        ("empty-class-folder", [*train, "--data", s["one_full_class"], "--out", t / "o10"],  # class b: 0 images
         ["1 class folder holds no image this job can read (b)",
          f"{s['one_full_class']}: all 40 training images are in class folder 'a'"]),
        ("featurizer-few-images", ["featurizer", "train", "--data", s["shapes"], "--epochs", "1", "--out", t / "o11"],
         [f"--data {s['shapes']}: 160 images; featurizer train holds out 2,000"]),  # ValueError traceback
        ("featurizer-data-is-a-file", ["featurizer", "train", "--data", s["ctr"], "--out", t / "o13"],
         [f"--data {s['ctr']}: a file, not a directory"]),  # "no such directory"
        ("more-ranks-than-allowed", [*train, "--data", s["shapes"], "--groups", "100", "--out", t / "o12"],
         ["--partitions 1 x --groups 100: 100 ranks: must be between 1 and"]),  # named the batch size
    ]


@pytest.fixture(scope="module")
def refused(sets) -> list:
    """Every case of _cases, run in one `mariana` process (the CLI and torch imported once)."""
    return run_cli_cases([argv for _, argv, _ in _cases(sets)])


CASE_IDS = [case_id for case_id, _, _ in _cases({k: Path(k) for k in (
    "tmp", "shapes", "afile", "side20", "train_only", "ctr", "loose", "one_class", "one_full_class")})]
NEED_MNIST = ("featurizer-out-under-a-file", "default-data-named")  # the real MNIST: what users lose work on


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_a_mistake_is_one_error_line_before_any_training(sets, refused, case):
    (code, stderr), (_, _, needles) = refused[case], _cases(sets)[case]
    if CASE_IDS[case] in NEED_MNIST and not (data_dir() / "mnist" / MNIST_IMAGES).exists():
        pytest.skip("the default MNIST dir is not here (set MARIANA_DATA to the shared data dir)")
    assert code == 2, (code, stderr)
    assert "Traceback" not in stderr and "image epoch" not in stderr and "featurizer written" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mariana: error: ")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr
    for needle in needles:
        assert needle in stderr, stderr


def test_unzipped_mnist_named_idx_files_train(sets, tmp_path):
    """MNIST is often kept unpacked (t10k-images-idx3-ubyte without .gz), which `featurize`
    reads: the job trains on it as on the gzipped files."""
    proc = run_cli("train", "image", "--data", sets["plain"], *TINY, "--out", tmp_path / "fz", "--json", check=True)
    got = json.loads(proc.stdout)
    assert got["source"]["dir"] == str(sets["plain"]) and got["train_images"] == 128
    assert (tmp_path / "fz" / "manifest.json").is_file()
