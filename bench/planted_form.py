"""How much of `mariana gen criteo`'s planted model N training rows can teach any model:
fit a model of exactly the planted form and score it on the same test rows as
bench/quality.py's `synth` set (issue 15).

    .venv/bin/python bench/planted_form.py --rows 200000 [--l2 1e-3]

The model knows what no real learner does: which 6 field pairs interact, that they
interact through rank-4 dot products, that every categorical value has its own main
effect, and the raw value ids (no hashing). It learns the main effects, a step curve
per integer field (buckets of 4 log1p(x), one for missing) and the latent vectors
with Adam (lr 0.01, batches of 1024) and an L2 penalty per occurrence, and keeps the
epoch with the best logloss on the last 10% of the training rows (patience 1). Its
test AUC is a practical ceiling at that size: the planted model's own AUC (the
oracle's) needs its effects known exactly, which N rows cannot give for rare values.

The rows are the generator's own (sparse/synth.py `_draw`, the same random streams
as `mariana gen criteo --seed 1` for training and `--seed 2` for test), so the test
rows equal bench/quality.py's test file's first 50,000 (it takes rows / 4 of seed 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mariana.sparse import synth  # noqa: E402
from mariana.sparse.metrics import BinaryMetrics  # noqa: E402

BATCH, LR, BUCKETS = 1024, 0.01, 62


def draw(world: synth.World, seed: int, rows: int, model_seed: int = 20140621):
    """(ints, cats, labels) exactly as `generate_criteo(rows, seed)` draws them, chunk by chunk."""
    rng = np.random.default_rng([seed, model_seed])
    parts, done = [], 0
    while done < rows:
        n = min(200_000, rows - done)
        logit, ints, cats = synth._draw(world, n, rng)
        parts.append((ints, cats, rng.random(n) < 1 / (1 + np.exp(-logit))))
        done += n
    return [np.concatenate(z) for z in zip(*parts)]


def inputs(ints: np.ndarray, cats: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(value ids + 1, 0 = missing), (integer buckets: 0 = missing, 1 + floor(4 log1p(x)))."""
    buckets = 1 + np.clip(np.floor(4 * np.log1p(np.maximum(np.nan_to_num(ints), 0))), 0, BUCKETS - 2)
    return torch.from_numpy(cats + 1), torch.from_numpy(np.where(np.isnan(ints), 0, buckets).astype(np.int64))


class PlantedForm(torch.nn.Module):
    def __init__(self, init_bias: float):
        super().__init__()
        emb = torch.nn.Embedding
        self.main = torch.nn.ModuleList(emb(k + 1, 1) for k in synth.CARDINALITIES)
        self.curves = torch.nn.ModuleList(emb(BUCKETS, 1) for _ in synth.CRITEO_NUMERIC)
        self.left = torch.nn.ModuleList(emb(synth.CARDINALITIES[a] + 1, synth.LATENT_DIM) for a, _ in synth.PAIRS)
        self.right = torch.nn.ModuleList(emb(synth.CARDINALITIES[b] + 1, synth.LATENT_DIM) for _, b in synth.PAIRS)
        for e in [*self.main, *self.curves]:
            torch.nn.init.zeros_(e.weight)
        for e in [*self.left, *self.right]:
            torch.nn.init.normal_(e.weight, std=0.1)
        self.bias = torch.nn.Parameter(torch.tensor([init_bias]))

    def forward(self, cats: torch.Tensor, buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the sum of squares of the rows this batch used)."""
        logit, penalty = self.bias.expand(len(cats)).clone(), torch.zeros(())
        for f, e in enumerate(self.main):
            v = e(cats[:, f]).squeeze(1)
            logit, penalty = logit + v, penalty + v.square().sum()
        for j, e in enumerate(self.curves):
            logit = logit + e(buckets[:, j]).squeeze(1)
        for p, (a, b) in enumerate(synth.PAIRS):
            u, v = self.left[p](cats[:, a]), self.right[p](cats[:, b])
            both = ((cats[:, a] > 0) & (cats[:, b] > 0)).float()
            logit = logit + both * (u * v).sum(1)
            penalty = penalty + u.square().sum() + v.square().sum()
        return logit, penalty


def predict(model: PlantedForm, cats: torch.Tensor, buckets: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([torch.sigmoid(model(cats[i:i + 65536], buckets[i:i + 65536])[0])
                          for i in range(0, len(cats), 65536)]).double().numpy()


def metrics(labels: np.ndarray, probs: np.ndarray) -> dict:
    m = BinaryMetrics()
    m.update(labels.astype(np.float64), probs)
    return m.result()


def fit(rows: int, test_rows: int, l2: float, max_epochs: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    world = synth.make_world()
    ints, cats, y = draw(world, 1, rows)
    t_ints, t_cats, t_y = draw(world, 2, test_rows)
    (c, b), (tc, tb) = inputs(ints, cats), inputs(t_ints, t_cats)
    labels = torch.from_numpy(y.astype(np.float32))
    cut = int(rows * 0.9)
    ctr = float(y[:cut].mean())
    model = PlantedForm(float(np.log(ctr / (1 - ctr))))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    best, epochs, t0 = None, [], time.perf_counter()
    for epoch in range(1, max_epochs + 1):
        for idx in torch.randperm(cut).split(BATCH):
            logit, penalty = model(c[idx], b[idx])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, labels[idx]) + l2 * penalty / len(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
        valid, test = metrics(y[cut:], predict(model, c[cut:], b[cut:])), metrics(t_y, predict(model, tc, tb))
        epochs.append({"epoch": epoch, "valid_logloss": valid["logloss"], "valid_auc": valid["auc"],
                       "test_auc": test["auc"], "test_logloss": test["logloss"]})
        print(f"epoch {epoch}: valid logloss {valid['logloss']:.4f} AUC {valid['auc']:.4f} | "
              f"test AUC {test['auc']:.4f} logloss {test['logloss']:.4f} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        if best is None or valid["logloss"] < best["valid_logloss"]:
            best = epochs[-1]
        elif epoch >= best["epoch"] + 1:  # patience 1
            break
    return {"rows": rows, "test_rows": test_rows, "l2": l2, "best": best, "epochs": epochs,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="training rows (seed 1)")
    p.add_argument("--test-rows", type=int, default=50_000, help="test rows (seed 2)")
    p.add_argument("--l2", type=float, default=1e-3, help="L2 per occurrence of a value's parameters")
    p.add_argument("--max-epochs", type=int, default=12)
    args = p.parse_args(argv)
    print(json.dumps(fit(args.rows, args.test_rows, args.l2, args.max_epochs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
