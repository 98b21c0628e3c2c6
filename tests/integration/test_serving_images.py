"""A server of an image model (LR trained with `--images`), with real processes: a real
`mariana serve` on a free loopback port and a real redis-server holding the creative cache.
New versions swap in; creatives featurized at serve time follow the cache; corrupt cache
entries are unknown creatives, never a 500; a Redis URL without a scheme is one error line."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.conftest import ROOT, run_cli
from tests.integration.serving import Server, tsv_instances

pytestmark = pytest.mark.slow

NEW_AD = b"newad001"  # a creative the version was not trained with



@pytest.fixture(scope="module")
def image_model(mnist_dir, small_featurizer, tmp_path_factory) -> dict:
    """An LR image model dir with two versions (trained twice), CURRENT at v000001."""
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images

    d = tmp_path_factory.mktemp("serving-images")
    generate_ads_with_images(d / "data", AdsSpec(rows=2_000, seed=5, test_rows=200, creatives=200), mnist_dir)
    for _ in range(2):
        run_cli("train", "--data", d / "data" / "train.tsv", "--model", "lr", "--images", d / "data" / "creatives",
                "--featurizer", small_featurizer, "--out", d / "m", check=True)
    (d / "m" / "CURRENT").write_text("v000001\n")
    return {"dir": d / "m", "data": d / "data", "featurizer": small_featurizer}


def model_copy(image_model, tmp_path: Path) -> Path:
    """A model dir of the test's own (tests move its CURRENT)."""
    return Path(shutil.copytree(image_model["dir"], tmp_path / "m"))


def wait_until(what, timeout: float, srv: Server):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, srv.logs()
        time.sleep(0.1)
    return got


# ---- new versions ------------------------------------------------------------------------------

def test_an_image_model_swaps_to_its_next_version(image_model, tmp_path):
    """The new version takes over the old one's id cache (ImageFeatureEncoder.share_ids) and swaps in."""
    m = model_copy(image_model, tmp_path)
    with Server(tmp_path / "serve", m) as srv:
        srv.wait_for("/readyz")
        run_cli("model", "promote", "v000002", "--model-dir", m, check=True)
        wait_until(lambda: srv.get("/v1/model")[1].get("model_version") == "v000002", 15, srv)
        assert srv.get("/readyz")[0] == 200
        assert srv.metric("mariana_serve_model_load_failures_total") == 0
        assert srv.metric("mariana_serve_model_swaps_total") == 1
        assert "its id cache taken over" in srv.logs()


def test_an_error_looking_for_a_version_is_said_once_and_the_watch_goes_on(image_model, tmp_path):
    """A CURRENT that is not text (it raised a UnicodeDecodeError in the look for a new
    version): logged once as naming no version, counted, the old version serving; a good
    CURRENT later swaps in."""
    m = model_copy(image_model, tmp_path)
    with Server(tmp_path / "serve", m) as srv:
        srv.wait_for("/readyz")
        (m / "CURRENT").write_bytes(b"\xff\xfe\n")
        wait_until(lambda: srv.metric("mariana_serve_model_load_failures_total") == 1, 15, srv)
        time.sleep(1.5)  # three more polls: said and counted once
        assert srv.metric("mariana_serve_model_load_failures_total") == 1
        assert srv.get("/v1/model")[1]["model_version"] == "v000001" and srv.get("/readyz")[0] == 200
        (m / "CURRENT").write_text("v000002\n")
        wait_until(lambda: srv.get("/v1/model")[1].get("model_version") == "v000002", 15, srv)
        assert srv.log.read_text().count("CURRENT is not text (b'\\xff\\xfe\\n'), so it names no version") == 1, \
            srv.logs()


# ---- the creative cache ------------------------------------------------------------------------

class Cache:
    """The creative cache the server reads (emptied), and what the version's own bundle,
    in this process, scores with its trained table plus the creatives given."""

    def __init__(self, image_model, redis_url: str):
        from mariana.services.runtime.creatives import namespace_of
        from mariana.trainer.bundle import ModelBundle

        self.bundle = ModelBundle.load(str(image_model["dir"]), "v000001")
        self.key = namespace_of(self.bundle.manifest["images"]["featurizer_sha256"])
        self.redis = redis.Redis.from_url(redis_url)
        self.redis.delete(self.key)
        self.ids, self.features = self.bundle.images.ids, self.bundle.images.features  # (C, d)
        self.field = self.bundle.encoder.field
        self.base = tsv_instances(image_model["data"] / "test.tsv", 1)[0]

    def put(self, entries: dict[bytes, np.ndarray]) -> None:
        """HSET each creative's value: an 8-byte tag, then float32[d]."""
        self.redis.hset(self.key, mapping={c: b"tag00001" + np.asarray(f, np.float32).tobytes()
                                           for c, f in entries.items()})

    def instances(self, creatives: list[bytes]) -> list[dict]:
        return [{**self.base, self.field: c.decode()} for c in creatives]

    def ask(self, srv: Server, creatives: list[bytes]) -> list[float]:
        """The server's pCTR of the test row shown with each creative, in one request."""
        status, body = srv.predict(self.instances(creatives))
        assert status == 200, body
        return body["pctr"]

    def want(self, creatives: list[bytes], added: dict[bytes, np.ndarray] | None = None):
        """What the bundle says, its table extended with `added`."""
        from mariana.featurizer.creatives import CreativeFeatures
        from mariana.sparse.records import parse_records

        added = added or {}
        rows = [self.features] + [np.asarray(f, np.float32)[None] for f in added.values()]
        table = CreativeFeatures(self.ids + list(added), np.concatenate(rows))
        self.bundle.images = self.bundle.encoder.table = table
        chunk, bad, _ = parse_records(self.bundle.schema, self.instances(creatives))
        assert not bad
        return pytest.approx(self.bundle.predict(self.bundle.encoder.encode_rows(chunk)).tolist(), abs=1e-6)


