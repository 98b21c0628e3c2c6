"""The step's sparse gradients equal autograd on a full dense table (LR's numpy step against
torch's autograd of the same formula); the model registry."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import ConfigError
from mariana.trainer.config import ModelConfig
from mariana.trainer.dense import loss_fn
from mariana.trainer.models import MODELS, build_model
from mariana.trainer.models.base import make_input, pool_fields
from mariana.trainer.models.registry import uses_torch
from mariana.trainer.strategies.ps_step import compute_grads

NUM_IDS, FIELDS, DENSE = 40, 5, 3


def batch(fixed=True, seed=0, rows=16) -> SparseBatch:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, rows).astype(np.float32)
    dense = rng.random((rows, DENSE)).astype(np.float32)
    ids = rng.integers(0, NUM_IDS // 3, size=(rows, FIELDS))  # few ids: many duplicates
    if fixed:
        return SparseBatch.from_fixed(ids, num_ids=NUM_IDS, labels=labels, dense=dense,
                                      values=rng.random((rows, FIELDS)).astype(np.float32) + 0.5)
    # CSR rows of varying length, two entries in some fields
    counts = rng.integers(1, 4, size=rows)
    fields = np.concatenate([np.sort(rng.integers(0, FIELDS, c)) for c in counts]).astype(np.int32)
    return SparseBatch(ids=rng.integers(0, NUM_IDS, fields.size).astype(np.int64),
                       indptr=np.r_[0, np.cumsum(counts)].astype(np.int64), fields=fields,
                       num_fields=FIELDS, num_ids=NUM_IDS, values=None, dense=dense, labels=labels)


def torch_forward(model, x):
    """(logits, dense parameters as leaves) by autograd: a torch model's own forward; for
    numpy's LR, its formula in torch (sum of value * weight per row + dense @ w + bias)."""
    if uses_torch(model):
        return model(x), list(model.parameters())
    leaves = [torch.from_numpy(a.copy()).requires_grad_() for _, a in model.named_arrays()]
    logits = pool_fields(x, "linear").sum(dim=(1, 2)) + leaves[0]
    if len(leaves) > 1:
        logits = logits + x.dense @ leaves[1][0]
    return logits, leaves


def full_tables(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(NUM_IDS, t.dim, generator=g) * 0.3 for t in model.tables}


