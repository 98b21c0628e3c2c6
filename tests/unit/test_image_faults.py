"""Faults an exploratory run of the image commands found: an --out of other files deleted,
16-bit PNGs past the memory bound, NaN labels from one creative, a featurizer's manifest not
checked against its weights, and messages that did not say what to do."""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import tracemalloc

import numpy as np
import pytest
import torch
from PIL import Image

from mariana.featurizer.image import MANIFEST, WEIGHTS, ImageFeaturizer, decode_encoded
from mariana.sparse.errors import MarianaError, ModelDirError


def _png(array: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG", **kw)
    return buf.getvalue()


def _tiny_featurizer(out, dim: int = 4):
    """A featurizer dir of one linear op over the pixels: (N, 28, 28) -> (N, dim)."""
    from mariana.trainer.featurizer_train import write_featurizer

    manifest = {"dim": dim, "ops": [{"op": "flatten"}, {"op": "linear", "weight": "w", "bias": "b"}],
                "input": {"size": 28, "pixel_mean": 0.1, "pixel_std": 0.3}}
    gen = torch.Generator().manual_seed(0)
    return write_featurizer(out, manifest, {"w": torch.randn(dim, 784, generator=gen), "b": torch.zeros(dim)})


# ---- 1. an --out of other files is refused, not replaced ----------------------------------------

def test_a_featurizer_out_of_other_files_is_refused_before_training_and_kept(tmp_path):
    from mariana.featurizer.image import ImageSet
    from mariana.trainer.featurizer_train import check_featurizer_out, train_and_export, write_featurizer

    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("precious")
    empty = ImageSet(np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.uint8), {})
    with pytest.raises(MarianaError, match=r"--out .*victim: a directory that holds no featurizer \(2 files: "
                                           r"notes.txt, sub\)"):
        train_and_export(empty, victim)  # refused before the training (which this empty set would fail)
    with pytest.raises(MarianaError, match="holds no featurizer"):
        write_featurizer(victim, {"dim": 1}, {"w": torch.zeros(2)})
    assert (victim / "notes.txt").read_text() == "precious" and (victim / "sub").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no temp dir left beside it

    f = _tiny_featurizer(tmp_path / "f")
    check_featurizer_out(f)  # a featurizer is replaced, as before
    _tiny_featurizer(f, dim=3)
    assert ImageFeaturizer.load(f).dim == 3
    (f / "README").write_text("mine")
    with pytest.raises(MarianaError, match=r"a featurizer with 1 other files beside it \(README\)"):
        check_featurizer_out(f)
    (tmp_path / "file").write_text("x")
    with pytest.raises(MarianaError, match="exists and is not a directory"):
        check_featurizer_out(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    check_featurizer_out(tmp_path / "empty")
    check_featurizer_out(tmp_path / "new" / "deeper")


def test_a_diverged_featurizer_is_not_written_over_a_good_one(tmp_path):
    """An image run at --lr 1e6 exported NaN weights over a good featurizer, exit 0; it loaded
    nowhere after."""
    from mariana.trainer.featurizer_train import write_featurizer

    out = tmp_path / "f"
    write_featurizer(out, {"dim": 2}, {"w": torch.ones(2)})
    before = (out / WEIGHTS).read_bytes()
    with pytest.raises(MarianaError, match=r"f: not written: the trained weights hold NaN or infinite values "
                                           r"\(in output.std\): training diverged; lower --lr; the featurizer there "
                                           "is kept"):
        write_featurizer(out, {"dim": 2}, {"w": torch.ones(2), "output.std": torch.tensor([1.0, float("inf")])})
    assert (out / WEIGHTS).read_bytes() == before


def test_featurizer_data_is_checked_against_the_config_it_trains_with(tmp_path):
    """The check was the CLI's, against the default config's side and hold-out: the Python
    API trained into a traceback, and a config holding out fewer images was refused."""
    from mariana.featurizer.image import ImageSet
    from mariana.trainer.featurizer_train import (FeaturizerTrainConfig, check_featurizer_data,
                                                  train_and_export)
    from mariana.trainer.models.image_cnn import ImageCNNConfig

    few = ImageSet(np.zeros((160, 28, 28), np.uint8), np.arange(160, dtype=np.uint8) % 10, {})
    check_featurizer_data(few, FeaturizerTrainConfig(test_images=100), "few")
    with pytest.raises(MarianaError, match="^the image set: 160 images; featurizer train holds out 2,000 and"):
        train_and_export(few, tmp_path / "f")
    with pytest.raises(MarianaError, match="^few: 28x28 images; featurizer train takes 32x32"):
        check_featurizer_data(few, FeaturizerTrainConfig(test_images=100, cnn=ImageCNNConfig(size=32)), "few")
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("check", ["model", "featurizer"])
def test_an_out_dir_that_cannot_be_made_is_named_before_any_work(tmp_path, check):
    """One helper (trainer.job.check_can_create_in) checks where a model or a featurizer directory
    will be made, before the training: a file on the way, and a dangling symbolic link (at
    --out or above it), which os.makedirs reports only as "File exists" once the work is done."""
    from mariana.trainer.featurizer_train import check_featurizer_out
    from mariana.trainer.job import check_out_dir

    fn = check_out_dir if check == "model" else check_featurizer_out
    (tmp_path / "afile").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(MarianaError, match=f"{tmp_path}/afile is a file, not a directory"):
        fn(str(tmp_path / "afile" / "m"))
    for out in (tmp_path / "gone", tmp_path / "gone" / "m"):
        with pytest.raises(MarianaError, match=f"{tmp_path}/gone is a symbolic link to '{tmp_path}/nowhere', "
                                               "which does not exist"):
            fn(str(out))
    (tmp_path / "nowhere").mkdir()  # the link's target made: both may be written
    fn(str(tmp_path / "gone" / "m"))
    fn(str(tmp_path / "new" / "deeper"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "gone", "nowhere"]  # the probes left nothing


def test_the_featurizer_cache_of_a_creatives_dir_is_not_trained_over_other_files(tmp_path):
    from mariana.sparse.errors import ConfigError
    from mariana.trainer.config import ImagesConfig
    from mariana.trainer.images import resolve_featurizer

    (tmp_path / "featurizer").mkdir()
    (tmp_path / "featurizer" / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="not empty and no featurizer .* give --featurizer"):
        resolve_featurizer(ImagesConfig(creatives=str(tmp_path), mnist=str(tmp_path / "no-mnist")), tmp_path, {})
    assert (tmp_path / "featurizer" / "notes.txt").read_text() == "precious"
    (tmp_path / "featurizer" / "notes.txt").unlink()  # the MNIST dir creatives.json names, moved away since:
    moved = r"moved\?\): give a trained featurizer \(--featurizer\), or set images.mnist"
    with pytest.raises(ConfigError, match=moved):
        resolve_featurizer(ImagesConfig(creatives=str(tmp_path)), tmp_path, {"source": {"dir": str(tmp_path / "gone")}})


# ---- 2. 16-bit PNGs and big files -----------------------------------------------------------------

def test_16_bit_grey_decodes_to_its_top_bits_exactly_with_or_without_a_transparent_level():
    rng = np.random.default_rng(7)
    for h, w, size in ((28, 28, 28), (40, 300, 28), (700, 90, 28), (300, 310, 64)):
        deep = rng.integers(0, 65536, (h, w)).astype(np.uint16)
        deep[:, ::3] = 50000
        ref = Image.fromarray((deep >> 8).astype(np.uint8))  # what the featurizer took them as, 8-bit grey
        keyed = Image.fromarray(np.where(deep == 50000, 0, deep >> 8).astype(np.uint8))  # the level clear: black
        assert np.array_equal(decode_encoded(_png(deep), "d.png", size), decode_encoded(_png(np.asarray(ref)),
                                                                                        "r.png", size)), (h, w)
        got = decode_encoded(_png(deep, transparency=50000), "k.png", size)
        assert np.array_equal(got, decode_encoded(_png(np.asarray(keyed)), "r.png", size)), (h, w)


def test_a_big_16_bit_png_decodes_without_widening_the_whole_image():
    deep = np.zeros((3000, 3000), np.uint16)  # 9M pixels: 72 MB as int64, 9 MB as the 8-bit result
    deep[::7, ::5] = 40000
    raw = _png(deep)
    del deep
    tracemalloc.start()  # numpy's arrays are traced (Pillow's own buffers are not)
    try:
        img = decode_encoded(raw, "big.png")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert img.shape == (28, 28) and img.max() > 0
    assert peak < 24 << 20, f"{peak / 2**20:.0f} MiB of arrays to decode a 9M-pixel 16-bit PNG"


def _creatives(d, n: int = 2):
    from mariana.featurizer.creatives import IMAGES_FILE, META_FILE

    d.mkdir(parents=True, exist_ok=True)
    np.save(d / IMAGES_FILE, np.zeros((n, 28, 28), np.uint8))
    (d / META_FILE).write_text(json.dumps({"ids": [f"c{i}" for i in range(n)]}))
    (d / "uploads").mkdir()
    return d / "uploads"


def test_uploads_over_the_size_bound_or_not_regular_files_are_counted_and_named(tmp_path):
    from mariana.featurizer.image import MAX_FILE_BYTES
    from mariana.trainer.images import load_creative_set

    up = _creatives(tmp_path / "c")
    (up / "ok.png").write_bytes(_png(np.full((28, 28), 9, np.uint8)))
    with open(up / "huge.png", "wb") as f:  # sparse: no disk used, and never read
        f.truncate(MAX_FILE_BYTES + 1)
    (up / "adir").mkdir()
    os.symlink(tmp_path / "gone.png", up / "dangling.png")
    os.mkfifo(up / "pipe.png")  # opened, it would block the job
    cset = load_creative_set(str(tmp_path / "c"))
    assert cset.ids == [b"c0", b"c1", b"ok"] and cset.images[2].max() == 9
    why = dict(c.split(": ", 1) for c in cset.corrupt)
    assert sorted(why) == ["adir", "dangling.png", "huge.png", "pipe.png"], cset.corrupt
    assert why["huge.png"] == f"{MAX_FILE_BYTES + 1:,} bytes, over the 64 MiB an upload may be"
    assert why["adir"].startswith("a directory") and "does not exist" in why["dangling.png"]
    assert why["pipe.png"].startswith("not a regular file") and cset.info()["corrupt_images"] == 4


def test_an_image_folder_leaves_out_files_over_the_size_bound_unread(tmp_path):
    from mariana.featurizer.image import MAX_FILE_BYTES
    from mariana.featurizer.image_folder import load_image_folder

    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "1.png").write_bytes(_png(np.zeros((28, 28), np.uint8)))
    with open(tmp_path / "a" / "2.png", "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    data = load_image_folder(tmp_path)
    assert len(data.images) == 2 and data.source["skipped"] == 1
    assert "2.png: 67,108,865 bytes, over the 64 MiB" in data.source["first_skipped"][0]


# ---- 3. one creative: no NaN labels ----------------------------------------------------------------

def test_one_creative_gives_clicks_not_nan_labels(tmp_path):
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images, ink_z
    from mariana.featurizer.idx import MNIST_IMAGES, MNIST_LABELS, write_idx

    assert ink_z(np.full((1, 28, 28), 30, np.uint8)).tolist() == [0.0]
    assert ink_z(np.full((3, 28, 28), 30, np.uint8)).tolist() == [0.0, 0.0, 0.0]
    rng = np.random.default_rng(0)
    write_idx(tmp_path / MNIST_IMAGES, rng.integers(0, 256, (2010, 28, 28)).astype(np.uint8))
    write_idx(tmp_path / MNIST_LABELS, rng.integers(0, 10, 2010).astype(np.uint8))
    got = generate_ads_with_images(tmp_path / "out", AdsSpec(rows=3000, creatives=1), tmp_path)
    assert 0.1 < got["train"]["ctr"] < 0.4 and 0.1 < got["test"]["ctr"] < 0.4


def test_a_non_finite_logit_stops_the_generator_rather_than_writing_a_non_click():
    from mariana.featurizer.ads import AdsSpec, Planted, _rows
    from mariana.sparse.synth import make_world

    planted = Planted(alpha=np.zeros(10), beta=np.zeros((10, 10)), gamma=0.3, own=np.array([0.0, np.nan]),
                      ink_z=np.zeros(2), digits=np.array([1, 2]))
    with pytest.raises(ValueError, match="non-finite logit"):
        _rows(make_world(1), planted, np.random.default_rng(0), np.arange(2), np.arange(0), 500, AdsSpec(rows=1),
              False)


# ---- 4. a featurizer's manifest checked against its weights -------------------------------------

def test_a_featurizer_whose_weights_are_not_its_manifests_is_refused_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    f = _tiny_featurizer(tmp_path / "f")
    good = ImageFeaturizer.load(f)
    assert good.embed(np.zeros((3, 28, 28), np.uint8)).shape == (3, 4)
    weights = load_file(str(f / WEIGHTS))
    save_file({k: v * 2 for k, v in weights.items()}, str(f / WEIGHTS))  # same shapes, other values
    with pytest.raises(ModelDirError, match="weights.safetensors is not the file manifest.json was written with"):
        ImageFeaturizer.load(f)
    save_file(weights, str(f / WEIGHTS))
    manifest = json.loads((f / MANIFEST).read_text())
    (f / MANIFEST).write_text(json.dumps({**manifest, "dim": 16}))
    with pytest.raises(ModelDirError, match=r"says dim 16 but weights.safetensors gives features \(4,\)"):
        ImageFeaturizer.load(f)
    bad_ops = {**manifest, "input": {**manifest["input"], "size": 20}}  # 400 pixels into a 784-wide linear
    (f / MANIFEST).write_text(json.dumps(bad_ops))
    with pytest.raises(ModelDirError, match="the ops in manifest.json do not fit the weights"):
        ImageFeaturizer.load(f)
    (f / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if k != "input"}))
    with pytest.raises(ModelDirError, match="a missing or bad field"):
        ImageFeaturizer.load(f)


