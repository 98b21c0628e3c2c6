"""One parameter-server shard: the id partition, pushes applied once, the
same math as one whole table, snapshots that restore exactly."""
from __future__ import annotations

import numpy as np
import pytest

from mariana.sparse.errors import DataFormatError
from mariana.sparse.schema import criteo
from mariana.sparse.table import init_rows
from mariana.trainer.config import load_config
from mariana.trainer.strategies.ps_shard import ParamShard

NUM_IDS = 1 << 10
EMBED = 2
INIT = 0.05
LR, EMBED_LR, DENSE_LR, ACC = 0.1, 0.2, 0.02, 0.1


def config():
    return load_config(overrides={"hashing.bits": 10, "model.kind": "dnn", "model.embed_dim": EMBED,
                                  "model.hidden": [4], "model.slots": 2, "model.init_scale": INIT,
                                  "model.seed": 3, "optim.lr": LR, "optim.embed_lr": EMBED_LR,
                                  "optim.dense_lr": DENSE_LR, "optim.initial_accumulator": ACC,
                                  "optim.linear": "adagrad"}, env={})  # the AdaGrad steps checked below


def shard(s: int = 0, n: int = 1) -> ParamShard:
    return ParamShard(config(), criteo(), shard=s, num_shards=n)


EVEN = np.array([0, 2, 10, 1022], np.int64)
ODD = np.array([1, 3, 11, 1023], np.int64)
ALL = np.concatenate([EVEN, ODD])


def grads_for(ids: np.ndarray, scale: float = 1.0) -> dict[str, np.ndarray]:
    """A gradient row per id that depends only on the id, so any subset agrees."""
    g = ids.astype(np.float32)[:, None]
    return {"linear": (scale * (g % 7 - 3)).astype(np.float32),
            "embedding": (scale * np.hstack([g % 5 - 2, 1 - g % 3])).astype(np.float32)}


def subset(rows: dict[str, np.ndarray], ids: np.ndarray, of: np.ndarray) -> dict[str, np.ndarray]:
    pos = [int(np.flatnonzero(ids == i)[0]) for i in of]
    return {k: v[pos] for k, v in rows.items()}


def test_layout():
    one, s0, s1 = shard(), shard(0, 2), shard(1, 2)
    assert set(one.tables) == {"linear", "embedding"}
    assert {n: (t.num_rows, t.dim) for n, t in one.tables.items()} == {"linear": (1024, 1), "embedding": (1024, 2)}
    assert {n: t.num_rows for n, t in s0.tables.items()} == {"linear": 512, "embedding": 512}
    assert {n: t.num_rows for n, t in s1.tables.items()} == {"linear": 512, "embedding": 512}
    assert one.dense.size > 0 and s0.dense.shape == one.dense.shape and s1.dense.shape == (0,)
    assert np.array_equal(s0.dense, one.dense)
    assert {n: t.num_rows for n, t in shard(2, 3).tables.items()} == {"linear": 341, "embedding": 341}
    with pytest.raises(ValueError):
        shard(2, 2)


# ---- (a) the partition does not change initial rows --------------------------------------


def test_pull_by_parity_equals_one_shard():
    one, s0, s1 = shard(), shard(0, 2), shard(1, 2)
    whole = one.pull(ALL)
    assert whole["embedding"].shape == (8, EMBED) and whole["linear"].shape == (8, 1)
    assert not whole["linear"].any()                         # linear weights start at 0
    assert np.array_equal(whole["embedding"], init_rows(ALL, EMBED, INIT, seed=3))
    assert np.abs(whole["embedding"]).max() <= INIT and whole["embedding"].std() > 0
    for part, ids in ((s0, EVEN), (s1, ODD)):
        got = part.pull(ids)
        want = subset(whole, ALL, ids)
        assert set(got) == set(want)
        for name in want:
            assert np.array_equal(got[name], want[name]), name


def test_pull_is_deterministic_and_does_not_alias_weights():
    a, b = shard(1, 2), shard(1, 2)
    first = a.pull(ODD)
    first["embedding"][:] = 9.0
    assert np.array_equal(a.pull(ODD)["embedding"], b.pull(ODD)["embedding"])
    assert not (a.pull(ODD)["embedding"] == 9.0).any()


def test_pull_of_no_ids():
    rows = shard(0, 2).pull(np.zeros(0, np.int64))
    assert rows["embedding"].shape == (0, EMBED) and rows["linear"].shape == (0, 1)


# ---- (b) ids that are not this shard's ---------------------------------------------------


