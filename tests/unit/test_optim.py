import numpy as np
import pytest
import torch

from mariana.sparse.optim import FTRL, AdaGrad, coalesce
from mariana.sparse.table import HashedTable, init_rows
from mariana.trainer.strategies.ps_step import DenseOptimizer


def table(dim=1, init=0.0):
    return HashedTable("t", num_rows=10, dim=dim, init_scale=init, seed=7)


def test_adagrad_matches_a_hand_computed_step():
    t = table()
    opt = AdaGrad(lr=0.1, initial_accumulator=0.1)
    rows = np.array([2, 5])
    t.gather(rows)
    opt.apply(t, rows, np.array([[0.5], [-2.0]], np.float32), unique=True)
    # acc = 0.1 + g^2; w = 0 - 0.1 * g / sqrt(acc)
    assert t.weights[2, 0] == pytest.approx(-0.1 * 0.5 / np.sqrt(0.35), rel=1e-6)
    assert t.weights[5, 0] == pytest.approx(0.1 * 2.0 / np.sqrt(4.1), rel=1e-6)
    opt.apply(t, np.array([2]), np.array([[0.5]], np.float32))
    w1 = -0.1 * 0.5 / np.sqrt(0.35)
    assert t.weights[2, 0] == pytest.approx(w1 - 0.1 * 0.5 / np.sqrt(0.6), rel=1e-6)
    assert t.weights[[0, 1, 3], 0].tolist() == [0, 0, 0]  # untouched rows unchanged


def test_ftrl_matches_a_hand_computed_step():
    t = table()
    opt = FTRL(alpha=0.5, beta=1.0, l1=0.1, l2=0.2)
    g = 0.8
    opt.apply(t, np.array([4]), np.array([[g]], np.float32))
    # n=0 -> sigma = sqrt(g^2)/alpha; z = g - sigma*0 = g; n = g^2
    z, n = g, g * g
    w = -(z - np.sign(z) * 0.1) / ((1.0 + np.sqrt(n)) / 0.5 + 0.2)
    assert t.weights[4, 0] == pytest.approx(w, rel=1e-6)
    # second step with a small gradient: |z| stays above l1
    g2 = -0.3
    sigma = (np.sqrt(n + g2 * g2) - np.sqrt(n)) / 0.5
    z2, n2 = z + g2 - sigma * w, n + g2 * g2
    w2 = 0.0 if abs(z2) <= 0.1 else -(z2 - np.sign(z2) * 0.1) / ((1.0 + np.sqrt(n2)) / 0.5 + 0.2)
    opt.apply(t, np.array([4]), np.array([[g2]], np.float32))
    assert t.weights[4, 0] == pytest.approx(w2, rel=1e-5)
    assert t.state["z"][4, 0] == pytest.approx(z2, rel=1e-5)


def test_ftrl_l1_keeps_small_weights_at_zero():
    t = table()
    FTRL(alpha=0.1, beta=1.0, l1=1.0, l2=0.0).apply(t, np.array([1]), np.array([[0.5]], np.float32))
    assert t.weights[1, 0] == 0.0 and t.state["z"][1, 0] == pytest.approx(0.5)


@pytest.mark.parametrize("opt", [AdaGrad(lr=0.3), FTRL(alpha=0.3, l1=0.01)])
def test_duplicate_ids_are_summed_before_the_update(opt):
    a, b = table(dim=2), table(dim=2)
    grads = np.array([[1.0, -1.0], [0.5, 0.25], [2.0, 0.0]], np.float32)
    type(opt)(**vars(opt)).apply(a, np.array([3, 6, 3]), grads)
    type(opt)(**vars(opt)).apply(b, np.array([3, 6]), np.array([[3.0, -1.0], [0.5, 0.25]], np.float32))
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-6)


def test_coalesce():
    rows, g = coalesce(np.array([5, 2, 5, 9, 2]), np.arange(10, dtype=np.float32).reshape(5, 2))
    assert rows.tolist() == [2, 5, 9]
    assert g.tolist() == [[10, 12], [4, 6], [6, 7]]


