"""The dense trainer (trainer/dense.py) and its config (trainer.config.DenseConfig)."""
import pytest
import torch
from torch import nn

from mariana.sparse.errors import ConfigError
from mariana.sparse.settings import load_settings
from mariana.trainer import config
from mariana.trainer.config import DenseConfig, DenseJobConfig
from mariana.trainer.dense import (DenseProgress, evaluate_dense, loss_fn, make_optimizer, resolve_backend,
                                   resolve_device, tensor_batches, train_dense)

CPU = torch.device("cpu")


def blobs(n=256, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes around three centres in 2-d: (n, 2) points, (n,) class ids."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    centres = torch.tensor([[2.0, 0.0], [-2.0, 1.0], [0.0, -2.0]])
    return centres[y] + 0.5 * torch.randn(n, 2, generator=g), y


def test_the_loop_lowers_the_loss_and_counts_what_it_trained():
    x, y = blobs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
    loss = loss_fn("cross_entropy")
    opt = make_optimizer(DenseConfig(optimizer="adam", lr=0.05), model.parameters())
    before = evaluate_dense(model, tensor_batches(x, y, 100), loss, CPU)
    gen = torch.Generator().manual_seed(1)
    records = [train_dense(model, tensor_batches(x, y, 32, gen), loss, opt, CPU) for _ in range(5)]
    after = evaluate_dense(model, tensor_batches(x, y, 100), loss, CPU)
    assert [(r.steps, r.rows) for r in records] == [(8, 256)] * 5
    assert records[-1].loss < records[0].loss / 2 and all(r.seconds > 0 for r in records)
    assert after.rows == 256 and after.loss < before.loss / 4
    assert after.accuracy > 0.95 and not model.training  # evaluated in eval mode


def test_the_record_loss_is_the_row_weighted_mean_and_progress_ends_on_the_last_row():
    """Batches of 3 rows and 1 row: the pass's loss weighs each batch by its rows; the
    last report comes after the last batch, with every row counted."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    x, y = torch.ones(4, 1), torch.tensor([[1.0], [1.0], [1.0], [3.0]])
    opt = make_optimizer(DenseConfig(optimizer="sgd", lr=1e-9), model.parameters())  # (almost) no change
    reports: list[DenseProgress] = []
    record = train_dense(model, tensor_batches(x, y, 3), loss_fn("mse"), opt, CPU, reports.append, report_every=3600)
    assert record.loss == pytest.approx((3 * 1.0 + 1 * 9.0) / 4)
    assert [(p.steps, p.rows) for p in reports] == [(2, 4)] and reports[0].loss == pytest.approx(record.loss)
    assert train_dense(model, [], loss_fn("mse"), opt, CPU).loss is None


def test_shuffled_batches_follow_the_generator_and_cover_every_row():
    x = torch.arange(10)
    a = [b.tolist() for b, _ in tensor_batches(x, x, 4, torch.Generator().manual_seed(5))]
    b = [b.tolist() for b, _ in tensor_batches(x, x, 4, torch.Generator().manual_seed(5))]
    assert a == b and [len(p) for p in a] == [4, 4, 2] and sorted(sum(a, [])) == list(range(10))
    assert [p.tolist() for p, _ in tensor_batches(x, x, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_losses_by_name():
    logits, labels = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    assert torch.equal(loss_fn("bce", "sum")(logits, labels), want)
    assert loss_fn("mse")(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0])).item() == 5.0
    assert loss_fn("cross_entropy")(torch.tensor([[0.0, 0.0]]), torch.tensor([1])).item() == pytest.approx(0.6931472)
    with pytest.raises(ConfigError, match="dense.loss: unknown loss 'hinge'"):
        loss_fn("hinge")
    assert set(config.LOSSES) == {"cross_entropy", "bce", "mse"}  # every name the config takes, made here
    for name in config.LOSSES:
        loss_fn(name)


@pytest.mark.parametrize("name,kind,defaults", [
    ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}),
    ("adam", torch.optim.Adam, {"lr": 0.1, "weight_decay": 1e-4}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 1e-4}),
])
def test_make_optimizer_takes_the_config_s_settings(name, kind, defaults):
    cfg = DenseConfig(optimizer=name, lr=0.1, momentum=0.9 if name == "sgd" else 0.0, weight_decay=1e-4)
    opt = make_optimizer(cfg, [nn.Parameter(torch.zeros(2))])
    assert type(opt) is kind
    assert {k: opt.defaults[k] for k in defaults} == defaults


@pytest.mark.parametrize("overrides,message", [
    ({"dense.device": "gpu"}, "dense.device: unknown device 'gpu'"),
    ({"dense.device": "cuda:x"}, "dense.device: unknown device 'cuda:x'"),
    ({"dense.backend": "mpi"}, "dense.backend: unknown backend 'mpi'"),
    ({"dense.device": "cpu", "dense.backend": "nccl"}, "dense.backend = 'nccl' needs a CUDA device"),
    ({"dense.loss": "hinge"}, "dense.loss: unknown loss 'hinge'"),
    ({"dense.optimizer": "lbfgs"}, "dense.optimizer: unknown optimizer 'lbfgs'"),
    ({"dense.world_size": 0}, "dense.world_size must be >= 1"),
    ({"dense.batch_size": 0}, "dense.batch_size must be >= 1"),
    ({"dense.epochs": 0}, "dense.epochs must be >= 1"),
    ({"dense.lr": 0}, "dense.lr must be a positive number"),
    ({"dense.weight_decay": -1}, "dense.weight_decay must be >= 0"),
    ({"dense.momentum": 0.9}, "dense.momentum is for optimizer 'sgd', not 'adam'"),
    ({"dense.world_size": "two"}, "dense.world_size: expected an integer"),
    ({"dense.lr": True}, "dense.lr: expected a number"),
    ({"dense.lrate": 0.1}, "unknown key 'dense.lrate'"),
])
def test_bad_dense_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(DenseJobConfig, env={}, overrides=overrides)


def test_dense_config_loads_from_toml_then_env_then_overrides(tmp_path):
    path = tmp_path / "speech.toml"
    path.write_text('[dense]\ndevice = "cpu"\noptimizer = "sgd"\nlr = 0.5\nmomentum = 0.9\nbatch_size = 32\n')
    env = {"MARIANA_DENSE__LR": "0.25", "MARIANA_DENSE__WORLD_SIZE": "2", "MARIANA_TRAIN__EPOCHS": "7"}
    cfg = load_settings(DenseJobConfig, path, env=env, overrides={"dense.batch_size": 8}).dense
    assert (cfg.device, cfg.optimizer, cfg.lr, cfg.momentum, cfg.world_size, cfg.batch_size, cfg.epochs) == (
        "cpu", "sgd", 0.25, 0.9, 2, 8, 1)  # MARIANA_TRAIN__*: a CTR job's section, not this config's


def test_device_and_backend_resolve():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_backend("auto", CPU) == "gloo" and resolve_backend("gloo", CPU) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ConfigError, match="'nccl' needs a CUDA device"):
        resolve_backend("nccl", CPU)
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_loop_trains_on_cuda_from_pinned_batches():
    x, y = blobs()
    device = resolve_device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    opt = make_optimizer(DenseConfig(lr=0.05), model.parameters())
    batches = [(xb.pin_memory(), yb.pin_memory()) for xb, yb in tensor_batches(x, y, 32)]
    first = train_dense(model, batches, loss_fn("cross_entropy"), opt, device)
    for _ in range(4):
        last = train_dense(model, batches, loss_fn("cross_entropy"), opt, device)
    assert last.loss < first.loss / 2
    assert evaluate_dense(model, tensor_batches(x, y, 100), loss_fn("cross_entropy"), device).accuracy > 0.95
