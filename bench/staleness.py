"""What the order of a cluster's updates does to a model, measured in one process.

W asynchronous workers each take a step from weights that miss the updates of up to W - 1
other steps. This runs `mariana train` in local mode with its updates applied in such an
order, so the effect is seen without the cluster's own noise (which step goes to which
worker, the cores the processes share):

    local   local mode: every step's gradients applied at once
    stale   each step's gradients applied W - 1 steps late (asynchronous W workers)
    ramp    as stale, but with the steps out at once that a cluster job's `train.ramp_steps`
            allows (services/ledger.py: ramp_cap): one at a time at the job's start, W only
            past RAMP * (W - 1)^2 steps
    bsp     W steps from the same weights, then applied one after another (the shards' BSP,
            without the ramp a cluster job adds)

The last W - 1 steps' gradients (stale, bsp) are left out: the cluster applies them.

Every order runs for every seed (`model.seed`) and W; the table gives each run and the
median over seeds. `--batch-size` is required (a cluster job of W workers picks another
"auto" batch than local mode). Arguments after `--` go to `mariana train` as they are.

    .venv/bin/python bench/staleness.py --data train.tsv --test-data test.tsv --batch-size 1024 \\
        --workers 2 4 --orders local stale ramp --seeds 1 2 3 -- --model dnn --bits 20
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mariana.trainer.job import RAMP_STEPS

ORDERS = ("local", "stale", "ramp", "bsp")


def child(order: str, workers: int, ramp: int, train_args: list[str]) -> int:
    """`mariana train` with local_step replaced by one that applies the gradients in `order`."""
    import mariana.trainer.strategies.local as local
    from mariana.cli import main
    from mariana.services.ledger import MAX_OUT, ramp_cap
    from mariana.trainer.strategies.ps_step import StepResult, compute_grads

    pending: list[tuple] = []  # (ids, {table: row grads}, [dense grads]) not applied yet

    def apply(bundle, item) -> None:
        ids, rows, dense = item
        for name, g in rows.items():
            bundle.optimizers[name].apply(bundle.tables[name], ids, g, unique=True)
        bundle.dense_opt.apply(dense)

    def delay(done: int) -> int:
        """Steps a gradient is applied late: the steps out at once beside it."""
        cap = ramp_cap(ramp, workers, done) if order == "ramp" and ramp else MAX_OUT
        return min(cap, workers) - 1

    def step(bundle, batch):
        batch = bundle.admit(batch)
        ids, inverse = batch.unique()
        pulled = {name: t.gather(ids) for name, t in bundle.tables.items()}
        result = compute_grads(bundle.model, batch, inverse, pulled)
        # copies: the next backward writes into the same gradient buffers
        pending.append((ids.copy(), {n: g.copy() for n, g in result.row_grads.items()},
                        [g.copy() for g in result.dense_grads]))
        if order == "bsp":
            if len(pending) == workers:
                for item in pending:
                    apply(bundle, item)
                pending.clear()
        else:
            late = 0 if order == "local" else delay(bundle.steps)
            while len(pending) > late:
                apply(bundle, pending.pop(0))
        bundle.steps += 1
        bundle.rows_trained += batch.num_rows
        return StepResult(result.loss_sum, result.num_rows, {}, [], result.score_hist)

    local.local_step = step
    sys.argv = ["mariana", *train_args]
    return main()


def run(order: str, workers: int, seed: int, args, extra: list[str]) -> dict:
    out = Path(args.out) / f"{order}-w{workers}-s{seed}"
    train = ["train", "--data", args.data, "--test-data", args.test_data, "--batch-size", str(args.batch_size),
             "--out", str(out), "--json", "--set", f"model.seed={seed}", *extra]
    cmd = [sys.executable, __file__, "--child", order, "--workers", str(workers), "--ramp", str(args.ramp),
           "--", *train]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{order} W={workers} seed {seed} failed:\n{p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"order": order, "workers": 1 if order == "local" else workers, "seed": seed,
            **{k: r[k] for k in ("auc", "logloss", "calibration")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data")
    ap.add_argument("--test-data")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    ap.add_argument("--orders", nargs="+", choices=ORDERS, default=["local", "stale", "ramp"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ramp", type=int, default=RAMP_STEPS, help=f"train.ramp_steps of the ramp order (default "
                                                                 f"{RAMP_STEPS}, as 'auto' for a DNN)")
    ap.add_argument("--out", default="bench-out/staleness")
    ap.add_argument("--child", choices=ORDERS, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.child:
        return child(args.child, args.workers[0], args.ramp, rest)
    if not (args.data and args.test_data and args.batch_size):
        ap.error("--data, --test-data and --batch-size are required")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seed in args.seeds:  # interleaved: a slower minute of the host touches every order alike
        for order in args.orders:
            for w in ([1] if order == "local" else args.workers):
                rows.append(run(order, w, seed, args, rest))
                r = rows[-1]
                print(f"{order:6} W={r['workers']} seed {seed}: AUC {r['auc']:.4f} logloss {r['logloss']:.4f} "
                      f"calibration {r['calibration']:.3f}", flush=True)
    print(f"\nbatch {args.batch_size}; median over seeds {args.seeds}\n")
    print("| order | W | AUC | logloss | calibration |\n|---|---:|---:|---:|---:|")
    for key in dict.fromkeys((r["order"], r["workers"]) for r in rows):
        group = [r for r in rows if (r["order"], r["workers"]) == key]
        med = {m: statistics.median(r[m] for r in group) for m in ("auc", "logloss", "calibration")}
        print(f"| {key[0]} | {key[1]} | {med['auc']:.4f} | {med['logloss']:.4f} | {med['calibration']:.3f} |")
    Path(args.out, "runs.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
