"""A version whose arrays do not fit the model its manifest describes is refused at load
(`ModelBundle.load`): one ModelDirError naming the version dir and the array, never an
IndexError from numpy, nor weights silently put in the wrong rows."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mariana.sparse.errors import ConfigError, ModelDirError
from mariana.sparse.synth import generate_criteo
from mariana.sparse.table import RowIndex
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle, warm_start
from mariana.trainer.config import load_config
from mariana.trainer.strategies.local import train_local
from tests.conftest import reseal, run_cli_cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: model dir} of an LR (FTRL, hashing.min_count 2: pending counts saved), a DNN and a
    DNN with hashing.min_count 2 ("dnn-k2"), trained on 3,000 rows with 2**16 ids: every test
    corrupts a copy."""
    d = tmp_path_factory.mktemp("bundle_load")
    generate_criteo(d / "train.tsv", 3_000, seed=1)
    out = {}
    for name, kind, over in (("lr", "lr", {"hashing.min_count": 2}), ("dnn", "dnn", {}),
                             ("dnn-k2", "dnn", {"hashing.min_count": 2})):
        cfg = load_config(env={}, overrides={"model.kind": kind, "hashing.bits": 16, "train.batch_size": 512,
                                             "model.embed_dim": 4, "model.hidden": [8], **over})
        bundle = ModelBundle(cfg, cfg.data.resolve_schema())
        train_local(bundle, [str(d / "train.tsv")])
        bundle.save(str(d / name))
        out[name] = d / name
    return out


def copy(saved, kind, tmp_path):
    d = tmp_path / kind
    shutil.copytree(saved[kind], d)
    return d


def rewrite(path, edit):
    """Apply `edit` (arrays dict -> None) to a safetensors file in place."""
    arrays = {k: v.copy() for k, v in load_file(str(path)).items()}
    edit(arrays)
    save_file(arrays, str(path))
    reseal(path.parent)


def refused(d, name, with_optimizer=False):
    """The load fails with one ModelDirError naming the version dir and array `name`, and
    a server's load (frozen tables) with the same one."""
    with pytest.raises(ModelDirError) as e:
        ModelBundle.load(str(d), with_optimizer=with_optimizer)
    assert str(d / "v000001") in str(e.value) and name in str(e.value), str(e.value)
    if not with_optimizer:
        with pytest.raises(ModelDirError) as frozen:
            ModelBundle.load(str(d), tables="frozen")
        assert str(frozen.value) == str(e.value)
    return str(e.value)


def with_bits(saved, tmp_path, bits: int):
    """A copy of the LR version whose manifest says `bits` (its rows were stored at 16)."""
    d = copy(saved, "lr", tmp_path)
    path = d / "v000001" / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["config"]["hashing"]["bits"] = bits
    path.write_text(json.dumps(manifest))
    reseal(path.parent)
    return d


def test_hashing_bits_that_no_longer_fit_the_stored_rows(saved, tmp_path):
    d = with_bits(saved, tmp_path, 10)
    message = refused(d, "table.linear.rows")
    assert "< 1024" in message


def test_rows_shorter_than_the_weights(saved, tmp_path):
    d = copy(saved, "lr", tmp_path)
    rewrite(d / "v000001" / checkpoint.WEIGHTS,
            lambda a: a.update({"table.linear.rows": a["table.linear.rows"][:-5].copy()}))
    refused(d, "table.linear.rows")


def test_a_dense_parameter_of_another_shape(saved, tmp_path):
    d = copy(saved, "dnn", tmp_path)
    rewrite(d / "v000001" / checkpoint.WEIGHTS, lambda a: a.update({"dense.bias": np.zeros(3, np.float32)}))
    message = refused(d, "dense.bias")
    assert "(3,)" in message and "(1,)" in message


def test_lr_weights_of_another_width(saved, tmp_path):
    d = copy(saved, "lr", tmp_path)
    rewrite(d / "v000001" / checkpoint.WEIGHTS,
            lambda a: a.update({"table.linear.weights": np.repeat(a["table.linear.weights"], 4, axis=1)}))
    refused(d, "table.linear.weights")


def test_a_negative_row_index(saved, tmp_path):
    d = copy(saved, "lr", tmp_path)

    def negative(a):
        a["table.linear.rows"][0] = -3

    rewrite(d / "v000001" / checkpoint.WEIGHTS, negative)
    assert "-3" in refused(d, "table.linear.rows")


