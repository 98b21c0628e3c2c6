"""Frequency-based admission (hashing.min_count = K): ids seen fewer than K
times train and read their field's rare row, never a row of their own;
K = 1 and versions saved before the key existed are exactly what they were."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mariana.serving.predictor import Predictor
from mariana.sparse import admission
from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import ConfigError, DataFormatError
from mariana.sparse.hashing import INT_SALT, MISSING_SALT, RARE, RARE_SALT, HashSpec, rare_ids, token_id
from mariana.sparse.schema import Schema
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.config import load_config
from mariana.trainer.data import BatchStream
from mariana.trainer.strategies.local import local_step
from mariana.trainer.strategies.ps_shard import ParamShard
from mariana.trainer.strategies.ps_step import compute_grads

BITS = 12
SCHEMA = Schema.from_dict({"name": "t", "columns": ["y", "a", "b"], "label": "y", "categorical": ["a", "b"],
                           "delimiter": ","})
RARE_A, RARE_B = (token_id(f, RARE, BITS) for f in ("a", "b"))


def ida(v: str) -> int:
    return token_id("a", v.encode(), BITS)


def idb(v: str) -> int:
    return token_id("b", v.encode(), BITS)


def config(k: int, kind: str = "lr", **more):
    return load_config(overrides={"hashing.bits": BITS, "hashing.min_count": k, "model.kind": kind,
                                  "model.embed_dim": 2, "model.hidden": [4], "model.slots": 2, **more}, env={})


def bundle(k: int, kind: str = "lr") -> ModelBundle:
    return ModelBundle(config(k, kind), SCHEMA)


def rows(*pairs: tuple[str, str], labels=None) -> SparseBatch:
    """A batch of (a, b) values, as the encoder hashes them."""
    ids = np.array([[ida(a), idb(b)] for a, b in pairs], np.int64)
    y = np.asarray(labels if labels is not None else [i % 2 for i in range(len(pairs))], np.float32)
    return SparseBatch.from_fixed(ids, num_ids=1 << BITS, labels=y)


def test_values_used_here_do_not_collide_with_the_rare_ids():
    used = {ida(v) for v in ("w", "x", "y", "z", "new", "never")} | {idb(v) for v in ("u", "v", "s", "t", "newer",
                                                                                   "seen", "never")}
    assert len(used) == 13 and not used & {RARE_A, RARE_B} and RARE_A != RARE_B


# ---- config and the reserved token -----------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 65536, 2.5, True, "3"])
def test_min_count_must_be_an_integer_from_1_to_65535(value):
    with pytest.raises(ConfigError, match="hashing.min_count"):
        load_config(overrides={"hashing.min_count": value}, env={})


def test_min_count_defaults_to_1_and_is_recorded_in_the_config():
    assert load_config(env={}).hashing.min_count == 1
    assert config(3).to_dict()["hashing"]["min_count"] == 3
    assert HashSpec(min_count=65535).min_count == 65535


def test_the_rare_token_is_no_value_a_record_can_hold():
    bits = 32  # unmasked as far as ids go: distinct tokens, distinct ids
    rare = token_id("C1", RARE, bits)
    assert rare == int(rare_ids(["C1"], HashSpec(bits=bits))[0])
    assert rare not in {token_id("C1", v, bits) for v in (None, b"", b"rare", b"RARE", b"<rare>", b"0", 0, -1)}
    assert rare != token_id("C2", RARE, bits)  # one per field
    # fmix64 is a bijection: exactly one integer token hashes to RARE_SALT. It is no bucket or hour.
    m, inv1, inv2 = (1 << 64) - 1, pow(0xFF51AFD7ED558CCD, -1, 1 << 64), pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)
    h = int(RARE_SALT)
    h ^= h >> 33
    h = (h * inv2) & m
    h ^= h >> 33
    h = (h * inv1) & m
    h ^= h >> 33
    v = h ^ int(INT_SALT)
    v = v - (1 << 64) if v >= 1 << 63 else v
    assert token_id("C1", v, bits) == rare and abs(v) > 1 << 62
    assert RARE_SALT != MISSING_SALT


# ---- the pure functions ------------------------------------------------------------------


def test_admit_counts_ids_and_redirects_those_under_k_to_their_fields_rare_id():
    counts, touched = admission.Counts(1 << BITS, min_count=3), np.zeros(1 << BITS, bool)
    rare = np.array([RARE_A, RARE_B])
    b = rows(("w", "u"), ("w", "v"), ("x", "u"))  # w: 2, x: 1, u: 2, v: 1
    out = admission.admit(b, counts, touched, rare)
    assert out.ids.reshape(3, 2).tolist() == [[RARE_A, RARE_B]] * 3
    assert b.ids.reshape(3, 2)[0].tolist() == [ida("w"), idb("u")]  # the input batch is left alone
    assert counts.get(np.array([ida("w"), ida("x"), idb("u"), idb("v")])).tolist() == [2, 1, 2, 1]
    out = admission.admit(rows(("w", "v"), ("x", "s")), counts, touched, rare)  # w reaches 3 with this batch
    assert out.ids.reshape(2, 2).tolist() == [[ida("w"), RARE_B], [RARE_A, RARE_B]]
    uniq, inverse = out.unique()
    assert np.array_equal(uniq[inverse], out.ids) and len(set(uniq.tolist())) == len(uniq)
    assert sorted(uniq.tolist()) == sorted([ida("w"), RARE_A, RARE_B])


def test_an_id_with_a_row_is_admitted_whatever_its_count():
    counts, touched = admission.Counts(1 << BITS, min_count=3), np.zeros(1 << BITS, bool)
    touched[ida("w")] = True  # e.g. a warm start's row
    out = admission.admit(rows(("w", "u")), counts, touched, np.array([RARE_A, RARE_B]))
    assert out.ids.tolist() == [ida("w"), RARE_B]


def test_redirect_pulls_each_id_once_when_a_rare_id_is_also_an_id_of_the_batch():
    # ids 5, 6, 7; field 1's rare id is 5 (an admitted id of field 0), both rare ids are 9
    b = SparseBatch.from_fixed(np.array([[5, 6], [7, 6], [5, 8]]), num_ids=16)
    uniq = b.unique()[0]
    for rare in (np.array([9, 5]), np.array([9, 9])):
        ok = np.isin(uniq, [5])  # 6, 7, 8 not admitted
        out, src = admission.redirect(b, ok, rare)
        assert out.ids.reshape(3, 2).tolist() == [[5, rare[1]], [9, rare[1]], [5, rare[1]]]
        new_uniq, inverse = out.unique()
        assert sorted(new_uniq.tolist()) == sorted({5, 9, int(rare[1])})
        assert np.array_equal(new_uniq[inverse], out.ids)
        assert np.array_equal(np.concatenate([uniq, rare])[src], new_uniq)


def test_redirect_of_a_csr_batch_uses_each_entrys_field():
    b = SparseBatch(ids=np.array([1, 2, 3, 2], np.int64), indptr=np.array([0, 3, 4], np.int64),
                    fields=np.array([0, 0, 1, 1], np.int32), num_fields=2, num_ids=16,
                    values=np.array([1, 2, 3, 4], np.float32), labels=np.ones(2, np.float32))
    uniq = b.unique()[0]
    out, _ = admission.redirect(b, uniq == 1, np.array([14, 15]))
    assert out.ids.tolist() == [1, 14, 15, 15] and out.values.tolist() == [1, 2, 3, 4]
    assert np.array_equal(out.indptr, b.indptr) and not out.fixed_width


def test_all_admitted_is_the_same_batch():
    b = rows(("w", "u"))
    out, src = admission.redirect(b, np.ones(2, bool), np.array([RARE_A, RARE_B]))
    assert out is b and src.tolist() == [0, 1]


def test_counts_saturate_and_keep_only_pending_ids_in_checkpoints():
    c = admission.Counts(8, min_count=3)
    assert c._n is None and len(c.pending(np.zeros(8, bool))) == 0  # allocated on first count
    c.add(np.array([1, 2]), np.array([70000, 1]))
    c.add(np.array([1, 4]), np.array([5, 2]))
    assert c.get(np.array([1, 2, 4])).tolist() == [65535, 1, 2]
    touched = np.zeros(8, bool)
    touched[1] = True
    arrays = admission.to_arrays(c, touched)
    assert arrays[admission.IDS_KEY].tolist() == [2, 4] and arrays[admission.COUNTS_KEY].tolist() == [1, 2]
    d = admission.Counts(8, min_count=3)
    admission.load_arrays(d, arrays)
    assert d.get(np.arange(8)).tolist() == [0, 0, 1, 0, 2, 0, 0, 0]


# ---- local training and prediction ---------------------------------------------------------


def train(b: ModelBundle, batches: list[SparseBatch], epochs: int = 1) -> None:
    for _ in range(epochs):
        for batch in batches:
            local_step(b, batch)


DATA = [rows(("w", "u"), ("w", "v"), ("x", "u"), ("y", "s"), labels=[1, 0, 1, 1]),
        rows(("w", "u"), ("x", "v"), ("z", "t"), ("w", "u"), labels=[0, 1, 0, 1])]
# counts after both: w 4, x 2, y 1, z 1; u 4, v 2, s 1, t 1


def test_with_k3_an_id_seen_twice_has_no_row_and_predicts_as_its_fields_rare_row():
    b = bundle(3)
    train(b, DATA)
    t = b.tables["linear"]
    assert t.touched[[ida("w"), idb("u"), RARE_A, RARE_B]].all()
    assert not t.touched[[ida("x"), ida("y"), ida("z"), idb("v"), idb("s"), idb("t")]].any()
    assert b.counts.get(np.array([ida("x"), idb("v"), ida("y")])).tolist() == [2, 2, 1]
    seen_twice, never_seen = b.predict(rows(("x", "v"))), b.predict(rows(("never", "seen")))
    as_rare = b.predict(SparseBatch.from_fixed(np.array([[RARE_A, RARE_B]]), num_ids=1 << BITS))
    assert seen_twice == as_rare and never_seen == as_rare
    assert b.predict(rows(("w", "v"))) != as_rare  # w has a row of its own
    # the same without admission: x and v have rows and predict otherwise
    off = bundle(1)
    train(off, DATA)
    assert off.tables["linear"].touched[[ida("x"), idb("v")]].all()
    assert off.predict(rows(("x", "v"))) != seen_twice


def test_the_rare_row_trains():
    b = bundle(3, "dnn")
    before = {n: t.lookup(np.array([RARE_A, RARE_B])) for n, t in b.tables.items()}
    train(b, DATA)
    for name, t in b.tables.items():
        assert t.touched[[RARE_A, RARE_B]].all()
        assert not np.array_equal(t.weights[[RARE_A, RARE_B]], before[name]), name
        key = "n" if name == "linear" else "sum_sq"  # FTRL's and AdaGrad's sums of squared gradients
        assert (t.state_array(key)[[RARE_A, RARE_B]] > 0).all(), name


def test_the_third_occurrence_admits_an_id_in_a_later_epoch():
    b = bundle(3)
    train(b, DATA, epochs=2)  # x: 2 in epoch 1, its third occurrence is in epoch 2
    assert b.tables["linear"].touched[[ida("x"), idb("v")]].all()
    assert not b.tables["linear"].touched[[ida("y"), ida("z")]].any()  # 2 each after two epochs


def test_predict_reads_rare_rows_alike_on_the_few_rows_path_and_the_unique_path():
    b = bundle(3, "dnn")
    train(b, DATA)
    pairs = [("w", "u"), ("x", "v"), ("never", "u"), ("y", "never")] * 700  # 5,600 entries: the unique path
    big = rows(*pairs)
    assert big.nnz > 4096 and big._unique is None
    whole = b.predict(big)
    few = np.concatenate([b.predict(rows(*pairs[i:i + 4])) for i in range(0, 8, 4)])
    np.testing.assert_array_equal(whole[:8], few)
    sliced = np.concatenate([b.predict(part) for part in big.split(1000)])  # evaluate's slices
    np.testing.assert_array_equal(whole, sliced)


def reference_step(b: ModelBundle, batch: SparseBatch) -> None:
    """local_step as it was before admission existed."""
    uniq, inverse = batch.unique()
    pulled = {name: t.gather(uniq) for name, t in b.tables.items()}
    result = compute_grads(b.model, batch, inverse, pulled)
    for name, grads in result.row_grads.items():
        b.optimizers[name].apply(b.tables[name], uniq, grads, unique=True)
    b.dense_opt.apply(result.dense_grads)


@pytest.mark.parametrize("kind", ["lr", "dnn"])
def test_k1_trains_and_predicts_bit_identically_to_the_step_without_admission(gen_files, kind, tmp_path):
    cfg = load_config(overrides={"hashing.bits": 16, "model.kind": kind, "model.embed_dim": 4, "model.hidden": [8],
                                 "train.batch_size": 2048}, env={})
    assert cfg.hashing.min_count == 1
    schema = cfg.data.resolve_schema()
    new, old = ModelBundle(cfg, schema), ModelBundle(cfg, schema)
    assert new.rare is None and new.counts is None
    stream = BatchStream([str(gen_files["train"])], new.encoder, 1 << 20, 2, False, labeled=True, batch_rows=2048)
    for batch in stream:
        torch.manual_seed(0)
        local_step(new, batch)
        torch.manual_seed(0)
        reference_step(old, batch)
    test = next(iter(BatchStream([str(gen_files["test"])], new.encoder, 1 << 20, 2, False, labeled=True)))
    p = new.predict(test)
    assert np.array_equal(p, old.predict(test))
    for name in new.tables:
        assert np.array_equal(new.tables[name].touched, old.tables[name].touched)

    # saved with K = 1: no counts; saved before min_count existed: loads and predicts the same
    version = new.save(str(tmp_path / "m"))
    _, _, optim = checkpoint.load_version(tmp_path / "m", version, with_optimizer=True)
    assert not any(k.startswith("admission.") for k in optim)
    manifest_path = tmp_path / "m" / version / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["config"]["hashing"]["min_count"]
    del manifest["sha256"]  # (nor were digests recorded then)
    manifest_path.write_text(json.dumps(manifest))
    loaded = ModelBundle.load(str(tmp_path / "m"))
    assert loaded.rare is None
    assert np.array_equal(loaded.predict(test), p)
    few = test.slice(0, 20)  # the few-rows path
    assert np.array_equal(loaded.predict(few), new.predict(few))


def test_a_saved_k3_version_serves_unseen_and_unadmitted_values_from_the_rare_row(tmp_path):
    b = bundle(3, "dnn")
    train(b, DATA)
    version = b.save(str(tmp_path / "m"))
    manifest, weights, optim = checkpoint.load_version(tmp_path / "m", version, with_optimizer=True)
    assert manifest["config"]["hashing"]["min_count"] == 3
    assert sorted(weights["table.linear.rows"].tolist()) == sorted([ida("w"), idb("u"), RARE_A, RARE_B])
    pending = dict(zip(optim[admission.IDS_KEY].tolist(), optim[admission.COUNTS_KEY].tolist()))
    assert pending == {ida("x"): 2, ida("y"): 1, ida("z"): 1, idb("v"): 2, idb("s"): 1, idb("t"): 1}

    p = Predictor.load(str(tmp_path / "m"))
    got = p.predict([{"a": "x", "b": "v"}, {"a": "new", "b": "newer"}, {"a": "w", "b": "u"}, {}])
    as_rare = b.predict(SparseBatch.from_fixed(np.array([[RARE_A, RARE_B]]), num_ids=1 << BITS))
    assert got[0] == got[1] == as_rare[0]
    assert got[2] == b.predict(rows(("w", "u")))[0] and got[2] != got[0]
    assert got[3] == as_rare[0]  # missing values: never seen in training either

    warm = ModelBundle.load(str(tmp_path / "m"), with_optimizer=True)  # the pending counts come with it
    train(warm, [rows(("x", "s"))])  # x: 2 + 1 = 3, admitted; s: 1 + 1 = 2, not
    assert warm.tables["linear"].touched[ida("x")] and not warm.tables["linear"].touched[idb("s")]


# ---- the parameter-server shard --------------------------------------------------------------


def shard(k: int, s: int = 0, n: int = 1) -> ParamShard:
    return ParamShard(config(k, "dnn"), SCHEMA, shard=s, num_shards=n)


def test_a_shard_admits_on_pull_counts_once_per_step_and_restores_its_counts():
    sh = shard(3)
    ids = np.array([ida("w"), ida("x"), RARE_A], np.int64)
    rows, ok = sh.gather_admitted(ids, np.array([3, 1, 0], np.uint32))
    assert ok.tolist() == [True, False, False]
    assert sh.touched[ids].tolist() == [True, False, False]  # the pull materializes admitted ids only
    assert np.array_equal(rows["embedding"], sh.tables["embedding"].lookup(ids))
    grads = {"linear": np.ones((2, 1), np.float32), "embedding": np.ones((2, 2), np.float32)}
    push = ("e1/c:0", 4, np.array([ida("w"), RARE_A]), grads, None, (np.array([ida("x")]), np.array([2], np.uint32)))
    assert sh.push(*push) and not sh.push(*push)  # the replay counts nothing
    assert sh.counts.get(np.array([ida("x")])).tolist() == [2]
    assert sh.touched[RARE_A]
    _, ok = sh.gather_admitted(np.array([ida("x")]), np.array([1], np.uint32))
    assert ok.tolist() == [True]

    sh2 = shard(3)
    sh.push("e1/c:1", 1, np.zeros(0, np.int64), {}, None, (np.array([ida("y")]), np.array([1], np.uint32)))
    arrays, manifest = sh.snapshot()
    assert dict(zip(arrays[admission.IDS_KEY].tolist(), arrays[admission.COUNTS_KEY].tolist())) == {ida("y"): 1}
    sh2.restore(arrays, manifest)
    assert sh2.counts.get(np.array([ida("y")])).tolist() == [1]
    with pytest.raises(DataFormatError):
        shard(1).gather_admitted(ids, np.zeros(3, np.uint32))
    with pytest.raises(DataFormatError):
        sh.gather_admitted(ids, np.zeros(2, np.uint32))


def test_a_step_issued_again_after_its_push_admits_nothing_new():
    """Its lease lapsed after the push: the pull of the repeat carries the same occurrences,
    which that push counted already; with them x (counted 2, K = 3) would get a row that
    local training never gives it. The repeat's push is ignored, so the row would stay."""
    sh = shard(3)
    x = np.array([ida("x")])
    _, ok = sh.gather_admitted(x, np.array([2], np.uint32), step="e1/c:0")
    assert ok.tolist() == [False]
    assert sh.push("e1/c:0", 2, np.zeros(0, np.int64), {}, None, (x, np.array([2], np.uint32)))
    rows, ok = sh.gather_admitted(x, np.array([2], np.uint32), step="e1/c:0")  # the same step again
    assert ok.tolist() == [False] and not sh.touched[x].any()
    assert np.array_equal(rows["embedding"], sh.tables["embedding"].lookup(x))
    assert not sh.push("e1/c:0", 2, np.zeros(0, np.int64), {}, None, (x, np.array([2], np.uint32)))
    assert sh.counts.get(x).tolist() == [2]
    _, ok = sh.gather_admitted(x, np.array([1], np.uint32), step="e1/c:1")  # a new step: the third occurrence
    assert ok.tolist() == [True] and sh.touched[x].all()
    _, ok = sh.gather_admitted(x, np.array([2], np.uint32), step="e1/c:0")  # a repeat reads rows that exist
    assert ok.tolist() == [True]


