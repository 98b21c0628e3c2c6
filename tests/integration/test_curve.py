"""`cluster.curve_key`: every ZeroMQ connection of the cluster speaks CURVE with the key the
config holds. A job runs as before; a peer without the key (a stranger on the network, who
could otherwise end a job on a shard, push gradients or fail a job with a message of its own:
an exploratory chaos run) never completes the handshake, so nothing it sends is read."""
from __future__ import annotations

import json

import pytest
import zmq

from mariana.services import protocol
from mariana.sparse.synth import generate_criteo
from tests.integration.cluster import Cluster
from tests.integration.test_bad_messages import zmq_context
from tests.integration.test_registration import EX_CONFIG, ended, run, variant

pytestmark = pytest.mark.slow


def test_a_cluster_with_a_curve_key_trains_and_strangers_are_not_heard(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 20_000, seed=3)
    _, secret = zmq.curve_keypair()
    job_config = {"hashing": {"bits": 16}, "train": {"epochs": 2, "batch_size": 1024}}
    with Cluster(tmp_path / "c", **{"cluster.curve_key": secret.decode()}) as c:
        job = c.submit([data], tmp_path / "m", config=job_config)
        summary = c.wait(job, 120)
        assert summary["state"] == "done", f"{summary['state']}: {summary['error']}\n{c.logs()}"
        assert summary["record"]["rows_applied"] == 40_000, summary["record"]
        assert c.cfg.cluster.curve_key == secret.decode()  # the resolved config every service read
        with zmq_context() as ctx:
            answers = {}
            for name, keys in (("stranger", None), ("holder", secret)):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                if keys is not None:
                    public = zmq.curve_public(keys)
                    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, keys
                sock.connect(c.cfg.coordinator.endpoint)
                sock.send_multipart(protocol.encode("GetJob", 7, job=job))
                answers[name] = protocol.decode(sock.recv_multipart()) if sock.poll(3000) else None
                sock.close()
        jobs = c.request("GET", "/v1/jobs")[1]["jobs"]
        # a host whose config has another key, or none: its service exits at once, saying so
        # (it used to retry for cluster.start_seconds and say the coordinator "never answered")
        other = zmq.curve_keypair()[1].decode()
        keys = {"other": other, "none": ""}
        starts = {name: run("worker", 0, variant(c, tmp_path / f"{name}.toml", **{"cluster.curve_key": key,
                                                                                 "worker.metrics_ports": []}),
                            tmp_path / f"{name}.log") for name, key in keys.items()}
        refused = {name: ended(p, tmp_path / f"{name}.log", timeout=30) for name, p in starts.items()}
        counted = c.status()["counters"]["handshake_failures"]
        coord_log = (tmp_path / "c" / "logs" / "coordinator-0.log").read_text()
    # the coordinator's side: each failed handshake counted, and said (at most once per 10 s)
    assert counted >= 3, counted  # the stranger and the two hosts
    assert "failed ZeroMQ handshakes at tcp://127.0.0.1:" in coord_log, coord_log[-3000:]
    for name, (code, log) in refused.items():
        assert code == EX_CONFIG and "cannot talk to the coordinator" in log, (name, code, log[-2000:])
        assert "the ZeroMQ handshake with it fails (HANDSHAKE_FAILED_" in log, log[-2000:]
        assert ("cluster.curve_key differs" if name == "other" else "this host's config sets none") in log, log
    assert answers["stranger"] is None  # not even an Error: its frames never reached the coordinator
    assert answers["holder"] is not None and answers["holder"].type == "JobSpec", answers
    assert [j["state"] for j in jobs] == ["done"], json.dumps(jobs)[:500]


def test_a_curve_key_that_is_not_one_is_refused_naming_how_to_make_one(tmp_path):
    from mariana.services.runtime.config import load_cluster_config
    from mariana.sparse.errors import ConfigError

    for bad in ("~" * 40, "short"):  # (not Z85; too short)
        with pytest.raises(ConfigError, match="cluster.curve_key: .*python -c"):
            load_cluster_config(overrides={"cluster.curve_key": bad}, env={})