# ---- 5. featurize's messages ------------------------------------------------------------------------

def test_featurize_says_what_it_takes_for_a_directory_or_an_image_file(tmp_path):
    from mariana.services.images_cli import read_images

    with pytest.raises(MarianaError, match=r"a directory; featurize --images takes an IDX file \(gz or plain\) "
                                           r"or a .npy of uint8 \(N, 28, 28\) images"):
        read_images(str(tmp_path))
    (tmp_path / "ad.png").write_bytes(_png(np.zeros((28, 28), np.uint8)))
    with pytest.raises(MarianaError, match=r"ad.png: a PNG image, not an IDX file; featurize --images takes an IDX"):
        read_images(str(tmp_path / "ad.png"))
    (tmp_path / "junk.idx").write_bytes(b"junk" * 10)
    with pytest.raises(MarianaError, match=r"not an IDX file \(bad magic 6a756e6b\); featurize --images takes"):
        read_images(str(tmp_path / "junk.idx"))
    np.save(tmp_path / "wide.npy", np.zeros((2, 64, 64), np.uint8))
    assert read_images(str(tmp_path / "wide.npy"), 64).shape == (2, 64, 64)  # a 64-px featurizer's input


def test_featurize_checks_its_out_path_before_any_work(tmp_path):
    from mariana.services.images_cli import cmd_featurize

    args = argparse.Namespace(model=str(tmp_path / "no-featurizer"), images=str(tmp_path / "none.npy"),
                              out=str(tmp_path / "nonexist" / "o.npy"), batch_size=256)
    with pytest.raises(MarianaError, match=r"--out .*o.npy: no directory .*nonexist to write it in"):
        cmd_featurize(args)