def ps_train(shards: list[ParamShard], b: ModelBundle, batches: list[SparseBatch]) -> None:
    """One worker's steps in strict order, as services/worker.py does them, in process:
    pull the batch's ids and every rare id with occurrences, redirect, push grads and counts."""
    n = len(shards)
    for step, batch in enumerate(batches):
        uniq, inverse = batch.unique()
        occ = np.bincount(inverse, minlength=len(uniq)).astype(np.uint32)
        ids = np.concatenate([uniq, b.rare])
        occ = np.concatenate([occ, np.zeros(len(b.rare), np.uint32)])
        rows = {name: np.zeros((len(ids), t.dim), np.float32) for name, t in b.tables.items()}
        ok = np.zeros(len(ids), bool)
        for s, sh in enumerate(shards):
            sel = np.flatnonzero(ids % n == s)
            got, ok[sel] = sh.gather_admitted(sh.local_rows(ids[sel]), occ[sel])
            for name in rows:
                rows[name][sel] = got[name]
        ok = ok[:len(uniq)]
        red, src = admission.redirect(batch, ok, b.rare)
        new_uniq, new_inverse = red.unique()
        result = compute_grads(b.model, red, new_inverse, {k: v[src] for k, v in rows.items()})
        for s, sh in enumerate(shards):
            sel, seen = np.flatnonzero(new_uniq % n == s), np.flatnonzero((uniq % n == s) & ~ok)
            sh.push(f"e1/c:{step}", batch.num_rows, new_uniq[sel], {k: g[sel] for k, g in result.row_grads.items()},
                    None, (uniq[seen], occ[seen]))
        b.dense_opt.apply(result.dense_grads)  # the dense part lives in this bundle here