@pytest.mark.parametrize("s,ids", [(0, [1]), (0, [0, 2, 3]), (1, [0]), (1, [1, 1022])])
def test_ids_of_the_other_shard(s, ids):
    with pytest.raises(DataFormatError, match="another shard"):
        shard(s, 2).pull(np.array(ids, np.int64))


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("ids", [[1024], [-1], [0, 2048], [-2, 0]])
def test_ids_out_of_range(n, ids):
    with pytest.raises(DataFormatError, match=r"\[0, 1024\)"):
        shard(0, n).pull(np.array(ids, np.int64))


def test_push_of_another_shards_ids_changes_nothing():
    s0 = shard(0, 2)
    before = s0.pull(EVEN)
    with pytest.raises(DataFormatError):
        s0.push("e1/a:0", 4, ODD, grads_for(ODD), None)
    assert s0.applied == {}
    after = s0.pull(EVEN)
    assert all(np.array_equal(before[k], after[k]) for k in before)


# ---- (c) a step is applied once -------------------------------------------------------------


def test_push_applies_once():
    s = shard()
    before = s.pull(EVEN)
    dense_before = s.dense.copy()
    dense_grad = np.full(s.dense.shape, 0.5, np.float32)
    assert s.push("e1/f0o0:0", 4, EVEN, grads_for(EVEN), dense_grad)
    after = s.pull(EVEN)
    # AdaGrad's first step: w -= lr * g / sqrt(g^2 + acc)
    g = grads_for(EVEN)
    assert np.allclose(after["linear"], before["linear"] - LR * g["linear"] / np.sqrt(g["linear"] ** 2 + ACC))
    assert np.allclose(after["embedding"],
                       before["embedding"] - EMBED_LR * g["embedding"] / np.sqrt(g["embedding"] ** 2 + ACC))
    assert np.allclose(s.dense, dense_before - DENSE_LR * 0.5 / np.sqrt(0.25 + ACC))
    assert s.applied == {"e1/f0o0:0": 4}

    dense_after = s.dense.copy()
    assert not s.push("e1/f0o0:0", 4, EVEN, grads_for(EVEN, scale=3.0), dense_grad)
    again = s.pull(EVEN)
    assert all(np.array_equal(after[k], again[k]) for k in after)
    assert np.array_equal(s.dense, dense_after)
    assert s.applied == {"e1/f0o0:0": 4}

    assert s.push("e2/f0o0:0", 4, EVEN, grads_for(EVEN), None)   # a new step does apply
    assert not np.array_equal(s.pull(EVEN)["linear"], after["linear"])
    assert np.array_equal(s.dense, dense_after)                   # no dense grads sent


# ---- (d) the same math on S = 1 and S = 2 -----------------------------------------------------


def test_two_shards_match_one_after_pushes():
    one, s0, s1 = shard(), shard(0, 2), shard(1, 2)
    dense_grads = [np.linspace(-1, 1, one.dense.size, dtype=np.float32),
                   np.linspace(2, 0, one.dense.size, dtype=np.float32)]
    # two steps on overlapping ids, so the accumulated optimizer state matters
    for step, ids, scale, dg in (("e1/c:0", ALL, 1.0, dense_grads[0]),
                                 ("e1/c:1", np.array([0, 1, 2, 1023], np.int64), -2.0, dense_grads[1])):
        assert one.push(step, len(ids), ids, grads_for(ids, scale), dg)
        for part, s in ((s0, 0), (s1, 1)):
            mine = ids[ids % 2 == s]
            assert part.push(step, len(ids), mine, grads_for(mine, scale), dg if s == 0 else None)
    whole = one.pull(ALL)
    for part, ids in ((s0, EVEN), (s1, ODD)):
        got, want = part.pull(ids), subset(whole, ALL, ids)
        for name in want:
            assert np.allclose(got[name], want[name], rtol=0, atol=1e-7), name
    assert not np.array_equal(whole["embedding"], init_rows(ALL, EMBED, INIT, seed=3))
    assert np.array_equal(s0.dense, one.dense)
    assert s1.dense.shape == (0,)
    assert set(s0.applied) == set(s1.applied) == set(one.applied) == {"e1/c:0", "e1/c:1"}


def test_dense_grads_sent_to_shard_one_are_refused():
    s1 = shard(1, 2)
    with pytest.raises(DataFormatError, match="dense"):
        s1.push("e1/c:0", 1, ODD, grads_for(ODD), np.zeros(92, np.float32))
    assert s1.applied == {}


# ---- (e) snapshots ---------------------------------------------------------------------------


