"""Every DNN interaction trains stably with its defaults.

LR and the DNN with each interaction ("proj", "dot", "fm") make one pass over
the same small planted-model file (the session's `gen_files`: 30,000 rows,
seed 1; test 8,000 rows, seed 2). Each interaction's test logloss must be below
a constant predictor's (the entropy of the base rate), its progressive train
loss must not blow up (below 1.1x the constant's), and its test AUC must be above
LR's minus a small margin. Before the FM term was a mean over pairs, "fm" ended
here at a train loss of 1.16 and an AUC 0.06 below LR's (0.662 against 0.725).

Model and optimizer settings are the defaults (with model.init_bias settled as a
job settles it), and 1,024-row batches (what "auto" picks for about 200k rows):
about 30 steps. FTRL's L1 keeps the linear weights at 0 until an id's gradients add
up, so over those 30 steps the progressive loss stays near the constant's (0.53
against 0.52) while the test logloss is well below it (0.467).
"""
import math

import numpy as np
import pytest

from mariana.sparse.errors import ModelDirError
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.config import load_config
from mariana.trainer.job import resolve_auto
from mariana.trainer.strategies.local import evaluate, train_local

AUC_MARGIN = 0.01


def train_and_test(files, kind: str, interaction: str = "proj") -> tuple[float, float, float]:
    """(mean train logloss of the pass, test AUC, test logloss) of one model with default settings."""
    cfg = load_config(overrides={"model.kind": kind, "model.interaction": interaction,
                                 "hashing.bits": 18, "train.batch_size": 1024}, env={})
    resolve_auto(cfg, cfg.data.resolve_schema(), [str(files["train"])])  # model.init_bias, as a job does
    bundle = ModelBundle(cfg, cfg.data.resolve_schema())
    trained = train_local(bundle, [str(files["train"])])
    metrics, _ = evaluate(bundle, [str(files["test"])])
    return trained.train_loss, metrics["auc"], metrics["logloss"]


def constant_logloss(path) -> float:
    """Logloss of predicting the file's base rate for every row (label: first column)."""
    with open(path) as f:
        labels = np.array([line[0] == "1" for line in f])
    p = labels.mean()
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


@pytest.fixture(scope="module")
def lr_auc(gen_files) -> float:
    return train_and_test(gen_files, "lr")[1]


@pytest.mark.parametrize("interaction", ["proj", "dot", "fm"])
def test_interaction_trains_stably_with_defaults(gen_files, lr_auc, interaction):
    loss, auc, test_loss = train_and_test(gen_files, "dnn", interaction)
    constant = constant_logloss(gen_files["train"])  # ~0.523: 22% clicks
    assert test_loss < constant, f"{interaction}: test logloss {test_loss:.4f} >= a constant predictor's {constant:.4f}"
    assert loss < 1.1 * constant, f"{interaction}: train loss {loss:.4f} blew up (constant: {constant:.4f})"
    assert auc > lr_auc - AUC_MARGIN, f"{interaction}: test AUC {auc:.4f} <= LR's {lr_auc:.4f} - {AUC_MARGIN}"


def test_fm_version_saved_before_the_mean_fails_to_load(tmp_path):
    """A version whose FM term was the sum over pairs (no `fm.scale`) must not
    load and predict with the mean."""
    cfg = load_config(overrides={"model.kind": "dnn", "model.interaction": "fm", "hashing.bits": 10}, env={})
    d = str(tmp_path / "m")
    ModelBundle(cfg, cfg.data.resolve_schema()).save(d)
    manifest, weights, optim = checkpoint.load_version(d, with_optimizer=True)
    del weights["dense.fm.scale"], optim["dense.fm.scale.sum_sq"]  # what the old code wrote
    checkpoint.save_version(d, manifest, weights, optim)
    with pytest.raises(ModelDirError, match="weights lack dense.fm.scale"):
        ModelBundle.load(d)