def test_two_shards_admit_exactly_the_ids_local_training_admits():
    local, remote = bundle(3, "dnn"), bundle(3, "dnn")
    shards = [shard(3, 0, 2), shard(3, 1, 2)]
    assert RARE_A % 2 != RARE_B % 2 or ida("w") % 2 != RARE_A % 2  # some rare row lives on another shard
    data = DATA + [rows(("x", "s"), ("y", "t"), ("new", "u"))]
    train(local, data)
    ps_train(shards, remote, data)
    admitted = set()
    for sh in shards:
        admitted |= set(sh.table0.global_ids(sh.table0.touched_rows()).tolist())
    assert admitted == set(local.tables["linear"].touched_rows().tolist())
    assert admitted == {ida("w"), ida("x"), idb("u"), RARE_A, RARE_B}
    for sh in shards:
        for name, t in sh.tables.items():
            have = t.touched_rows()
            np.testing.assert_array_equal(t.weights[have], local.tables[name].weights[t.global_ids(have)])
    pending = {}
    for sh in shards:
        arrays, _ = sh.snapshot()
        pending.update(zip(arrays[admission.IDS_KEY].tolist(), arrays[admission.COUNTS_KEY].tolist()))
    local_pending = admission.to_arrays(local.counts, local.touched)
    assert pending == dict(zip(local_pending[admission.IDS_KEY].tolist(),
                               local_pending[admission.COUNTS_KEY].tolist()))
