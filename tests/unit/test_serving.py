"""Serving below HTTP: bodies, the predictor, batches of requests, the model
registry's moves, the retrain gate and windows, the serve config."""
from __future__ import annotations

import json
import re
import os
import shutil

import msgpack
import numpy as np
import pytest

from mariana.serving import codec
from mariana.serving.config import load_serve_config
from mariana.serving.dataplane import answer_batch
from mariana.serving.errors import ServeError
from mariana.serving.predictor import Predictor, describe_bad
from mariana.serving.retrain import gate, windows
from mariana.sparse.errors import ConfigError, ModelDirError
from mariana.sparse.records import FEW_ROWS
from mariana.sparse.schema import criteo
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.config import load_config
from mariana.trainer.models.registry import dense_params

J, M = codec.JSON, codec.MSGPACK


# ---- bodies ------------------------------------------------------------------------------

@pytest.mark.parametrize("body,fmt,status,says", [
    (b"{nope", J, 400, "not valid JSON"),
    (b"\xff\xfe{}", J, 400, "not UTF-8"),
    (b'{"instances": [{"I1": NaN}]}', J, 400, "NaN is not a JSON number"),
    (b'{"instances": [{"I1": Infinity}]}', J, 400, "Infinity is not a JSON number"),
    (b"[" * 100_000 + b"]" * 100_000, J, 400, "nests too deeply"),
    (b'{"instances": [{"I1": ' + b"9" * 5000 + b"}]}", J, 400, "not valid JSON"),
    (b"[]", J, 400, "must be an object with an 'instances' array, got an array"),
    (b'"x"', J, 400, "got text"),
    (b"{}", J, 400, "has no 'instances'"),
    (b'{"instances": {"I1": 1}}', J, 400, "'instances' must be an array of objects, got an object"),
    (b'{"instances": []}', J, 400, "'instances' is empty"),
    (b'{"instances": [' + b"{}," * 10 + b"{}]}", J, 413, "11 instances in one request; at most 10"),
    (b"\xc1", M, 400, "not valid msgpack: it holds a byte that starts no msgpack value"),
    (msgpack.packb({"instances": [{}]})[:-1], M, 400, "not valid msgpack: Unpack failed: incomplete input"),
    (msgpack.packb({"instances": [{}]}) + b"\x00", M, 400, "not valid msgpack: unpack(b) received extra data"),
    (b"\x91" * 5000 + b"\xc0", M, 400, "not valid msgpack: it nests too deeply"),
    (msgpack.packb([1, 2]), M, 400, "got an array"),
])
def test_bodies_that_are_refused_say_why(body, fmt, status, says):
    with pytest.raises(ServeError) as e:
        codec.decode(body, fmt, max_instances=10)
    assert e.value.status == status and says in e.value.message, e.value.message


def test_bodies_round_trip_in_both_encodings():
    body = {"instances": [{"I1": 3, "C1": "68fd1e64", "C2": None}], "extra": 1}
    for fmt in (J, M):
        instances, extra = codec.decode(codec.encode(body, fmt), fmt, max_instances=5)
        assert instances == body["instances"] and extra == 1
    assert codec.format_of("application/msgpack") == M and codec.format_of("application/x-msgpack") == M
    assert codec.format_of("application/json") == J and codec.format_of(None) == J
    assert codec.format_of("application/x-www-form-urlencoded") == J  # curl -d: read as JSON


# ---- the predictor and batches of requests -------------------------------------------

@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Predictor:
    """A small untrained DNN (random init: pCTR varies by row), saved and loaded as a version."""
    d = tmp_path_factory.mktemp("model")
    cfg = load_config(overrides={"model.kind": "dnn", "hashing.bits": 12, "model.hidden": [8], "model.slots": 4,
                                 "hashing.numeric": "both"}, env={})
    ModelBundle(cfg, criteo()).save(str(d))
    return Predictor.load(str(d))


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{**{f"I{i}": int(rng.integers(0, 50)) for i in range(1, 14)},
             **{f"C{i}": f"{rng.integers(0, 30):08x}" for i in range(1, 27)}} for _ in range(n)]