def _duplicate(a):
    a["table.embedding.rows"][1] = a["table.embedding.rows"][0]


def _rows_2d(a):
    a["table.linear.rows"] = a["table.linear.rows"][:, None].copy()


@pytest.mark.parametrize("edit,name", [
    (_duplicate, "table.embedding.rows"),
    (_rows_2d, "table.linear.rows"),
    (lambda a: a.update({"table.linear.rows": a["table.linear.rows"].astype(np.float64)}), "table.linear.rows"),
    (lambda a: a.update({"table.embedding.weights": a["table.embedding.weights"][:, :2].copy()}),
     "table.embedding.weights"),
    (lambda a: a.update({"table.linear.weights": a["table.linear.weights"].astype(np.int32)}),
     "table.linear.weights"),
    (lambda a: a.pop("table.embedding.weights"), "table.embedding.weights"),
    (lambda a: a.update({"dense.over_arch.0.weight": a["dense.over_arch.0.weight"].T.copy()}),
     "dense.over_arch.0.weight"),
], ids=["duplicate-row", "rows-2d", "float-rows", "embedding-width", "int-weights", "missing-weights",
        "transposed-dense"])
def test_other_arrays_that_do_not_fit(saved, tmp_path, edit, name):
    d = copy(saved, "dnn", tmp_path)
    rewrite(d / "v000001" / checkpoint.WEIGHTS, edit)
    refused(d, name)


def _pending_out_of_range(a):
    a["admission.ids"][0] = 1 << 20


@pytest.mark.parametrize("kind,edit,name", [
    ("lr", lambda a: a.update({"table.linear.z": a["table.linear.z"][:-1].copy()}), "table.linear.z"),
    ("lr", lambda a: a.pop("table.linear.n"), "table.linear.n"),
    ("lr", lambda a: a.update({"table.linear.bogus": a["table.linear.z"]}), "table.linear.bogus"),
    ("lr", lambda a: a.update({"dense.bias.sum_sq": np.zeros((1, 2), np.float32)}), "dense.bias.sum_sq"),
    ("lr", _pending_out_of_range, "admission.ids"),
    ("lr", lambda a: a.update({"admission.counts": a["admission.counts"][:-1].copy()}), "admission.counts"),
    ("dnn", lambda a: a.update({"table.embedding.sum_sq": a["table.embedding.sum_sq"][:, :1].copy()}),
     "table.embedding.sum_sq"),
    ("dnn", lambda a: a.update({"dense.over_arch.0.weight.sum_sq": np.zeros(8, np.float32)}),
     "dense.over_arch.0.weight.sum_sq"),
], ids=["short-table-state", "half-ftrl-state", "unknown-state", "dense-state-shape", "pending-id-range",
        "pending-counts-length", "embedding-state-width", "dnn-dense-state"])
def test_optimizer_state_that_does_not_fit_is_refused_for_a_warm_start(saved, tmp_path, kind, edit, name):
    """A warm start (`--init-from`) loads the optimizer state too: checked as the weights are.
    A server loads no optimizer state, so the same version still serves."""
    d = copy(saved, kind, tmp_path)
    rewrite(d / "v000001" / checkpoint.OPTIMIZER, edit)
    refused(d, name, with_optimizer=True)
    with pytest.raises(ModelDirError, match=name):
        loaded = ModelBundle.load(str(d))
        warm_start(loaded.config, loaded.schema, str(d))
    assert ModelBundle.load(str(d)).manifest["version"] == "v000001"


def test_the_cli_answers_one_line_and_exit_code_2(saved, tmp_path):
    d = with_bits(saved, tmp_path, 10)
    data = saved["lr"].parent / "train.tsv"
    [(code, err)] = run_cli_cases([["predict", "--model", d, "--data", data]])
    assert code == 2 and "Traceback" not in err and "table.linear.rows" in err, err


def _offsets_past_the_bytes(a):
    a["images.id_offsets"][-1] += 5