def trained(s: int, n: int) -> ParamShard:
    p = shard(s, n)
    ids = EVEN if s == 0 else ODD
    if n == 1:
        ids = ALL
    dg = np.linspace(-1, 1, p.dense.size, dtype=np.float32) if p.dense.size else None
    p.push("e1/c:0", 5, ids, grads_for(ids), dg)
    p.push("e1/c:1", 3, ids[:2], grads_for(ids[:2], -1.0), dg)
    p.push("e2/c:0", 5, ids, grads_for(ids, 0.5), dg)
    return p


@pytest.mark.parametrize("s,n", [(0, 1), (0, 2), (1, 2)])
def test_snapshot_restore(s, n):
    src = trained(s, n)
    arrays, manifest = src.snapshot()
    assert manifest["shard"] == s and manifest["num_shards"] == n
    assert manifest["applied"] == {"e1/c:0": 5, "e1/c:1": 3, "e2/c:0": 5}
    ids = ALL if n == 1 else (EVEN if s == 0 else ODD)
    touched = sorted(ids.tolist())
    assert sorted(arrays["table.embedding.rows"].tolist()) == touched   # global ids
    dst = shard(s, n)
    dst.restore(arrays, manifest)
    want, got = src.pull(ids), dst.pull(ids)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert np.array_equal(dst.dense, src.dense)
    assert dst.applied == src.applied == {"e1/c:0": 5, "e1/c:1": 3, "e2/c:0": 5}
    for name in src.tables:  # optimizer state too: the next step matches
        assert np.array_equal(dst.tables[name].state["sum_sq"], src.tables[name].state["sum_sq"])
    assert np.array_equal(dst.dense_opt.state[0]["sum_sq"], src.dense_opt.state[0]["sum_sq"])
    dg = np.ones(src.dense.size, np.float32) if src.dense.size else None
    src.push("e2/c:1", 1, ids, grads_for(ids, 2.0), dg)
    dst.push("e2/c:1", 1, ids, grads_for(ids, 2.0), dg)
    want, got = src.pull(ids), dst.pull(ids)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert np.array_equal(dst.dense, src.dense)


def test_snapshot_is_a_copy():
    src = trained(0, 2)
    arrays, manifest = src.snapshot()
    saved = {k: v.copy() for k, v in arrays.items()}
    src.push("e3/c:0", 4, EVEN, grads_for(EVEN), np.ones(src.dense.size, np.float32))
    assert all(np.array_equal(arrays[k], saved[k]) for k in saved)
    assert "e3/c:0" not in manifest["applied"]


def test_restore_into_another_shard_is_refused():
    arrays, manifest = trained(0, 2).snapshot()
    with pytest.raises(DataFormatError, match="shard 0/2"):
        shard(1, 2).restore(arrays, manifest)
    with pytest.raises(DataFormatError):
        shard(0, 1).restore(arrays, manifest)
    target = shard(1, 2)
    before = target.pull(ODD)
    with pytest.raises(DataFormatError):
        target.restore(arrays, manifest)
    assert target.applied == {}
    assert all(np.array_equal(before[k], target.pull(ODD)[k]) for k in before)


# ---- (f) wrong gradient shapes ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"linear": np.zeros((4, 2), np.float32)},                      # wrong dim
    {"embedding": np.zeros((3, EMBED), np.float32)},               # wrong row count
    {"embedding": np.zeros((4 * EMBED,), np.float32)},             # flat
    {"nope": np.zeros((4, 1), np.float32)},                        # no such table
], ids=["dim", "rows", "flat", "table"])
def test_wrong_grad_shapes_change_nothing(bad):
    s = shard()
    before, dense_before = s.pull(EVEN), s.dense.copy()
    grads = {**grads_for(EVEN), **bad}
    with pytest.raises(DataFormatError):
        s.push("e1/c:0", 4, EVEN, grads, np.ones(s.dense.size, np.float32))
    after = s.pull(EVEN)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert np.array_equal(s.dense, dense_before) and s.applied == {}
    assert not s.tables["linear"].state.get("sum_sq", np.zeros(1)).any()
    assert s.push("e1/c:0", 4, EVEN, grads_for(EVEN), None)         # the step is still new


def test_wrong_dense_grad_shape_changes_nothing():
    s = shard()
    before = s.pull(EVEN)
    with pytest.raises(DataFormatError, match="dense"):
        s.push("e1/c:0", 4, EVEN, grads_for(EVEN), np.ones(s.dense.size + 1, np.float32))
    after = s.pull(EVEN)
    assert all(np.array_equal(before[k], after[k]) for k in before) and s.applied == {}


# ---- (g) rows per epoch ----------------------------------------------------------------------