def test_a_batch_of_requests_gets_what_each_request_gets_alone(predictor):
    reqs = [rows(1, 0), rows(5, 1), rows(3, 2)]
    together = predictor.predict_many(reqs)
    for req, answer in zip(reqs, together):
        assert answer.error is None
        np.testing.assert_allclose(answer.pctr, predictor.predict(req), rtol=0, atol=1e-6)
    assert len({round(float(p), 6) for a in together for p in a.pctr}) > 1  # rows differ, so do pCTRs
    assert all(0 < p < 1 for a in together for p in a.pctr)


def test_a_few_requests_met_before_are_answered_in_one_pass_as_alone(tmp_path):
    """Numeric fields bucketed (no dense block): once the rows have been seen, a few requests
    together take `Encoder.encode_instances`' one pass, and each gets what it gets alone, with
    its own unknown-field count."""
    cfg = load_config(overrides={"model.kind": "dnn", "hashing.bits": 12, "model.hidden": [8], "model.slots": 4,
                                 "hashing.numeric": "bucket"}, env={})
    ModelBundle(cfg, criteo()).save(str(tmp_path))
    p = Predictor.load(str(tmp_path))
    reqs = [rows(1, 0), rows(2, 1), [{**rows(1, 2)[0], "extra": 1, "more": None}]]
    alone = [p.predict_many([r])[0] for r in reqs]  # the general path remembers their values
    assert p.bundle.encoder.encode_instances([i for r in reqs for i in r]) is not None  # so these take one pass
    together = p.predict_many(reqs)
    for a, b in zip(alone, together):
        assert b.error is None and b.unknown_fields == a.unknown_fields
        np.testing.assert_allclose(b.pctr, a.pctr, rtol=0, atol=1e-6)
    assert [a.unknown_fields for a in together] == [0, 0, 2]
    assert p.predict_many([]) == []  # a batch whose bodies were all refused before the model
    items = [(b"{oops", J), (codec.encode({"instances": reqs[0]}, J), J)]
    assert [a.status for a in answer_batch(p, items[:1], 10)] == [400]
    assert [a.status for a in answer_batch(p, items, 10)] == [400, 200]


def test_many_small_requests_are_scored_in_groups_of_few_rows_each_as_alone(tmp_path, monkeypatch):
    """A call of more than FEW_ROWS rows in small requests goes in groups of up to FEW_ROWS
    rows through the one-pass path; a larger request, and a group holding an instance that
    is not plain, take the general path. Each request gets what it gets alone."""
    cfg = load_config(overrides={"model.kind": "dnn", "hashing.bits": 12, "model.hidden": [8], "model.slots": 4,
                                 "hashing.numeric": "bucket"}, env={})
    ModelBundle(cfg, criteo()).save(str(tmp_path))
    p = Predictor.load(str(tmp_path))
    bad = [{"I1": "seven"}]
    reqs = [rows(1, s) for s in range(40)] + [rows(FEW_ROWS + 4, 99), rows(3, 41), bad, rows(FEW_ROWS, 42)]
    alone = [p.predict_many([r])[0] for r in reqs]
    parsed = []
    general = p._answer_parsed
    monkeypatch.setattr(p, "_answer_parsed", lambda rs: parsed.append([len(r) for r in rs]) or general(rs))
    together = p.predict_many(reqs)
    # 40 lone requests: groups of 16, 16 and 8 rows; the 8 with the 3-row request and the bad one
    # make a group the one-pass path declines; the last 16-row request is a group of its own
    assert parsed == [[FEW_ROWS + 4] + [1] * 8 + [3, 1]]
    assert len(together) == len(reqs)
    for r, a, b in zip(reqs, alone, together):
        if r is bad:
            assert a.error is not None and b.error is not None and b.error.message == a.error.message
            continue
        assert b.error is None and b.unknown_fields == a.unknown_fields
        np.testing.assert_allclose(b.pctr, a.pctr, rtol=0, atol=1e-6)
    parsed.clear()
    assert [len(a.pctr) for a in p.predict_many([rows(1, s) for s in range(17)])] == [1] * 17
    assert parsed == []  # 17 lone requests: groups of 16 and 1, no general path