@pytest.mark.parametrize("edit,name", [
    (_offsets_past_the_bytes, "images.id_offsets"),
    (lambda a: a.update({"images.features": a["images.features"][:, :, None].copy()}), "images.features"),
], ids=["offsets-past-the-bytes", "features-3d"])
def test_a_creative_features_table_that_does_not_fit(tmp_path, edit, name):
    from mariana.featurizer.creatives import CreativeFeatures

    cfg = load_config(env={}, overrides={"model.kind": "lr", "hashing.bits": 12, "images.creatives": "ads"})
    images = CreativeFeatures([b"c1", b"c22"], np.array([[0.5, 1.0], [-0.5, 0.0]], np.float32))
    d = tmp_path / "m"
    ModelBundle(cfg, cfg.data.resolve_schema(), images).save(str(d))
    assert ModelBundle.load(str(d)).images.ids == [b"c1", b"c22"]
    rewrite(d / "v000001" / checkpoint.WEIGHTS, edit)
    refused(d, name)


def test_tables_bigger_than_the_machine_are_said_before_training(monkeypatch, caplog):
    """hashing.bits = 32 (LR with FTRL: 52 GiB once written) trained on a 24 GB machine without
    a word, at 20 GB resident and 275 rows/s. A local job says what its tables take and what the
    machine has (here a machine of 512 KiB: bits 16 with FTRL's z and n is 2^16 x 13 bytes)."""
    from mariana.sparse.schema import criteo
    from mariana.trainer import bundle as bundle_module

    monkeypatch.setattr(bundle_module, "machine_memory", lambda: 1 << 19)
    cfg = load_config(env={}, overrides={"model.kind": "lr", "hashing.bits": 16})
    bundle = ModelBundle(cfg, criteo())
    with caplog.at_level("WARNING", logger="mariana.trainer.bundle"):
        bundle_module.say_if_too_big(bundle)  # by run_local_job, before training
    assert "the model's tables take up to 0.8 MiB once written (hashing.bits = 16: 2^16 rows each), more than " \
           "this machine's 0.5 MiB of memory: lower hashing.bits" in caplog.text, caplog.text
    caplog.clear()
    monkeypatch.setattr(bundle_module, "machine_memory", lambda: 1 << 30)
    with caplog.at_level("WARNING", logger="mariana.trainer.bundle"):
        bundle_module.say_if_too_big(bundle)
    assert caplog.text == ""
    # a cluster job: each parameter-server shard says so of its share, on its own machine
    from mariana.trainer.strategies.ps_shard import ParamShard

    monkeypatch.setattr(bundle_module, "machine_memory", lambda: 1 << 16)
    with caplog.at_level("WARNING", logger="mariana.trainer.bundle"):
        ParamShard(cfg, criteo(), 1, 4)
    assert "parameter-server shard 1 of 4: its tables take up to 0.2 MiB once written (hashing.bits = 16: 2^16 " \
           "rows each, 16,384 here), more than this machine's 0.1 MiB of memory: lower hashing.bits or add shards" \
           in caplog.text, caplog.text
    # the service's cluster.memory_max_bytes where it is lower; the shard keeps the line for its StartJob answer
    monkeypatch.setattr(bundle_module, "machine_memory", lambda: 1 << 30)
    assert ParamShard(cfg, criteo(), 1, 4, memory_limit=1 << 30).memory_warning is None
    shard = ParamShard(cfg, criteo(), 1, 4, memory_limit=1 << 16)
    assert "16,384 here), more than its limit of 0.1 MiB (cluster.memory_max_bytes): lower" in shard.memory_warning
    assert ParamShard(cfg, criteo(), 1, 4, memory_limit=1 << 20).memory_warning is None  # 16,384 x 13 bytes fit


# ---- frozen tables: a server's, whose memory follows the rows saved -----------------------------