@pytest.mark.parametrize("kind,interaction", [("lr", "proj"), ("dnn", "proj"), ("dnn", "dot"), ("dnn", "fm")])
@pytest.mark.parametrize("fixed", [True, False])
def test_step_gradients_equal_autograd_on_full_tables(kind, interaction, fixed):
    cfg = ModelConfig(kind=kind, interaction=interaction, embed_dim=4, hidden=[8], slots=4)
    model = build_model(cfg, FIELDS, DENSE)
    b = batch(fixed=fixed)
    tables = full_tables(model)

    # Reference: every table row is a leaf; the batch indexes the whole table.
    leaves = {n: t.clone().requires_grad_() for n, t in tables.items()}
    x = make_input(b, torch.from_numpy(b.ids), leaves)
    logits, params = torch_forward(model, x)
    loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(b.labels), reduction="sum")
    loss.backward()
    ref_rows = {n: leaf.grad.numpy().copy() for n, leaf in leaves.items()}
    ref_dense = [p.grad.numpy().copy() for p in params]

    # The step: pull only the unique ids, get one gradient row per pulled id.
    uniq, inverse = b.unique()
    pulled = {n: t.numpy()[uniq] for n, t in tables.items()}
    step = compute_grads(model, b, inverse, pulled)
    assert step.loss_sum == pytest.approx(loss.item(), rel=1e-5)
    for n in tables:
        np.testing.assert_allclose(step.row_grads[n], ref_rows[n][uniq], rtol=1e-4, atol=1e-6)
        untouched = np.setdiff1d(np.arange(NUM_IDS), uniq)
        assert not ref_rows[n][untouched].any()
    assert len(step.dense_grads) == len(ref_dense)
    for got, want in zip(step.dense_grads, ref_dense):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_lr_takes_no_other_loss_and_imports_no_torch():
    """LR's step is numpy's closed form of the logloss: another loss is refused, not ignored;
    building, stepping and predicting an LR bundle import no torch (a fresh process)."""
    import subprocess
    import sys

    model = build_model(ModelConfig(kind="lr"), FIELDS, DENSE)
    b = batch()
    uniq, inverse = b.unique()
    with pytest.raises(TypeError, match="logloss only"):
        compute_grads(model, b, inverse, {"linear": np.zeros((len(uniq), 1), np.float32)}, loss=loss_fn("mse", "sum"))
    code = ("import sys, numpy as np\n"
            "from mariana.sparse.schema import criteo\n"
            "from mariana.trainer.bundle import ModelBundle\n"
            "from mariana.trainer.config import load_config\n"
            "from mariana.trainer.strategies.local import local_step\n"
            "from mariana.sparse.batch import SparseBatch\n"
            "b = ModelBundle(load_config(overrides={'hashing.bits': 10, 'model.kind': 'lr'}, env={}), criteo())\n"
            "f = b.encoder.num_fields\n"
            "x = SparseBatch.from_fixed(np.arange(40 * f).reshape(40, f) % 1024, num_ids=1024,\n"
            "    dense=np.ones((40, 13), np.float32), labels=(np.arange(40) % 2).astype(np.float32))\n"
            "local_step(b, x); p = b.predict(x)\n"
            "print('torch' in sys.modules, p.shape, b.tables['linear'].touched.sum() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "(40,)", "True"], out


def test_the_step_takes_another_loss():
    """compute_grads with a summed MSE on the logits: autograd's gradients on full tables."""
    model = build_model(ModelConfig(kind="dnn", embed_dim=4, hidden=[8], slots=4), FIELDS, DENSE)
    b = batch(fixed=False)
    tables = full_tables(model)
    leaves = {n: t.clone().requires_grad_() for n, t in tables.items()}
    loss = F.mse_loss(model(make_input(b, torch.from_numpy(b.ids), leaves)), torch.from_numpy(b.labels),
                      reduction="sum")
    model.zero_grad()
    loss.backward()
    uniq, inverse = b.unique()
    step = compute_grads(model, b, torch.from_numpy(inverse), {n: t.numpy()[uniq] for n, t in tables.items()},
                         loss=loss_fn("mse", "sum"))
    assert step.loss_sum == pytest.approx(loss.item(), rel=1e-5)
    for n, leaf in leaves.items():
        np.testing.assert_allclose(step.row_grads[n], leaf.grad.numpy()[uniq], rtol=1e-4, atol=1e-6)


def test_model_kinds_come_from_the_registry():
    assert {"lr", "dnn"} <= set(MODELS)
    with pytest.raises(ConfigError, match=r"model.kind: unknown model 'gbdt' \(known: dnn, lr\)"):
        build_model(SimpleNamespace(kind="gbdt", seed=0, init_bias=0.0), FIELDS, DENSE)


def test_base_imports_no_model_module():
    """The registry breaks the old cycle: base.py (what torch models share) imports none of
    them, only the registry's torch-free parts."""
    import ast

    from mariana.trainer.models import base

    tree = ast.parse(Path(base.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in names if m.startswith("mariana.trainer.models") and m != "mariana.trainer.models.registry"], \
        names


def test_build_model_seeds_and_sets_the_bias():
    cfg = ModelConfig(kind="dnn", embed_dim=4, hidden=[8], slots=4, seed=3, init_bias=-1.5)
    a, b = build_model(cfg, FIELDS, DENSE), build_model(cfg, FIELDS, DENSE)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.bias.item() == -1.5 and build_model(ModelConfig(kind="lr"), FIELDS, DENSE).bias.item() == 0.0


def test_lr_gradient_by_hand():
    """d loss / d w_id = sum over entries with that id of (p - y) * value."""
    model = build_model(ModelConfig(kind="lr"), FIELDS, 0)
    b = SparseBatch.from_fixed(np.array([[1, 2], [2, 3]]), num_ids=8, labels=np.array([1, 0], np.float32))
    uniq, inverse = b.unique()
    w = np.array([[0.5], [-0.25], [1.0], [0.0], [0.0], [0.0], [0.0], [0.0]], np.float32)
    step = compute_grads(model, b, inverse, {"linear": w[uniq]})
    p = 1 / (1 + np.exp(-np.array([-0.25 + 1.0, 1.0 + 0.0])))  # rows: ids (1, 2) and (2, 3)
    want = {1: p[0] - 1, 2: (p[0] - 1) + p[1], 3: p[1]}
    got = dict(zip(uniq.tolist(), step.row_grads["linear"][:, 0].tolist()))
    assert got == pytest.approx(want, rel=1e-5)


def test_fixed_and_csr_forms_give_the_same_logits():
    cfg = ModelConfig(kind="dnn", embed_dim=4, hidden=[8], slots=4)
    model = build_model(cfg, FIELDS, DENSE)
    b = batch(fixed=True)
    csr = SparseBatch(ids=b.ids, indptr=b.indptr, fields=b.fields.copy(), num_fields=FIELDS,
                      num_ids=NUM_IDS, values=b.values, dense=b.dense, labels=b.labels, _fixed=False)
    tables = full_tables(model)
    with torch.no_grad():
        a = model(make_input(b, torch.from_numpy(b.ids), tables))
        c = model(make_input(csr, torch.from_numpy(csr.ids), tables))
    torch.testing.assert_close(a, c)


def test_linear_table_take_matches_index_select_and_its_gradient():
    """The dim-1 fast path (numpy take, scatter_add backward) against torch's index_select."""
    from mariana.trainer.models.base import _Take

    g = torch.Generator().manual_seed(3)
    weights = torch.randn(50, 1, generator=g)
    index = torch.randint(0, 50, (400,), generator=g)  # with repeats: gradients must sum
    upstream = torch.randn(400, generator=g)
    a = weights.clone().requires_grad_()
    out_a = _Take.apply(a.view(-1), index)
    (out_a * upstream).sum().backward()
    b = weights.clone().requires_grad_()
    out_b = torch.index_select(b, 0, index).view(-1)
    (out_b * upstream).sum().backward()
    assert torch.equal(out_a, out_b)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert a.grad[index.unique()].abs().sum() > 0 and (a.grad.view(-1)[~torch.isin(torch.arange(50), index)] == 0).all()


@pytest.mark.parametrize("form", ["few rows", "csr", "a block's unique ids", "admission"])
def test_lr_predicts_in_numpy_what_its_torch_forward_gives(form):
    """`ModelBundle.predict` scores LR in numpy; the probabilities must be those of its
    formula in torch (`torch_forward`), in every form a batch comes in."""
    from mariana.sparse import admission
    from mariana.sparse.schema import criteo
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.config import load_config

    cfg = load_config(overrides={"hashing.bits": 10, "hashing.numeric": "both", "model.kind": "lr",
                                 "hashing.min_count": 3 if form == "admission" else 1}, env={})
    b = ModelBundle(cfg, criteo())
    rng = np.random.default_rng(3)
    table = b.tables["linear"]
    table.weights[:] = rng.normal(0, 0.5, table.weights.shape).astype(np.float32)
    table.touched[:] = rng.random(table.num_rows) < 0.7  # untouched ids read 0 (or, with admission, the rare row)
    table.weights[~table.touched] = 0.0
    b.model.bias[...] = -0.3
    b.model.weight[...] = rng.normal(0, 0.2, b.model.weight.shape).astype(np.float32)
    f, dense = b.encoder.num_fields, rng.random((12, 13)).astype(np.float32)
    if form == "csr":
        counts = rng.integers(0, 5, 12)
        fields = np.concatenate([np.sort(rng.integers(0, f, c)) for c in counts]).astype(np.int32)
        batch = SparseBatch(ids=rng.integers(0, 1 << 10, fields.size), indptr=np.r_[0, np.cumsum(counts)],
                            fields=fields, num_fields=f, num_ids=1 << 10, values=rng.random(fields.size).astype(
                                np.float32), dense=dense)
    else:
        batch = SparseBatch.from_fixed(rng.integers(0, 1 << 10, (12, f)), num_ids=1 << 10, dense=dense)
        if form == "a block's unique ids":
            batch.unique()
    ref = batch if form != "admission" else admission.lookup_ids(batch, b.touched, b.rare)
    uniq, inverse = ref.unique()
    with torch.no_grad():
        want = torch.sigmoid(torch_forward(b.model, make_input(ref, inverse, {
            "linear": torch.from_numpy(table.lookup(uniq))}))[0])
    got = b.predict(batch)
    assert got.dtype == np.float32 and got.shape == (12,)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("interaction", ["dot", "proj", "fm"])
@pytest.mark.parametrize("dense_dim,image_dim", [(0, 0), (DENSE, 0), (DENSE, 4)])
def test_dnn_numpy_logits_are_its_torch_forward(interaction, dense_dim, image_dim):
    """`SparseDNN.numpy_logits` (a request's few rows, no torch dispatch) must give the logits
    of `forward`, with and without the dense and image towers, and follow the parameters when
    they change in place (an optimizer step, a load)."""
    from mariana.trainer.models.sparse_dnn import SparseDNN

    torch.manual_seed(0)
    model = SparseDNN(FIELDS, dense_dim, 4, [8, 4], 0.1, interaction, slots=3, image_dim=image_dim, image_tower=5)
    tables = full_tables(model)
    rng = np.random.default_rng(5)
    for rows in (1, 3, 16):
        b = SparseBatch.from_fixed(rng.integers(0, NUM_IDS, (rows, FIELDS)), num_ids=NUM_IDS,
                                   dense=rng.random((rows, dense_dim + image_dim)).astype(np.float32))
        with torch.no_grad():
            want = model(make_input(b, torch.from_numpy(b.ids), tables)).numpy()
        got = model.numpy_logits({n: t.numpy()[b.ids] for n, t in tables.items()}, rows, b.dense)
        assert got.dtype == np.float32 and got.shape == (rows,)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        with torch.no_grad():  # in place, as training and loading change them
            for p in model.parameters():
                p.add_(torch.randn(p.shape) * 0.1)


def test_dnn_bundle_predicts_a_few_rows_in_numpy_as_torch_does():
    """Through `ModelBundle.predict`: untouched ids read their initial rows and, with admission,
    ids never admitted their field's rare row, in the numpy path as in the torch one."""
    from mariana.sparse import admission
    from mariana.sparse.schema import criteo
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.config import load_config

    cfg = load_config(overrides={"hashing.bits": 10, "model.kind": "dnn", "hashing.min_count": 3}, env={})
    b = ModelBundle(cfg, criteo())
    rng = np.random.default_rng(4)
    for t in b.tables.values():
        t.materialize(np.flatnonzero(rng.random(t.num_rows) < 0.6))  # some ids trained, others not
        t.weights[t.touched] += rng.normal(0, 0.3, t.weights[t.touched].shape).astype(np.float32)
    batch = SparseBatch.from_fixed(rng.integers(0, 1 << 10, (5, b.encoder.num_fields)), num_ids=1 << 10)
    ref = admission.lookup_ids(batch, b.touched, b.rare)
    uniq = ref.ids
    with torch.no_grad():
        want = torch.sigmoid(b.model(make_input(ref, torch.arange(ref.nnz), {
            n: torch.from_numpy(t.lookup(uniq)) for n, t in b.tables.items()}))).numpy()
    got = b.predict(batch)
    assert (uniq != batch.ids).any() and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