@pytest.mark.parametrize("tables", ["dense", "frozen"])
@pytest.mark.parametrize("kind", ["lr", "dnn"])
def test_a_lone_instance_is_scored_with_few_numpy_calls_as_numpy_scores_it(tmp_path, kind, tables):
    """`Predictor.predict_lone` (one plain instance: LR with no numpy call, the DNN's "dot"
    with the gather and the MLP's only) gives the pCTR the numpy path gives, to float32
    rounding, values met before or new, embedding rows trained or not, with the same
    unknown-field count; other interactions, a dense block, admission or an instance that
    is not plain take the general path (None); a request of one instance through
    `answer_batch` answers what predict_lone says. Tables dense or frozen (a saved row found in
    plain Python)."""
    rng = np.random.default_rng(7)
    cfg = load_config(overrides={"model.kind": kind, "hashing.bits": 12, "model.hidden": [16, 8],
                                 "model.embed_dim": 4}, env={})
    b = ModelBundle(cfg, criteo())
    for t in b.tables.values():
        t.weights[:] = rng.normal(0, 0.4, t.weights.shape)
        t.touched[:] = rng.random(len(t.touched)) < 0.5  # saved rows are the touched ones; others read their init
    dict(dense_params(b.model))["bias"][...] = -1.2  # numpy views of either kind's parameters
    b.save(str(tmp_path / kind))
    p = Predictor.load(str(tmp_path / kind), tables=tables)
    insts = rows(300, 3) + [{**rows(1, 4)[0], "extra": 1, "C3": None, "I2": 2.5}]
    lone = [p.predict_lone(i) for i in insts]  # the first sight of most values: hashed here
    again = [p.predict_lone(i) for i in insts]  # met before: looked up
    numpy_path = p.predict(insts)
    assert all(a is not None and a.error is None for a in lone)
    got = np.array([a.pctr[0] for a in lone])
    assert len(set(got.tolist())) > 100  # the weights make rows differ
    np.testing.assert_allclose(got, numpy_path, rtol=0, atol=1e-6)
    assert [a.pctr for a in again] == [a.pctr for a in lone]
    assert [a.unknown_fields for a in lone[-2:]] == [0, 1]
    assert p.predict_lone({"C1": [1]}) is None and p.predict_lone([1]) is None  # not plain: the general path
    (answer,) = answer_batch(p, [(codec.encode({"instances": insts[:1]}, J), J)], 10)
    assert json.loads(answer.body)["pctr"] == lone[0].pctr
    # a call of several: LR scores its one-instance requests one by one, the DNN together
    assert p.lone_requests == {"lr": 8, "dnn": 1}[kind]
    bodies = [codec.encode({"instances": insts[k:k + 1]}, J) for k in range(3)] + [
        codec.encode({"instances": insts[3:5]}, J), b"{oops"]
    answers = answer_batch(p, [(body, J) for body in bodies], 10)
    assert [a.status for a in answers] == [200] * 4 + [400]
    got = [x for a in answers[:4] for x in json.loads(a.body)["pctr"]]
    np.testing.assert_allclose(got, numpy_path[:5], rtol=0, atol=1e-6)
    if kind == "lr":
        assert got[:3] == [a.pctr[0] for a in lone[:3]]
    for overrides in ({"model.kind": "dnn", "model.interaction": "fm"},
                      {"model.kind": "dnn", "model.interaction": "proj"},
                      {"model.kind": kind, "hashing.numeric": "both"}, {"model.kind": kind, "hashing.min_count": 2}):
        other = ModelBundle(load_config(overrides={"hashing.bits": 12, "model.hidden": [8], "model.slots": 4,
                                                   **overrides}, env={}), criteo())
        assert other.lone_scorer() is None, overrides


