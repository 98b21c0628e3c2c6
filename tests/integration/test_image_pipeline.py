"""The featurizer stage of the pipeline (issue 6) with real processes, a real
redis-server and a real model server: creatives embedded once and cached in
Redis, preprocess looking each row's creative up there, the version's table,
and serving's lookup; unknown creatives and corrupt uploads counted."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import redis

from tests.conftest import run_cli
from tests.integration.cluster import Cluster
from tests.integration.serving import Server

pytestmark = pytest.mark.slow

UNKNOWN, CORRUPT, UPLOADED = b"deadbeef", b"bad1", b"c0ffee01"
# Mode 2, small; one torch thread so that local mode and the cluster compute alike.
CONFIG = {"model": {"kind": "dnn", "embed_dim": 4, "hidden": [16]}, "hashing": {"bits": 16},
          "train": {"batch_size": 1024, "epochs": 1, "threads": 1}, "data": {"block_bytes": 262144}}


@pytest.fixture(scope="module")
def ads(mnist_dir, small_featurizer, tmp_path_factory):
    """8k training rows; 50 name a creative nobody has, 30 a corrupt upload, 20 a good upload."""
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images
    from mariana.featurizer.image import load_mnist

    d = tmp_path_factory.mktemp("image-pipeline")
    generate_ads_with_images(d / "data", AdsSpec(rows=8_000, seed=3, test_rows=2_000), mnist_dir)
    up = d / "data" / "creatives" / "uploads"
    up.mkdir()
    (up / f"{UPLOADED.decode()}.raw").write_bytes(load_mnist(mnist_dir).images[7].tobytes())
    (up / f"{CORRUPT.decode()}.raw").write_bytes(bytes(100))       # truncated
    np.save(up / "bad2.npy", np.zeros((5, 5), np.uint8))           # not 28x28
    train = d / "data" / "train.tsv"
    lines = train.read_bytes().split(b"\n")
    for i, cid in [(i, UNKNOWN) for i in range(50)] + [(i, CORRUPT) for i in range(50, 80)] \
            + [(i, UPLOADED) for i in range(80, 100)]:
        cols = lines[i].split(b"\t")
        cols[-1] = cid  # C26, the creative id column
        lines[i] = b"\t".join(cols)
    train.write_bytes(b"\n".join(lines))
    return {"dir": d / "data", "featurizer": small_featurizer}


def job_config(ads) -> dict:
    return {**CONFIG, "images": {"creatives": str(ads["dir"]), "featurizer": str(ads["featurizer"])}}


@pytest.mark.timeout(300)
def test_featurizer_stage_is_local_mode_exactly_and_serving_looks_up_alike(ads, tmp_path):
    from mariana.featurizer.image import ImageFeaturizer
    from mariana.trainer.bundle import ModelBundle
    from mariana.sparse.settings import from_dict
    from mariana.trainer.config import JobConfig
    from mariana.trainer.images import load_creative_set
    from mariana.trainer.job import run_local_job

    data, test = ads["dir"] / "train.tsv", ads["dir"] / "test.tsv"
    local = run_local_job(from_dict(JobConfig, job_config(ads)), [str(data)], [str(test)], str(tmp_path / "local"))
    with Cluster(tmp_path / "c", **{"worker.pipeline": 1, "preprocess.threads": 1}) as c:
        job = c.submit([data], tmp_path / "m", [test], job_config(ads))
        summary = c.wait(job, 200)
        assert summary["state"] == "done", f"{summary['error']}\n{c.logs()}"
        record = summary["record"]
        pre = c.wait_for(lambda: (s := c.status()["services"]["preprocess-0"]["status"])
                         .get("creative_lookups") == 8_000 and s)  # its heartbeat after the chunks
        # A second job embeds nothing: every creative's features are in Redis already.
        again = c.wait(c.submit([data], tmp_path / "m2", [], job_config(ads)), 200)
        cached = redis.Redis.from_url(c.cfg.redis.url).hgetall(record["images"]["redis_key"])
        served = serve_and_add_a_creative(ads, tmp_path, c.cfg.redis.url, data)

    img, local_img = record["images"], local["images"]
    # Preprocess put in each batch exactly what local mode's encoder does: the same training, to the bit.
    assert record["train_loss"] == local["train_loss"] and record["auc"] == local["auc"], (record, local)
    assert img["features_sha256"] == local_img["features_sha256"]
    assert img["embedded"] == 2001 and img["cached_before"] == 0  # 2,000 generated + 1 good upload
    assert again["state"] == "done" and again["record"]["images"]["embedded"] == 0
    assert again["record"]["images"]["cached_before"] == 2001
    # Unknown creatives and corrupt uploads: counted the same way in both modes.
    for r in (img, local_img):
        assert r["corrupt_images"] == 2 and len(r["first_corrupt"]) == 2, r
        assert r["train_lookups"] == 8_000 and r["train_unknown_creative"] == 80, r
    assert any("bad1.raw" in s and "100 bytes" in s for s in img["first_corrupt"]), img["first_corrupt"]
    assert pre["creatives_unknown"] == 80 and pre["creative_lookups"] == 8_000, pre

    # Redis holds what the frozen featurizer computes (tag = the image's sha256[:8]), within float32
    # rounding: preprocess runs on 1 torch thread, this process on more (featurizer/image.py's embed).
    cset = load_creative_set(str(ads["dir"]))
    want = ImageFeaturizer.load(ads["featurizer"]).embed(cset.images)
    assert len(cached) == 2001 and CORRUPT not in cached and UNKNOWN not in cached
    for k in (0, 999, 2000):  # 2000: the upload
        value = cached[cset.ids[k]]
        assert value[:8] == cset.tags()[k] and np.allclose(np.frombuffer(value[8:], np.float32), want[k], rtol=0,
                                                           atol=1e-5)

    # Serving looks the id up in the version's table: same pCTR as the bundle, unknowns counted.
    bundle = ModelBundle.load(str(tmp_path / "m"))
    instances = served["instances"]
    assert served["before"]["unknown"] == 40 and served["after"]["unknown"] == 40 + 30  # deadbeef now known
    assert np.allclose(served["before"]["pctr"], bundle.predict(bundle.encoder.encode_rows(_chunk(bundle, instances))),
                       atol=1e-6)
    row = bundle.encoder.encode_rows(_chunk(bundle, instances[-1:])).dense[0]
    assert row[-1] == 0.0 and np.allclose(row[-1 - want.shape[1]:-1], want[2000], rtol=0, atol=1e-5)
    # A creative featurized after training (`mariana featurize-creatives`) is scored from its pixels.
    assert served["added"]["embedded"] == 1 and served["added"]["cached_before"] == 2001
    added = ImageFeaturizer.load(ads["featurizer"]).embed(served["new_image"][None])
    bundle.images = bundle.encoder.table = type(bundle.images)(bundle.images.ids + [UNKNOWN],
                                                               np.concatenate([bundle.images.features, added]))
    want_after = bundle.predict(bundle.encoder.encode_rows(_chunk(bundle, instances)))
    assert np.allclose(served["after"]["pctr"], want_after, atol=1e-6)
    assert not np.allclose(served["after"]["pctr"][:10], served["before"]["pctr"][:10], atol=1e-6)


def serve_and_add_a_creative(ads, tmp_path, redis_url: str, data) -> dict:
    """`mariana serve` on the job's model; predict rows 40-99 of the training file (10 name the
    unknown creative, 30 the corrupt upload, 20 the good one); then upload the unknown one's
    image, cache it with `mariana featurize-creatives`, and predict them again."""
    from mariana.sparse.schema import criteo

    cols = criteo().columns[1:]
    instances = [dict(zip(cols, line.split("\t")[1:])) for line in data.read_text().splitlines()[40:100]]
    out = {"instances": instances}
    with Server(tmp_path / "serve", tmp_path / "m", serve={"redis_url": redis_url, "creatives_seconds": 0.2}) as srv:
        status, body = srv.predict(instances)
        assert status == 200, body
        out["before"] = {"pctr": body["pctr"], "unknown": srv.metric("mariana_serve_unknown_creatives_total")}
        from mariana.featurizer.image import load_mnist

        image = load_mnist(mnist_dir_of(ads)).images[11]
        upload = ads["dir"] / "creatives" / "uploads" / f"{UNKNOWN.decode()}.raw"
        upload.write_bytes(image.tobytes())
        try:
            added = run_cli("featurize-creatives", "--images", ads["dir"], "--featurizer", ads["featurizer"],
                            "--redis-url", redis_url, check=True)
            out["new_image"] = image
        finally:
            upload.unlink()  # the fixture is shared: leave the creatives as they were
        out["added"] = json.loads(added.stdout.strip().splitlines()[-1])
        deadline = time.monotonic() + 30
        while srv.metric("mariana_serve_creatives_added_total") < 1:
            assert time.monotonic() < deadline, srv.logs()
            time.sleep(0.1)
        status, body = srv.predict(instances)
        assert status == 200, body
        out["after"] = {"pctr": body["pctr"], "unknown": srv.metric("mariana_serve_unknown_creatives_total")}
    return out


def mnist_dir_of(ads) -> str:
    return json.loads((ads["dir"] / "creatives" / "creatives.json").read_text())["source"]["dir"]


def _chunk(bundle, instances):
    from mariana.sparse.records import parse_records

    chunk, bad, _ = parse_records(bundle.schema, instances)
    assert not bad
    return chunk


@pytest.mark.timeout(240)
def test_creatives_lost_from_redis_are_embedded_again_not_trained_as_unknown(ads, tmp_path):
    """Redis restarted empty between the featurize job and the first chunk (the cluster's
    test double: preprocess paused, the creative keys deleted): preprocess misses every
    creative, finds the set no longer recorded, embeds it again and trains with the real
    features; only the 80 planted rows are unknown."""
    import signal

    data = ads["dir"] / "train.tsv"
    with Cluster(tmp_path / "c") as c:
        r = redis.Redis.from_url(c.cfg.redis.url)
        pre = c.pid("preprocess-0")
        os.kill(pre, signal.SIGSTOP)
        try:
            job = c.submit([data], tmp_path / "m", [], {**job_config(ads), "model": {"kind": "lr"}})
            sets = c.wait_for(lambda: r.keys("mariana:creatives:*:sets"), 60)  # the featurize job is done
            assert r.delete(sets[0][:-len(b":sets")], sets[0]) == 2
        finally:
            os.kill(pre, signal.SIGCONT)
        summary = c.wait(job, 120)
        assert summary["state"] == "done", f"{summary['error']}\n{c.logs()}"
        status = c.wait_for(lambda: (s := c.status()["services"]["preprocess-0"]["status"])
                            .get("creative_lookups") == 8_000 and s)
        held = r.hlen(sets[0][:-len(b":sets")])
    img = summary["record"]["images"]
    assert status["creative_cache_rebuilt"] == 1 and status["creatives_unknown"] == 80, status
    assert img["train_unknown_creative"] == 80 and img["model_creatives"] == 2001 and held == 2001, img