def test_initial_rows_depend_only_on_seed_and_id():
    whole = HashedTable("e", num_rows=16, dim=4, init_scale=0.5, seed=3)
    shard = HashedTable("e", num_rows=8, dim=4, init_scale=0.5, seed=3, id_offset=1, id_stride=2)
    np.testing.assert_array_equal(whole.lookup(np.array([5, 7])), shard.lookup(np.array([2, 3])))
    r = init_rows(np.arange(1000), 4, 0.5, 3)
    assert -0.5 <= r.min() < -0.45 and 0.45 < r.max() < 0.5 and abs(r.mean()) < 0.02
    assert not whole.touched.any()  # lookup does not materialize
    np.testing.assert_array_equal(whole.gather(np.array([5])), whole.lookup(np.array([5])))
    assert whole.touched[5]


def test_dense_optimizer_steps_as_adagrad_does_on_rows():
    """Torch ops on the parameters' own tensors, the numbers of AdaGrad.step (numpy) to the
    bit: float32 throughout and a correctly rounded sqrt. Shapes below and above one
    vector register (16 floats), gradients from 1e-6 to 1."""
    rng = np.random.default_rng(1)
    shapes = [(3,), (16,), (32, 50), (1,), (17, 5)]
    opt = AdaGrad(lr=0.005, initial_accumulator=1e-8)
    ref = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in ref]
    ref_state = [{"sum_sq": np.zeros_like(p)} for p in ref]
    dense = DenseOptimizer(opt, params)
    for step in range(50):
        grads = [(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 1)).astype(np.float32) for s in shapes]
        for p, st, g in zip(ref, ref_state, grads):
            opt.step(p, st, g)
        dense.apply(grads if step % 2 else [torch.from_numpy(g) for g in grads])  # arrays or tensors
    for p, want in zip(params, ref):
        assert np.array_equal(p.detach().numpy(), want)
    for st, want in zip(dense.state, ref_state):
        assert np.array_equal(st["sum_sq"], want["sum_sq"])


def test_dense_optimizer_updates_arrays_in_place_and_its_state_writes_through():
    flat = np.zeros(4, np.float32)  # a PS shard's dense vector
    dense = DenseOptimizer(AdaGrad(lr=0.1, initial_accumulator=0.1), [flat])
    dense.apply([np.array([0.5, 0, 0, -2.0], np.float32)])
    assert flat[0] == pytest.approx(-0.1 * 0.5 / np.sqrt(0.35), rel=1e-6) and flat[3] > 0
    dense.state[0]["sum_sq"][...] = 3.9  # a checkpoint's state put back
    dense.apply([np.array([0, 0, 0, 1.0], np.float32)])
    assert dense.sums[0][3].item() == pytest.approx(4.9) and flat[3] == pytest.approx(
        0.1 * 2.0 / np.sqrt(4.1) - 0.1 / np.sqrt(5.0), rel=1e-6)
    with pytest.raises(TypeError, match="AdaGrad, not FTRL"):
        DenseOptimizer(FTRL(), [flat])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dense_optimizer_steps_on_the_parameters_device():
    rng = np.random.default_rng(2)
    p = rng.standard_normal((64, 33)).astype(np.float32)
    on_cpu, on_gpu = torch.from_numpy(p.copy()), torch.from_numpy(p.copy()).cuda()
    a = DenseOptimizer(AdaGrad(lr=0.01, initial_accumulator=1e-8), [on_cpu])
    b = DenseOptimizer(AdaGrad(lr=0.01, initial_accumulator=1e-8), [on_gpu])
    for _ in range(20):
        g = rng.standard_normal(p.shape).astype(np.float32)
        a.apply([g])
        b.apply([torch.from_numpy(g).cuda()])
    assert b.sums[0].device == on_gpu.device
    np.testing.assert_allclose(on_gpu.cpu().numpy(), on_cpu.numpy(), rtol=1e-6, atol=1e-7)


def test_dense_optimizer_keeps_the_callers_thread_count_and_wants_one_dtype():
    threads = torch.get_num_threads()
    DenseOptimizer(AdaGrad(), [torch.zeros(3)]).apply([np.ones(3, np.float32)])
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="one device and of one dtype"):
        DenseOptimizer(AdaGrad(), [torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    DenseOptimizer(AdaGrad(), [np.zeros(0, np.float32)]).apply([np.zeros(0, np.float32)])  # a PS shard > 0