def test_a_served_lr_model_imports_no_torch_and_a_dnn_gets_one_torch_thread(tmp_path):
    """A server's worker loads through `Predictor.load(..., torch_threads=1)`: an LR version
    never imports torch (a lighter worker: docs/benchmarks.md); a DNN
    imports it at the load, not in a request, with one intra-op thread."""
    import subprocess
    import sys

    for kind in ("lr", "dnn"):
        cfg = load_config(overrides={"model.kind": kind, "hashing.bits": 10, "model.hidden": [8], "model.slots": 4},
                          env={})
        ModelBundle(cfg, criteo()).save(str(tmp_path / kind))
    code = ("import sys\n"
            "from mariana.serving.predictor import Predictor\n"
            "p = Predictor.load(sys.argv[1], torch_threads=1)\n"
            "loaded = 'torch' in sys.modules\n"
            "p.predict([{'I1': 3, 'C1': 'ab'}] * 300)\n"  # many rows: the general path
            "print(loaded, 'torch' in sys.modules, sys.modules['torch'].get_num_threads() if loaded else 0)")
    got = {kind: subprocess.run([sys.executable, "-c", code, str(tmp_path / kind)], capture_output=True, text=True,
                                check=True, env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
           for kind in ("lr", "dnn")}
    assert got == {"lr": ["False", "False", "0"], "dnn": ["True", "True", "1"]}, got


def test_a_bad_instance_refuses_its_request_only(predictor):
    bad = rows(3) + [{"I1": "many"}, "x"]
    good, wrong, also_good = predictor.predict_many([rows(2), bad, rows(1, 5)])
    assert good.error is None and also_good.error is None and len(good.pctr) == 2 and len(also_good.pctr) == 1
    assert wrong.pctr is None and wrong.error.status == 400
    assert wrong.error.message == ("instances[3]: I1 is not a number; "
                                   "instances[4]: an instance must be an object of field values, got text")


def test_unknown_fields_are_counted_not_refused(predictor):
    (a,) = predictor.predict_many([[{"I1": 1, "nope": 2, "label": 1}, {"zzz": None}]])
    assert a.error is None and a.unknown_fields == 2 and len(a.pctr) == 2


def test_answer_batch_answers_each_body_in_its_encoding(predictor):
    items = [(codec.encode({"instances": rows(2)}, J), J),
             (b"{oops", J),
             (codec.encode({"instances": [{"C1": [True]}]}, M), M),
             (codec.encode({"instances": rows(1), "meta": 1}, M), M)]
    a = answer_batch(predictor, items, max_instances=100)
    assert [x.status for x in a] == [200, 400, 400, 200]
    assert json.loads(a[0].body)["model_version"] == predictor.version and len(json.loads(a[0].body)["pctr"]) == 2
    assert "not valid JSON" in json.loads(a[1].body)["error"]
    assert msgpack.unpackb(a[2].body)["error"] == "instances[0]: C1 must be text, a number or a boolean, got an array"
    assert len(msgpack.unpackb(a[3].body)["pctr"]) == 1 and a[3].unknown_fields == 1
    assert (a[0].instances, a[3].instances) == (2, 1)


def test_describe_bad_names_the_first_few():
    bad = [(i, "I1 is not a number") for i in range(8)]
    assert describe_bad(bad).endswith("instances[4]: I1 is not a number (and 3 more)")


# ---- the model directory's moves ----------------------------------------------------

def versions(d, n: int) -> list[str]:
    return [checkpoint.save_version(d, {"i": i}, {"w": np.zeros(1, np.float32)}, make_current=False)
            for i in range(n)]


def test_rollback_walks_back_through_the_moves(tmp_path):
    v1, v2, v3 = versions(tmp_path, 3)
    checkpoint.set_current(tmp_path, v1, reason="trained")
    checkpoint.set_current(tmp_path, v3, reason="promoted")
    checkpoint.set_current(tmp_path, v2, reason="retrain")
    assert checkpoint.rollback_target(tmp_path) == v3            # served before v2
    checkpoint.set_current(tmp_path, v3, reason="rollback")
    assert checkpoint.rollback_target(tmp_path) == v1            # and before v3
    checkpoint.set_current(tmp_path, v1, reason="rollback")
    with pytest.raises(ModelDirError, match="nothing to roll back to"):
        checkpoint.rollback_target(tmp_path)
    moves = checkpoint.promotions(tmp_path)
    assert [(m["from"], m["to"], m["reason"]) for m in moves] == [
        (None, v1, "trained"), (v1, v3, "promoted"), (v3, v2, "retrain"), (v2, v3, "rollback"),
        (v3, v1, "rollback")]


def test_rollback_without_a_record_takes_the_version_below(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    checkpoint.set_current(tmp_path, v2)  # no reason: not recorded
    assert checkpoint.promotions(tmp_path) == [] and checkpoint.rollback_target(tmp_path) == v1


def test_moves_to_versions_that_do_not_exist_are_refused(tmp_path):
    versions(tmp_path, 1)
    with pytest.raises(ModelDirError, match="no version 'v000009'"):
        checkpoint.set_current(tmp_path, "v000009", reason="promoted")
    assert not (tmp_path / "CURRENT").exists()


# ---- retrain: the gate and the windows ------------------------------------------------

def test_what_a_pruned_warm_start_ancestor_learned_is_still_known(tmp_path):
    """v3 warm-started from v2, v2 from v1, and a prune removed v1 (keep_versions with
    warm_start does it routinely): day1, which v1 learned, stopped counting as seen, and an
    eval window of it was scored on rows the served model had learned. Each warm start's
    manifest lists what its parent and theirs learned ("learned")."""
    from mariana.serving.retrain import check_unseen, learned_from

    days = [str(tmp_path / f"day{i}.tsv") for i in (1, 2, 3)]
    weights = {"w": np.zeros(2, np.float32)}
    checkpoint.save_version(tmp_path / "m", {"train": {"data": days[:1]}}, weights)
    for i in (1, 2):
        parent = checkpoint.read_manifest(tmp_path / "m", f"v00000{i}")
        checkpoint.save_version(tmp_path / "m", {"train": {"data": [days[i]]}, "parent": {
            "model_dir": str(tmp_path / "m"), "version": f"v00000{i}", "learned": checkpoint.learned_paths(parent)}},
            weights)
    shutil.rmtree(tmp_path / "m" / "v000001")
    seen = learned_from(str(tmp_path / "m"), "v000003")
    assert seen == {days[2]: "v000003", days[1]: "v000002", days[0]: "v000002"}, seen
    with pytest.raises(ConfigError, match=r"day1.tsv is in the eval window, but .*v000002, which v000003 was "
                                          r"warm-started from, learned from it"):
        check_unseen(str(tmp_path / "m"), "v000003", [days[0]])

def test_gate():
    assert gate({"auc": 0.75}, None, 0.0)[0] == "promoted"
    assert gate({"auc": 0.75}, {"auc": 0.75}, 0.0)[0] == "promoted"          # not worse is enough
    assert gate({"auc": 0.7499}, {"auc": 0.75}, 0.0)[0] == "refused"
    assert gate({"auc": 0.7499}, {"auc": 0.75}, 0.001)[0] == "promoted"
    assert gate({"auc": float("nan")}, {"auc": 0.75}, 0.0) == (
        "refused", "the new model's AUC on the eval window is undefined (the window holds one class only)")
    assert gate({"auc": 0.6}, {"auc": float("nan")}, 0.0)[0] == "promoted"


def serve_cfg(tmp_path, **retrain):
    path = tmp_path / "serve.toml"
    lines = ["[serve]", 'model_dir = "models"', "[retrain]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in retrain.items()]
    path.write_text("\n".join(lines) + "\n")
    return load_serve_config(str(path), env={})


def test_windows_are_the_newest_files_in_name_order(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for day in ("day03", "day01", "day04", "day02", "day05"):
        (logs / f"{day}.tsv").write_text("x\n")
    cfg = serve_cfg(tmp_path, data="logs/*.tsv", train_files=2, eval_files=1)   # relative to the config file
    train, evals = windows(cfg)
    assert [os.path.basename(p) for p in train] == ["day03.tsv", "day04.tsv"]
    assert [os.path.basename(p) for p in evals] == ["day05.tsv"]
    assert cfg.serve.model_dir == str(tmp_path / "models")
    with pytest.raises(ConfigError, match="matches 5 file"):
        windows(serve_cfg(tmp_path, data="logs/*.tsv", train_files=5, eval_files=1))
    with pytest.raises(ConfigError, match="retrain.data is not set"):
        windows(serve_cfg(tmp_path))
    with pytest.raises(ConfigError, match="go together"):
        windows(serve_cfg(tmp_path, train_data=["logs/day01.tsv"]))
    with pytest.raises(ConfigError, match="no such file"):
        windows(serve_cfg(tmp_path, train_data=["logs/day01.tsv"], eval_data=["logs/day09.tsv"]))
    # a candidate scored on rows it trained on passes any gate: the windows may not share a file
    with pytest.raises(ConfigError, match="windows overlap: .*day04.tsv is in train_data and in eval_data"):
        windows(serve_cfg(tmp_path, train_data=["logs/day03.tsv", "logs/day04.tsv"], eval_data=["logs/day0[45].tsv"]))


@pytest.mark.parametrize("key,value,says", [
    ("serve.port", 70000, "serve.port must be in 0..65535"),
    ("serve.max_instances", 0, "serve.max_instances must be >= 1"),
    ("serve.workers", -1, "serve.workers must be >= 0"),
    ("serve.watch_seconds", 0, "serve.watch_seconds must be > 0"),
    ("retrain.mode", "gpu", "retrain.mode must be 'local' or 'cluster'"),
    ("retrain.auc_tolerance", -0.1, "retrain.auc_tolerance must be in [0, 1)"),
    ("retrain.auc_tolerance", float("inf"), "retrain.auc_tolerance must be in [0, 1), got inf"),
    ("serve.colour", 1, "unknown key 'serve.colour'"),
    ("serve.port", "eighty", "serve.port"),
    ("serve.tables", "sparse", "serve.tables must be one of dense, frozen, auto, got 'sparse'"),
])
def test_bad_serve_config_names_the_key(key, value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_serve_config(overrides={key: value}, env={})


@pytest.mark.parametrize("inline_bytes,where", [(1 << 20, "loop"), (0, "thread")])
async def test_the_batcher_answers_on_the_loop_or_the_thread_alike(predictor, inline_bytes, where):
    """Small batches are answered on the event loop, bigger ones on the model thread;
    both give what the predictor gives."""
    import asyncio

    from mariana.serving.dataplane import Batcher

    seen = []
    batcher = Batcher(max_requests=8, max_instances=100, inline_bytes=inline_bytes,
                      on_batch=lambda n, w: seen.append((n, w)))
    batcher.start()
    try:
        reqs = [rows(1 + k % 3, k) for k in range(6)]
        answers = await asyncio.gather(*(batcher.answer(predictor, codec.encode({"instances": r}, J), J)
                                         for r in reqs))
    finally:
        await batcher.close()
    for req, a in zip(reqs, answers):
        assert a.status == 200
        np.testing.assert_allclose(json.loads(a.body)["pctr"], predictor.predict(req), rtol=0, atol=1e-6)
    assert {w for _, w in seen} == {where} and sum(n for n, _ in seen) == 6
    assert not batcher.thread.is_alive()


async def test_a_lone_request_is_answered_at_once_and_a_burst_is_batched(predictor):
    """Nothing queued: the first small request of a turn of the event loop is answered in its
    own handler; those that come in the same turn queue and are answered by one model call;
    a request in a later turn is alone again."""
    import asyncio

    from mariana.serving.dataplane import Batcher

    seen = []
    batcher = Batcher(max_requests=8, max_instances=100, inline_bytes=1 << 20,
                      on_batch=lambda n, w: seen.append((n, w)))
    batcher.start()
    try:
        reqs = [rows(1 + k % 3, k) for k in range(6)]
        burst = await asyncio.gather(*(batcher.answer(predictor, codec.encode({"instances": r}, J), J) for r in reqs))
        await asyncio.sleep(0)  # the next turn
        alone = await batcher.answer(predictor, codec.encode({"instances": reqs[0]}, J), J)
    finally:
        await batcher.close()
    assert seen == [(1, "loop"), (5, "loop"), (1, "loop")]
    for req, a in zip(reqs + reqs[:1], burst + [alone]):
        np.testing.assert_allclose(json.loads(a.body)["pctr"], predictor.predict(req), rtol=0, atol=1e-6)


def test_a_finished_retrain_not_yet_reaped_does_not_hold_the_model_dir(tmp_path):
    """bench/soak.py found it: a retrain started by one worker process, finished but not yet
    reaped (a zombie), still named in the lock file, made the other workers answer 409."""
    import subprocess
    import sys
    import time

    from mariana.serving.retrain import LOCK, running_retrain

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    (tmp_path / LOCK).write_text(f"{child.pid}\n")
    deadline = time.monotonic() + 10
    while running_retrain(str(tmp_path)) is not None and time.monotonic() < deadline:
        time.sleep(0.02)  # it exits, unreaped: a zombie
    assert running_retrain(str(tmp_path)) is None
    child.wait()
    (tmp_path / LOCK).write_text(f"{os.getpid()}\n")
    assert running_retrain(str(tmp_path)) == os.getpid()


def test_a_409_names_the_retrain_not_the_server_process_starting_it(tmp_path):
    """While a server process starts a retrain, the lock holds its own pid: a 409 named that
    pid as the retrain's (an exploratory run: 3 of 10 concurrent POSTs), and an operator who
    killed it killed a server worker."""
    from mariana.serving.retrain import RetrainBusy, take_lock, write_pid

    fd = take_lock(str(tmp_path))
    try:
        write_pid(fd, os.getpid(), starting=True)
        with pytest.raises(RetrainBusy, match=rf"\(starting: the server process pid {os.getpid()} is starting it\)"):
            take_lock(str(tmp_path))
        write_pid(fd, os.getpid())  # the retrain itself
        with pytest.raises(RetrainBusy, match=rf"running already \(pid {os.getpid()}\)$"):
            take_lock(str(tmp_path))
    finally:
        os.close(fd)


def test_a_retrain_killed_after_its_promotion_is_recorded_as_promoted(tmp_path):
    """Killed between moving CURRENT to its candidate and writing its decision: its server
    recorded "failed" while CURRENT named the candidate (a leftover of the last review)."""
    import json
    import subprocess
    import sys

    import numpy as np

    from mariana.serving.config import load_serve_config
    from mariana.serving.retrain import RUNS, RetrainRunner
    from mariana.trainer import checkpoint

    d = tmp_path / "m"
    for _ in range(2):
        checkpoint.save_version(d, {}, {"w": np.zeros(1, np.float32)}, make_current=False)
    checkpoint.set_current(d, "v000001", reason="trained")
    checkpoint.set_current(d, "v000002", reason="retrain")  # the retrain's promotion, then it was killed
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / RUNS).mkdir()
    (d / RUNS / "r20261128-000000-abcdef.json").write_text(json.dumps(
        {"id": "r20261128-000000-abcdef", "state": "evaluating", "pid": dead.pid, "served_version": "v000001",
         "new_version": "v000002", "train_data": ["a.tsv"], "eval_data": ["b.tsv"]}))
    ended = []
    runner = RetrainRunner(load_serve_config(overrides={"serve.model_dir": str(d)}, env={}), None, ended.append)
    runner.children["r20261128-000000-abcdef"] = dead
    runner.reap()
    (line,) = checkpoint.decisions(d)
    assert (line["verdict"], line["new_version"]) == ("promoted", "v000002"), line
    assert "ended after it moved CURRENT to v000002" in line["reason"], line
    assert ended == ["promoted"]
    assert runner.status("r20261128-000000-abcdef")["state"] == "done"
