"""What one model call costs a request, by the call's shape (`Predictor.predict_many`).

The server's batcher hands the model thread whatever queued since its last call: at a few
thousand requests/s mostly one request, in bursts a few dozen. Each request is checked and
encoded, then the call is scored. This times, per instance, in one process and one run:

- K single-instance requests in one call (K = 1 ... 64), and
- one request of N instances (N = 16 ... 512),

through `predict_many` as it is (requests of up to FEW_ROWS instances grouped FEW_ROWS rows at
a time through the one-pass plain path) and by the rule before it: the plain path for a call
of up to FEW_ROWS rows in all, else the general path (`parse_records` then `encode_rows`) for
the whole call, however small its requests. For an LR and a DNN version at their defaults,
trained for one pass on generated rows. Requests are the rows of another generated file as
bench/serving.py sends them (`read_instances`), each seen once before the timing (the
server's id cache warm, as in steady serving).

    .venv/bin/python bench/predict_calls.py              # ~1 min on 2 cores
    .venv/bin/python bench/predict_calls.py --repeat 9   # steadier medians

Prints a Markdown table: us per instance (a lone request's cost; a body's over its rows),
the median of --repeat timings of each shape, the two paths interleaved.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mariana.serving.predictor import Predictor  # noqa: E402
from mariana.sparse.records import FEW_ROWS  # noqa: E402
from mariana.sparse.synth import generate_criteo  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_serving", REPO / "bench" / "serving.py")
bench_serving = importlib.util.module_from_spec(_spec)  # (a plain `import serving` finds the package)
_spec.loader.exec_module(bench_serving)  # its request rows: read_instances

LONE = (1, 8, 16, 17, 24, 32, 48, 64)
BODIES = (16, 32, 64, 128, 512)


def per_instance_us(fn, calls: list[list[list]]) -> float:
    t0 = time.perf_counter()
    for requests in calls:
        fn(requests)
    return 1e6 * (time.perf_counter() - t0) / sum(len(x) for r in calls for x in r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-rows", type=int, default=50_000)
    ap.add_argument("--requests", type=int, default=4096, help="distinct request rows, cycled through")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from mariana.api import train

    print(f"FEW_ROWS = {FEW_ROWS}; us per instance, the median of {args.repeat}\n")
    print("| model | call | grouped (now) | the whole call by its size (before) | now / before |\n"
          "|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="predict-calls-") as d:
        generate_criteo(f"{d}/train.tsv", args.train_rows, seed=1)
        generate_criteo(f"{d}/req.tsv", args.requests, seed=2)
        rows = bench_serving.read_instances(Path(f"{d}/req.tsv"), args.requests)
        for kind in ("lr", "dnn"):
            train(f"{d}/train.tsv", model=kind, out=f"{d}/{kind}")
            p = Predictor.load(f"{d}/{kind}", torch_threads=1)
            p.predict_many([[r] for r in rows])  # every value seen once: the id cache warm

            def before(requests: list[list], p=p):
                few = sum(map(len, requests)) <= FEW_ROWS
                return p.predict_many(requests) if few else p._answer_parsed(requests)
            shapes = [(f"{k} x 1 instance", k, 1) for k in LONE] + [(f"1 x {n} instances", 1, n) for n in BODIES]
            for label, k, n in shapes:
                calls, i = [], 0
                while i + k * n <= len(rows):
                    calls.append([rows[i + j * n:i + (j + 1) * n] for j in range(k)])
                    i += k * n
                now, then = [], []
                for _ in range(args.repeat):
                    now.append(per_instance_us(p.predict_many, calls))
                    then.append(per_instance_us(before, calls))
                a, b = statistics.median(now), statistics.median(then)
                print(f"| {kind} | {label} | {a:,.1f} | {b:,.1f} | {a / b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
