"""A served version's memory and cost by its tables' form (`serve.tables`): dense
HashedTables (2^bits rows) against frozen ones (the rows saved and an index), with
Vowpal Wabbit loading its own model of the same bits as a peer, in one run.

    .venv/bin/python bench/serving_memory.py --rows 300000 --repeat 3   # the docs/benchmarks.md numbers

Models (cached in bench-out/serving_memory/, remade when missing): mariana LR at
`--lr-bits` (28) and the DNN at `--dnn-bits` (24), each `mariana train` on
bench-out/train_<N>.tsv (`mariana gen criteo`, seed 1); VW (`--loss_function logistic
-b <lr-bits>`) on the same rows as ctr_peers.py writes them. Every measurement is a child
process of its own, reporting on itself:
- mariana: `Predictor.load(model_dir, tables=FORM)` as a server's worker loads it;
  "load MB" is VmRSS after the load less before it (the interpreter and numpy apart),
  "peak MB" the process's VmHWM; "load s" the load's wall time; "lone us" the process CPU per
  request of one instance as a worker's batcher answers it (`dataplane.answer_batch` of one
  JSON body: decode, score, encode; 2,000 test rows, after 300 to warm up); "batch ms" one
  call of 1,000 instances (median of 5).
- vw: `pyvw.Workspace("-i MODEL -t")`, the model loaded for testing: its load MB and load s.
Rounds interleave every child; the table shows medians. Writes
bench-out/serving_memory/results.json (every run, the machine, this command line).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctr_peers import machine_info, write_vw_file  # noqa: E402  (bench/ is on sys.path when run as a script)
from gendata import synthetic_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FORMS = ("dense", "frozen")


def status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def instances(test: Path, n: int) -> list[dict]:
    """Test rows as a client sends them (field -> value: numbers as numbers; empty values left out)."""
    out = []
    with open(test) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            row = {f"I{i}": int(cols[i]) for i in range(1, 14) if cols[i]}
            row.update({f"C{i - 13}": cols[i] for i in range(14, 40) if cols[i]})
            out.append(row)
            if len(out) == n:
                break
    return out


def child_mariana(model_dir: str, form: str, test: Path) -> dict:
    from mariana.serving import codec
    from mariana.serving.dataplane import answer_batch
    from mariana.serving.predictor import Predictor

    rows = instances(test, 3_300)
    bodies = [[(codec.encode({"instances": [row]}, codec.JSON), codec.JSON)] for row in rows[:2_300]]
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    p = Predictor.load(model_dir, tables=form)
    load_s = time.perf_counter() - t0
    loaded = status_kb("VmRSS")
    for body in bodies[:300]:
        answer_batch(p, body, 10)
    c0 = time.process_time()
    for body in bodies[300:]:
        answer_batch(p, body, 10)
    lone_us = (time.process_time() - c0) / 2_000 * 1e6
    batch = []
    for _ in range(5):
        t = time.perf_counter()
        p.predict(rows[2_300:3_300])
        batch.append((time.perf_counter() - t) * 1e3)
    return {"load_mb": (loaded - before) / 1024, "peak_mb": status_kb("VmHWM") / 1024, "load_s": load_s,
            "lone_us": lone_us, "batch_ms": statistics.median(batch), "tables": p.info()["tables"]}


def child_vw(model: str) -> dict:
    from vowpalwabbit import pyvw

    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    w = pyvw.Workspace(f"-i {model} -t --quiet")
    load_s = time.perf_counter() - t0
    out = {"load_mb": (status_kb("VmRSS") - before) / 1024, "peak_mb": status_kb("VmHWM") / 1024, "load_s": load_s}
    w.finish()
    return out


def run_child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *argv], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_models(args, out: Path, train: Path) -> dict[str, str]:
    models = {}
    for kind, bits in (("lr", args.lr_bits), ("dnn", args.dnn_bits)):
        d = out / f"{kind}{bits}_{args.rows}"
        if not (d / "CURRENT").exists():
            print(f"training mariana-{kind} at bits {bits} on {train.name}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "mariana", "-q", "train", "--data", str(train), "--model", kind,
                            "--bits", str(bits), "--out", str(d), "--json"], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL)
        models[f"mariana-{kind}"] = str(d)
    if not args.no_vw:
        model = out / f"vw{args.lr_bits}_{args.rows}.model"
        if not model.exists():
            from vowpalwabbit import pyvw

            train_vw = write_vw_file(train, train.with_suffix(".vw"))
            print(f"training vw at -b {args.lr_bits}", file=sys.stderr)
            w = pyvw.Workspace(f"-d {train_vw} --loss_function logistic -b {args.lr_bits} -f {model} --quiet")
            w.run_parser()
            w.finish()
        models["vw"] = str(model)
    return models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300_000, help="training rows (generated, cached)")
    ap.add_argument("--lr-bits", type=int, default=28)
    ap.add_argument("--dnn-bits", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--no-vw", action="store_true", help="leave the Vowpal Wabbit peer out")
    ap.add_argument("--out", default=str(REPO / "bench-out"))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        record = child_vw(rest[0]) if kind == "vw" else child_mariana(rest[0], rest[1], Path(rest[2]))
        print(json.dumps(record))
        return 0
    base = Path(args.out)
    out = base / "serving_memory"
    out.mkdir(parents=True, exist_ok=True)
    train = synthetic_file(base, "train", args.rows, seed=1)
    test = synthetic_file(base, "test", max(args.rows // 5, 3_300), seed=2)
    models = train_models(args, out, train)
    runs = []
    for r in range(args.repeat):
        for system, path in models.items():
            for form in (("-",) if system == "vw" else FORMS):
                rec = run_child(["vw", path] if system == "vw" else ["mariana", path, form, str(test)])
                runs.append({"round": r, "system": system, "form": form, **rec})
                print(json.dumps(runs[-1]), file=sys.stderr)
    keys = ("load_mb", "peak_mb", "load_s", "lone_us", "batch_ms")
    lines = ["| system | tables | load MB | peak MB | load s | lone us (CPU) | batch ms (1,000 rows) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    summary = {}
    for system in models:
        for form in (("-",) if system == "vw" else FORMS):
            rs = [x for x in runs if x["system"] == system and x["form"] == form]
            med = {k: statistics.median(x[k] for x in rs) for k in keys if k in rs[0]}
            summary[f"{system}/{form}"] = med
            cells = [f"{med[k]:,.0f}" if k in ("load_mb", "peak_mb") else f"{med[k]:.2f}" if k in ("load_s",)
                     else f"{med[k]:.1f}" if k in med else "-" for k in keys]
            lines.append(f"| {system} | {form} | " + " | ".join(cells) + " |")
    for kind in ("lr", "dnn"):
        d, f = summary.get(f"mariana-{kind}/dense"), summary.get(f"mariana-{kind}/frozen")
        if d and f:
            lines.append(f"\nmariana-{kind}: frozen / dense load MB {f['load_mb'] / d['load_mb']:.3f}x, "
                         f"load s {f['load_s'] / d['load_s']:.2f}x, lone CPU {f['lone_us'] / d['lone_us']:.2f}x, "
                         f"batch {f['batch_ms'] / d['batch_ms']:.2f}x")
    if "vw/-" in summary and "mariana-lr/frozen" in summary:
        ratio = summary["mariana-lr/frozen"]["load_mb"] / summary["vw/-"]["load_mb"]
        lines.append(f"mariana-lr frozen / vw load MB: {ratio:.3f}x")
    text = "\n".join(lines)
    print(text)
    (out / "results.json").write_text(json.dumps({"machine": machine_info(), "runs": runs, "summary": summary,
                                                  "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