def test_rows_by_epoch():
    s = shard(1, 2)
    assert s.rows_by_epoch() == {}
    for step, rows in (("e1/c:0", 4), ("e1/c:1", 6), ("e2/c:0", 4), ("e12/c:0", 1), ("e1/c:0", 100)):
        s.push(step, rows, ODD[:1], grads_for(ODD[:1]), None)
    assert s.rows_by_epoch() == {1: 10, 2: 4, 12: 1}


def test_step_ids_without_an_epoch_are_refused():
    # Step ids name their epoch ('e<k>/...'); anything else would break the per-epoch counts.
    s = shard()
    s.push("e1/c:0", 4, EVEN[:1], grads_for(EVEN[:1]), None)
    for bad in ("warmup", "eval/1", "e/1", "e1/"):
        with pytest.raises(DataFormatError, match="not e<epoch>"):
            s.push(bad, 2, EVEN[:1], grads_for(EVEN[:1]), None)
    assert s.rows_by_epoch() == {1: 4}


def test_a_push_to_rows_never_pulled_starts_from_their_initial_values():
    """A shard restored from a checkpoint gets pushes for rows no pull touched since:
    they must update from the rows' initial values, not from zeros."""
    pulled_first, pushed_cold = shard(), shard()
    pulled_first.pull(ALL)
    for p in (pulled_first, pushed_cold):
        p.push("e1/c:0", 8, ALL, grads_for(ALL), None)
    want, got = pulled_first.pull(ALL), pushed_cold.pull(ALL)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert not np.array_equal(got["embedding"], np.zeros_like(got["embedding"]))


@pytest.mark.parametrize("num_shards", [1, 3])
def test_shards_warm_started_from_a_version_hold_that_version_exactly(num_shards, gen_files, tmp_path):
    """A cluster warm start: every shard loads its slice of a saved version (rows with their
    optimizer state, pending admission counts; shard 0 the dense parameters and theirs).
    Exported and put back together, the shards are that version, to the bit."""
    import torch

    from mariana.trainer import checkpoint
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.job import run_local_job

    cfg = load_config(overrides={"hashing.bits": 16, "model.kind": "dnn", "hashing.min_count": 2,
                                 "train.batch_size": 512}, env={})
    out = str(tmp_path / "m")
    run_local_job(cfg, [str(gen_files["test"])], [], out)
    parent = ModelBundle.load(out, with_optimizer=True)
    _, weights, optim = checkpoint.load_version(out, with_optimizer=True)
    shards = [ParamShard(parent.config, parent.schema, s, num_shards) for s in range(num_shards)]
    for s in shards:
        s.warm_start(weights, optim)
    assert sum(len(s.table0.touched_rows()) for s in shards) == len(parent.touched.nonzero()[0])
    back = ModelBundle.from_shard_exports(parent.config, parent.schema, [s.snapshot()[0] for s in shards])
    for name, t in parent.tables.items():  # the assembled tables are frozen, with what a version saves
        rows, weights, state = t.saved_arrays()
        got_rows, got_weights, got_state = back.tables[name].saved_arrays()
        assert np.array_equal(got_rows, rows) and np.array_equal(got_weights, weights), name
        assert got_state.keys() == state.keys() and all(np.array_equal(got_state[k], v) for k, v in state.items())
    assert len({id(t.index) for t in back.tables.values()}) == 1  # one index for the tables' common ids
    assert all(torch.equal(a, b) for a, b in zip(back.model.parameters(), parent.model.parameters()))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(back.dense_opt.state, parent.dense_opt.state) for k in a)
    assert parent.counts.array.any() and np.array_equal(back.counts.array, parent.counts.array)


def test_a_shard_that_applied_no_push_exports_no_state_and_the_model_assembles():
    """With more shards than a small job has ids, a shard can end with rows pulled but no push
    applied, so no optimizer state arrays: the assembled model takes zeros for its rows' state
    (a KeyError before), and saves."""
    from mariana.trainer.bundle import ModelBundle

    s0, s1 = shard(0, 2), shard(1, 2)
    assert s0.push("e1/a:0", 4, EVEN, grads_for(EVEN), np.zeros_like(s0.dense))
    s1.pull(ODD)  # rows materialized, nothing pushed
    exports = [s0.snapshot()[0], s1.snapshot()[0]]
    assert "table.linear.sum_sq" in exports[0] and "table.linear.sum_sq" not in exports[1]
    back = ModelBundle.from_shard_exports(s0.config, s0.schema, exports)
    rows, _, state = back.tables["linear"].saved_arrays()
    assert rows.tolist() == sorted(ALL.tolist())
    assert (state["sum_sq"][np.isin(rows, ODD)] == 0).all() and state["sum_sq"][np.isin(rows, EVEN)].sum() > 0