@pytest.mark.parametrize("meta", ['["a"]', "5", "null", '{"ids": 5}'])
def test_a_creatives_json_of_the_wrong_shape_is_one_error(tmp_path, meta):
    """Valid JSON of another shape ended in an AttributeError traceback (exit 1; in cluster
    mode "internal error: AttributeError")."""
    from mariana.featurizer.creatives import META_FILE, load_creatives

    _creatives(tmp_path / "c")
    (tmp_path / "c" / META_FILE).write_text(meta)
    with pytest.raises(MarianaError, match=rf'{META_FILE} must be a JSON object whose "ids" is a list of creative '
                                           rf"ids, got {re.escape(meta)}"):
        load_creatives(tmp_path / "c")


def test_a_cluster_job_whose_image_field_is_not_a_text_column_is_refused_when_submitted(tmp_path):
    """With images.field = I1 (a number column) a cluster job was taken (201), and its
    preprocess failed on every chunk, restarted, failed again: the job ran at 0 rows for ever
    and held up every job queued behind it. Local mode said so at once; now the job's check does."""
    from mariana.services.assemble import check_data
    from mariana.sparse.synth import generate_criteo

    generate_criteo(tmp_path / "t.tsv", 200, seed=1)
    body = {"data": [str(tmp_path / "t.tsv")], "out": str(tmp_path / "m"),
            "config": {"images": {"creatives": str(tmp_path / "c"), "field": "I1"}}}
    with pytest.raises(MarianaError, match="images.field 'I1' is not a categorical column of schema 'criteo'"):
        check_data(body)


def test_a_npy_of_garbage_or_objects_is_refused_without_numpy_advice(tmp_path):
    """7 bytes of garbage named .npy got numpy's "This file contains pickled (object) data. If
    you trust the file you can load it unsafely": wrong, and an invitation to load pickles."""
    from mariana.services.images_cli import read_images

    garbage = tmp_path / "g.npy"
    garbage.write_bytes(b"\x93NUMPY\x01")
    objects = tmp_path / "o.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for path in (garbage, objects):
        with pytest.raises(MarianaError, match=f"{path.name}: not a plain .npy array of images") as e:
            read_images(str(path))
        assert "unsafely" not in str(e.value) and "trust" not in str(e.value)