def test_a_creative_added_at_serve_time_follows_its_cache_entry(image_model, redis_server, tmp_path):
    """A new ad cached after training is scored from its features; when its image is replaced
    (its entry rewritten, the cache's size the same) the server takes the new features.
    A creative the version was trained with stays as trained."""
    c = Cache(image_model, redis_server.url)
    one, two = c.features[0], c.features[1]
    serve = {"redis_url": redis_server.url, "creatives_seconds": 0.2}
    with Server(tmp_path / "serve", model_copy(image_model, tmp_path), serve=serve) as srv:
        srv.wait_for("/readyz")
        asked = [NEW_AD, c.ids[0]]
        assert c.ask(srv, asked) == c.want(asked)  # the new ad unknown
        c.put({NEW_AD: one})
        wait_until(lambda: srv.metric("mariana_serve_creatives_added_total") == 1, 15, srv)
        first = c.ask(srv, asked)
        assert first == c.want(asked, {NEW_AD: one})
        c.put({NEW_AD: two, c.ids[0]: two})  # a new image for each, featurized again
        wait_until(lambda: c.ask(srv, asked)[0] != first[0], 15, srv)
        assert c.ask(srv, asked) == c.want(asked, {NEW_AD: two})  # c.ids[0]: trained with it, frozen
        assert c.ask(srv, asked)[1] == first[1]
        assert srv.metric("mariana_serve_creatives_added_total") == 1


def test_corrupt_cache_entries_are_unknown_creatives_never_a_500(image_model, redis_server, tmp_path):
    """NaN, infinite and absurdly large features in the cache are left out: their creatives
    score as unknown ones do, the request's other instances as usual, and the log says so once."""
    c = Cache(image_model, redis_server.url)
    d = c.features.shape[1]
    c.put({b"nan00001": np.full(d, np.nan), b"inf00001": np.full(d, -np.inf), b"big00001": np.full(d, 1e38),
           NEW_AD: c.features[2]})
    serve = {"redis_url": redis_server.url, "creatives_seconds": 0.2}
    with Server(tmp_path / "serve", model_copy(image_model, tmp_path), serve=serve) as srv:
        wait_until(lambda: srv.metric("mariana_serve_creatives_added_total") >= 1, 15, srv)
        time.sleep(0.5)  # more reads of the cache: the bad entries are said once
        asked = [b"nan00001", b"inf00001", b"big00001", NEW_AD, c.ids[2], b"nobody01"]
        pctr = c.ask(srv, asked)
        assert srv.metric("mariana_serve_creatives_added_total") == 1  # the good entry only
        assert pctr == c.want(asked, {NEW_AD: c.features[2]})
        assert all(np.isfinite(pctr)) and 0.0 < min(pctr) and max(pctr) < 1.0, pctr
        assert srv.metric("mariana_serve_unknown_creatives_total") == 4
        logs = srv.log.read_text()
        assert logs.count("3 creative cache entries hold no usable features") == 1, logs
        assert srv.metric("mariana_serve_bad_creatives_total") == 3
        assert "overflow" not in logs and "Traceback" not in logs, logs


# ---- Redis URLs ------------------------------------------------------------------------------

def mariana(*args, timeout: float = 15) -> subprocess.CompletedProcess:
    """`mariana ARGS`, which must give up at once (a server that starts anyway is killed: the test fails)."""
    return subprocess.run([sys.executable, "-m", "mariana", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("url", ["localhost:16391", "http://x"])
def test_a_bad_redis_url_is_one_error_line_at_start(image_model, tmp_path, url):
    served = mariana("serve", "--model-dir", image_model["dir"], "--port", "0", "--workers", "1", "--redis-url", url)
    cached = mariana("featurize-creatives", "--images", image_model["data"] / "creatives", "--featurizer",
                     image_model["featurizer"], "--redis-url", url)
    for proc, key in ((served, "serve.redis_url"), (cached, "--redis-url")):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"mariana: error: {key} {url!r} is not a Redis URL"), lines
        assert "redis://" in lines[0]  # what to give instead
