"""Image features end to end (issue 6): gen ads-with-images, train with --images
(mode 1: lr, mode 2: dnn), the saved version's image table, mariana featurize."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.e2e.test_cli import last_json, one_line_error

@pytest.fixture(scope="module")
def ads(mnist_dir, small_featurizer, tmp_path_factory):
    """20k training rows, 5k test rows (2,000 creatives, 600 of them only in test) and a featurizer."""
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images

    d = tmp_path_factory.mktemp("ads")
    generate_ads_with_images(d / "data", AdsSpec(rows=20_000, seed=1), mnist_dir)
    (d / "featurizer").symlink_to(small_featurizer)
    return d


def in_process(ads, out, kind: str, **overrides) -> dict:
    from mariana.trainer.config import load_config
    from mariana.trainer.job import run_local_job

    cfg = load_config(overrides={"model.kind": kind, "images.creatives": str(ads / "data"),
                                 "images.featurizer": str(ads / "featurizer"), **overrides}, env={})
    return run_local_job(cfg, [str(ads / "data" / "train.tsv")], [str(ads / "data" / "test.tsv")], str(out))


def train(ads, out, *extra):
    data = ads / "data"
    return last_json(run_cli("train", "--data", data / "train.tsv", "--test-data", data / "test.tsv",
                             "--out", out, "--json", *extra))


def test_baseline_mode1_mode2_train_and_record_their_images(ads, tmp_path):
    from mariana.trainer.bundle import ModelBundle

    base = train(ads, tmp_path / "base", "--model", "lr")
    assert "images" not in base
    lr = train(ads, tmp_path / "lr", "--model", "lr", "--images", ads / "data", "--featurizer", ads / "featurizer")
    dnn = in_process(ads, tmp_path / "dnn", "dnn", **{"hashing.bits": 18, "model.embed_dim": 4, "model.hidden": [16]})
    for rec in (lr, dnn):
        img = rec["images"]
        assert img["featurizer_source"] == "given" and img["creatives"] == 2000
        assert img["train_lookups"] == 20_000 and img["test_lookups"] == 5_000
        assert img["train_unknown_creative"] == 0 and img["test_unknown_creative"] == 0
    assert lr["images"]["features_sha256"] == dnn["images"]["features_sha256"]  # one featurizer, same features
    assert lr["auc"] > base["auc"] + 0.01, (base["auc"], lr["auc"])  # new creatives: only pixels say what they are
    bundle = ModelBundle.load(str(tmp_path / "dnn"))
    assert bundle.manifest["images"]["field"] == "C26" and bundle.encoder.dense_dim == 33
    assert bundle.images.counts() == {"lookups": 0, "unknown": 0}


def test_unknown_creatives_fall_back_and_are_counted(ads, tmp_path):
    """Rows naming creatives the table lacks still train and evaluate; the record counts them."""
    lines = (ads / "data" / "test.tsv").read_text().splitlines()[:1000]
    odd = tmp_path / "odd.tsv"
    odd.write_text("".join(line.rsplit("\t", 1)[0] + "\tdeadbeef\n" if i % 4 == 0 else line + "\n"
                           for i, line in enumerate(lines)))
    from mariana.trainer.config import load_config
    from mariana.trainer.job import run_local_job

    cfg = load_config(overrides={"images.creatives": str(ads / "data"), "images.featurizer": str(ads / "featurizer")},
                      env={})
    rec = run_local_job(cfg, [str(odd)], [str(odd)], str(tmp_path / "m"))
    assert rec["images"]["train_unknown_creative"] == 250 and rec["images"]["test_unknown_creative"] == 250


def test_featurize_command_and_its_errors(ads, tmp_path):
    from mariana.featurizer.creatives import load_creatives
    from mariana.featurizer.idx import write_idx
    from mariana.featurizer.image import ImageFeaturizer
    from mariana.services.images_cli import read_images

    _, images, _ = load_creatives(ads / "data" / "creatives")
    write_idx(tmp_path / "c.idx.gz", images[:100])
    np.save(tmp_path / "c.npy", images[:100])
    assert np.array_equal(read_images(str(tmp_path / "c.npy")), read_images(str(tmp_path / "c.idx.gz")))
    # the same bits at one thread count (featurizer/image.py): the command runs at this process's count, which
    # an in-process job of this file may have set (a 16-core host's CPU count against OMP_NUM_THREADS=2)
    import torch
    out = last_json(run_cli("featurize", "--model", ads / "featurizer", "--images", tmp_path / "c.idx.gz",
                            "--out", tmp_path / "f.npy", env={"OMP_NUM_THREADS": str(torch.get_num_threads())}))
    assert out["images"] == 100
    got = np.load(tmp_path / "f.npy", allow_pickle=False)
    assert np.array_equal(got, ImageFeaturizer.load(ads / "featurizer").embed(images[:100]))

    (tmp_path / "bad.idx").write_bytes((tmp_path / "c.npy").read_bytes()[:100])
    np.save(tmp_path / "float.npy", images[:3].astype(np.float32))
    one_line_error(run_cli("featurize", "--model", ads / "featurizer", "--images", tmp_path / "bad.idx",
                           "--out", tmp_path / "x.npy"), "bad.idx", "not an IDX file")
    one_line_error(run_cli("featurize", "--model", ads / "featurizer", "--images", tmp_path / "float.npy",
                           "--out", tmp_path / "x.npy"), "float.npy", "expected uint8")
    one_line_error(run_cli("train", "--data", ads / "data" / "train.tsv", "--model", "lr", "--out", tmp_path / "m",
                           "--images", tmp_path), "creatives.json")
    manifest = json.loads((ads / "featurizer" / "manifest.json").read_text())
    assert manifest["format"] == "mariana-featurizer/1" and manifest["dim"] == 32