@pytest.mark.parametrize("kind", ["lr", "dnn", "dnn-k2"])
def test_frozen_tables_predict_what_dense_ones_do(saved, tmp_path, kind):
    """The LR and the DNN with admission (ids not saved read their field's rare row, found in
    the same pass as the rows) and the DNN without (ids not saved read their initial
    embeddings) give the same pCTRs from frozen tables as from dense ones, on every path:
    parsed blocks (evaluate), a request's rows, a lone instance, a request of many rows."""
    from mariana.serving.predictor import Predictor
    from mariana.trainer.strategies.local import evaluate

    generate_criteo(tmp_path / "test.tsv", 1_000, seed=2)  # other rows: many ids never saved
    dense = ModelBundle.load(str(saved[kind]))
    frozen = ModelBundle.load(str(saved[kind]), tables="frozen")
    assert [type(t).__name__ for t in frozen.tables.values()] == ["FrozenTable"] * len(frozen.tables)
    assert len({id(t.index) for t in frozen.tables.values()}) == 1  # the DNN's two tables share one index
    got, want = evaluate(frozen, [str(tmp_path / "test.tsv")])[0], evaluate(dense, [str(tmp_path / "test.tsv")])[0]
    assert got == want and 0.5 < got["auc"] < 1
    ids = np.random.default_rng(0).integers(0, dense.config.hashing.num_ids, (40, dense.encoder.num_fields))
    np.testing.assert_array_equal(frozen.predict_rows(ids), dense.predict_rows(ids))
    insts = [{f"I{i}": (i * k) % 7 for i in range(1, 14)} | {f"C{i}": f"{k * i:08x}" for i in range(1, 27)}
             for k in range(30)]
    p, q = Predictor.load(str(saved[kind]), tables="frozen"), Predictor.load(str(saved[kind]), tables="dense")
    requests = [[i] for i in insts]
    assert [a.pctr for a in p.predict_many(requests)] == [a.pctr for a in q.predict_many(requests)]
    np.testing.assert_array_equal(p.predict(insts), q.predict(insts))  # parsed, without distinct ids
    assert p.info()["tables"]["form"] == "frozen" and q.info()["tables"]["form"] == "dense"
    assert p.info()["tables"]["bytes"] < q.info()["tables"]["bytes"]


def test_auto_freezes_the_tables_of_a_big_table_with_few_rows(saved, tmp_path):
    """The same 3,000-row LR: dense at bits 16 (512 KiB), frozen at bits 26 (320 MiB dense);
    "frozen" and "dense" are obeyed whatever the size; anything else is refused."""
    assert ModelBundle.load(str(saved["lr"]), tables="auto").tables["linear"].__class__.__name__ == "HashedTable"
    d = with_bits(saved, tmp_path, 26)
    assert ModelBundle.load(str(d), tables="auto").tables["linear"].__class__.__name__ == "FrozenTable"
    assert ModelBundle.load(str(d), tables="dense").tables["linear"].__class__.__name__ == "HashedTable"
    with pytest.raises(ConfigError, match="tables must be one of dense, frozen, auto, got 'sparse'"):
        ModelBundle.load(str(d), tables="sparse")


def test_a_row_index_finds_each_id_whatever_their_slots():
    """Ids that all share a slot (a probe run the length of the table, wrapping past its end),
    random ones, none: each saved id's row, n for the others, in numpy and in plain Python."""
    rng = np.random.default_rng(3)
    for ids in (np.arange(1, 40) << 20 | 127, np.unique(rng.integers(0, 1 << 30, 5_000)), np.array([], np.int64),
                rng.permutation(200) * 64 + 63):
        ix = RowIndex(ids)
        row = {int(i): r for r, i in enumerate(ids)}
        queries = np.concatenate([ids, rng.integers(0, 1 << 30, 300), ids[::-1] + 1]).astype(np.int64)
        want = [row.get(int(q), len(ids)) for q in queries]
        assert ix.positions(queries).tolist() == want
        assert ix.positions(queries[:50]).tolist() == want[:50]  # a request's few ids: found in plain Python
        assert ix.positions(queries.reshape(-1, 1)).shape == (len(queries), 1)
        assert ix.rows_of(queries.tolist()) == want
        assert ix.holds(ids) and (len(ids) < 2 or not ix.holds(ids[::-1]))
        assert (ix.keys != -1).sum() == len(ids) and len(ix.keys) >= 2 * len(ids)


def test_a_big_table_takes_memory_by_the_small_page_written():
    """numpy maps big arrays in 2 MiB pages (MADV_HUGEPAGE): 20,000 ids written into a 2^28-row
    table took 1.06 GB. A HashedTable's arrays are mapped in 4 KiB pages (`sparse_zeros`): ~80 MB."""
    from mariana.services.runtime.memwatch import rss_bytes
    from mariana.sparse.table import HashedTable

    before = rss_bytes()
    t = HashedTable("linear", 1 << 28, 1)
    rows = np.unique(np.random.default_rng(0).integers(0, 1 << 28, 20_000))
    t.materialize(rows)
    t.weights[rows] = 1.0
    t.state_array("acc")[rows] = 0.5
    grown = (rss_bytes() - before) / (1 << 20)
    assert grown < 400, f"{grown:.0f} MB for 20,000 rows of three arrays"  # 2 MiB pages: ~2.3 GB
    assert float(t.weights.sum()) == len(rows) and t.touched.sum() == len(rows)
