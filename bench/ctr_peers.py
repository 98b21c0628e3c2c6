"""Mariana against its peers on one data set, in one run: mariana-lr,
mariana-dnn, Vowpal Wabbit and scikit-learn, same files, same split, same
features, all scored by `sparse.metrics.BinaryMetrics`.

The numbers in docs/benchmarks.md come from exactly this command, run in the
repository root:

    scripts/bootstrap.sh dev,bench && .venv/bin/python bench/ctr_peers.py --rows 1000000 --repeat 3

Other uses:

    .venv/bin/python bench/ctr_peers.py --rows 100000                  # a quick look
    .venv/bin/python bench/ctr_peers.py --systems lr,vw                # a subset
    .venv/bin/python bench/ctr_peers.py --criteo ../shared/data/criteo/criteo_1tb_sample1000.tsv.gz
    .venv/bin/python bench/ctr_peers.py --rss-check --rows 200000      # memory vs file size

Data (cached in bench-out/, reused when the row count matches):
`train_<N>.tsv` (`mariana gen criteo`, seed 1) and `test_<N/5>.tsv` (seed 2,
the same planted click model), or with `--criteo PATH` a real Criteo TSV
(gzip or plain) split into its first 80 % (train) and last 20 % (test).

Features, identical for every system: I1..I13 become
`I<k>_<sign(x) * floor(log1p(|x|) * 4)>` (`sparse.hashing.log_bucket`),
C1..C26 become `C<k>_<hex>`, and a missing value is the token `<field>_m`
(a hex value never is "m"). Mariana hashes these itself from the raw TSV; the
peers see the same tokens as strings, hashed into 2^bits slots.

Each system runs in its own process, so its peak RSS (VmHWM of that
process, reported by the process itself) is its own:

- `mariana-lr`, `mariana-dnn`: `mariana train --model lr|dnn --json`; train
  seconds = parse + hash + one training pass over the raw TSV (its own
  `train_seconds`), excluding model save and test evaluation.
- `vw`: reads a VW text file prepared beforehand, untimed
  (`label |a I1_.. C26_..`, labels -1/1); train seconds = creating the
  Workspace (`--loss_function logistic -b BITS`, VW's default learner) plus
  `run_parser()`, one pass; the model save (`finish()`) is reported apart.
  Test rows are predicted by VW (`--link logistic`).
- `sklearn`: FeatureHasher(2^bits, input_type="string", alternate_sign=False)
  + SGDClassifier(loss="log_loss", random_state=0; otherwise defaults) with
  `partial_fit` over 50k-row chunks of the raw TSV, one pass; train seconds =
  read (pyarrow) + tokens + hash + fit.

`--repeat K` runs every system K times, interleaved; the table shows the
median train seconds (rows/s from it) and the largest peak RSS; the JSON in
bench-out/ keeps every run, the machine and package versions and this
command line.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# numpy, pyarrow, vowpalwabbit and sklearn are imported inside the functions
# that use them: the per-system child processes run this same file, and a
# child's peak RSS should hold only what that system needs.

from gendata import count_lines, synthetic_file  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC  # noqa: E402  (plain tuples, no heavy imports)

SYSTEMS = {"lr": "mariana-lr", "dnn": "mariana-dnn", "vw": "vw", "sklearn": "sklearn"}
PEER_PACKAGES = {"vw": "vowpalwabbit", "sklearn": "sklearn"}
TRAIN_SEED, TEST_SEED = 1, 2
SKLEARN_CHUNK_ROWS = 50_000
MISSING = "m"
BOOTSTRAP_HINT = "run scripts/bootstrap.sh dev,bench"


def note(message: str) -> None:
    print(f"ctr_peers: {message}", file=sys.stderr, flush=True)


# ---- data files ----------------------------------------------------------------------

def find_data_path(spec: str) -> Path | None:
    """`spec` as given, else under $MARIANA_DATA or ../shared/data."""
    candidates = [Path(spec)]
    if not Path(spec).is_absolute():
        candidates += [Path(os.environ["MARIANA_DATA"]) / spec] if os.environ.get("MARIANA_DATA") else []
        candidates += [REPO.parent / "shared" / "data" / spec]
    return next((p.resolve() for p in candidates if p.is_file()), None)


def split_criteo(src: Path, out_dir: Path) -> tuple[Path, Path]:
    """First 80 % of the lines of `src` (gzip or plain) to train, the rest to test."""
    stem = src.name.split(".")[0]
    train, test = out_dir / f"{stem}-train.tsv", out_dir / f"{stem}-test.tsv"
    if train.exists() and test.exists() and train.stat().st_mtime >= src.stat().st_mtime:
        return train, test
    total = sum(1 for _ in open_text_lines(src))
    cut = total * 8 // 10
    note(f"splitting {src.name}: {cut:,} train rows, {total - cut:,} test rows")
    parts = train.with_suffix(".partial.tsv"), test.with_suffix(".partial.tsv")
    with open(parts[0], "wb") as tr, open(parts[1], "wb") as te:
        for i, line in enumerate(open_text_lines(src)):
            (tr if i < cut else te).write(line if line.endswith(b"\n") else line + b"\n")
    parts[0].replace(train)
    parts[1].replace(test)
    return train, test


def open_text_lines(path: Path):
    import gzip

    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        yield from f


# ---- the peers' tokens (the same features mariana hashes) -------------------------------

def read_tsv_chunks(path: Path, chunk_rows: int | None = None):
    """Criteo TSV as pyarrow tables (label int8, I* float64, C* string; '' = null),
    `chunk_rows` rows each (the last may be shorter), or pyarrow's blocks if None."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    types = {"label": pa.int8(), **{c: pa.float64() for c in CRITEO_NUMERIC},
             **{c: pa.string() for c in CRITEO_CATEGORICAL}}
    reader = pa_csv.open_csv(
        path, read_options=pa_csv.ReadOptions(column_names=list(types), block_size=8 << 20),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pa_csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True))
    pending, pending_rows = [], 0
    for batch in reader:
        if chunk_rows is None:
            yield pa.Table.from_batches([batch])
            continue
        pending.append(batch)
        pending_rows += batch.num_rows
        while pending_rows >= chunk_rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, chunk_rows)
            rest = table.slice(chunk_rows)
            pending, pending_rows = rest.to_batches(), rest.num_rows
    if pending_rows:
        yield pa.Table.from_batches(pending)


def token_columns(table) -> list:
    """One string column per feature field: `I3_-2`, `I5_m`, `C1_68fd1e64`, `C20_m`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from mariana.sparse.hashing import HashSpec, log_bucket

    scale = HashSpec().bucket_scale
    columns = []
    for name in CRITEO_NUMERIC:
        x = table.column(name).to_numpy()  # nulls -> NaN
        buckets = pa.array(log_bucket(x, scale)).cast(pa.string())
        columns.append(pc.binary_join_element_wise(f"{name}_", pc.if_else(np.isnan(x), MISSING, buckets), ""))
    for name in CRITEO_CATEGORICAL:
        columns.append(pc.binary_join_element_wise(f"{name}_", pc.fill_null(table.column(name), MISSING), ""))
    return columns


def write_vw_file(tsv: Path, vw: Path) -> Path:
    """`label |a tokens...` per row (labels -1/1); reused while newer than `tsv`."""
    import numpy as np
    import pyarrow.compute as pc

    if vw.exists() and vw.stat().st_mtime >= tsv.stat().st_mtime:
        return vw
    t0 = time.perf_counter()
    partial = vw.with_suffix(".partial.vw")
    with open(partial, "wb") as out:
        for table in read_tsv_chunks(tsv):
            label = pc.if_else(pc.equal(table.column("label"), 1), "1", "-1")
            lines = pc.binary_join_element_wise(label, "|a", *token_columns(table), " ")
            for chunk in pc.binary_join_element_wise(lines, "", "\n").chunks:  # line + "\n"
                offsets = np.frombuffer(chunk.buffers()[1], np.int32)[chunk.offset: chunk.offset + len(chunk) + 1]
                out.write(memoryview(chunk.buffers()[2])[offsets[0]:offsets[-1]])
    partial.replace(vw)
    note(f"wrote {vw.name} in {time.perf_counter() - t0:.1f} s (untimed)")
    return vw


# ---- the systems (vw and sklearn run as children of this script) ----------------------

def peak_rss_mb() -> float:
    from mariana.trainer.strategies.local import peak_rss_mb as peak  # VmHWM: not the parent's peak

    return peak()


def scored(labels, probs) -> dict:
    from mariana.sparse.metrics import BinaryMetrics

    m = BinaryMetrics()
    m.update(labels, probs)
    r = m.result()
    return {k: r[k] for k in ("auc", "logloss", "calibration", "ne")} | {"test_rows": r["count"]}


def child_vw(train_vw: Path, test_vw: Path, bits: int, work: Path) -> dict:
    import numpy as np
    from vowpalwabbit import pyvw

    model, preds = work.with_suffix(".model.vw"), work.with_suffix(".preds.txt")
    train_args = f"-d {train_vw} --loss_function logistic -b {bits} -f {model} --quiet"
    t0 = time.perf_counter()
    w = pyvw.Workspace(train_args)
    w.run_parser()
    train_seconds = time.perf_counter() - t0
    rows = int(w.get_weighted_examples())
    t1 = time.perf_counter()
    w.finish()
    save_seconds = time.perf_counter() - t1

    p = pyvw.Workspace(f"-i {model} -t -d {test_vw} -p {preds} --link logistic --quiet")
    p.run_parser()
    p.finish()
    with open(test_vw, "rb") as f:
        labels = np.array([line[:2] == b"1 " for line in f], np.float64)
    probs = np.loadtxt(preds, dtype=np.float64, ndmin=1)
    return {"train_rows": rows, "train_seconds": train_seconds, "save_seconds": save_seconds,
            "vw_args": train_args, **scored(labels, probs)}


def child_sklearn(train_tsv: Path, test_tsv: Path, bits: int) -> dict:
    import numpy as np
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import SGDClassifier

    hasher = FeatureHasher(n_features=1 << bits, input_type="string", alternate_sign=False)
    model = SGDClassifier(loss="log_loss", random_state=0)

    def featurize(table):
        return hasher.transform(zip(*(col.to_pylist() for col in token_columns(table))))

    rows, t0 = 0, time.perf_counter()
    for table in read_tsv_chunks(train_tsv, SKLEARN_CHUNK_ROWS):
        model.partial_fit(featurize(table), table.column("label").to_numpy(), classes=np.array([0, 1]))
        rows += table.num_rows
    train_seconds = time.perf_counter() - t0

    labels, probs = [], []
    for table in read_tsv_chunks(test_tsv, SKLEARN_CHUNK_ROWS):
        labels.append(table.column("label").to_numpy())
        probs.append(model.predict_proba(featurize(table))[:, 1])
    return {"train_rows": rows, "train_seconds": train_seconds,
            "sklearn_model": repr(model), **scored(np.concatenate(labels), np.concatenate(probs))}


def run_child(args: argparse.Namespace) -> int:
    """`--child vw|sklearn`: train, predict, score, print one JSON line."""
    if args.child == "vw":
        record = child_vw(Path(args.train), Path(args.test), args.bits, Path(args.work))
    else:
        record = child_sklearn(Path(args.train), Path(args.test), args.bits)
    record["peak_rss_mb"] = round(peak_rss_mb(), 1)
    print(json.dumps(record))
    return 0


def system_command(system: str, data: dict, bits: int, work: Path) -> list[str]:
    if system in ("lr", "dnn"):
        return [sys.executable, "-m", "mariana.services.cli", "-q", "train", "--data", str(data["train"]),
                "--test-data", str(data["test"]), "--model", system, "--bits", str(bits),
                "--out", str(work), "--json"]
    train, test = (data["train_vw"], data["test_vw"]) if system == "vw" else (data["train"], data["test"])
    return [sys.executable, str(Path(__file__).resolve()), "--child", system, "--train", str(train),
            "--test", str(test), "--bits", str(bits), "--work", str(work)]


def run_system(system: str, data: dict, bits: int, work_dir: Path, run: int) -> dict:
    """One run of one system in its own process; its JSON record plus wall time."""
    work = work_dir / f"{system}-r{run}"
    shutil.rmtree(work, ignore_errors=True)  # mariana would add a version to an old model dir
    t0 = time.perf_counter()
    proc = subprocess.run(system_command(system, data, bits, work), cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    base = {"system": SYSTEMS[system], "run": run, "process_seconds": round(wall, 2)}
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-5:]
        note(f"{SYSTEMS[system]} run {run} failed (exit {proc.returncode}): " + " | ".join(tail))
        return base | {"error": "\n".join(tail), "exit_code": proc.returncode}
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["rows_per_s"] = record["train_rows"] / record["train_seconds"]
    note(f"{SYSTEMS[system]} run {run}: {record['train_seconds']:.2f} s train, auc {record['auc']:.4f}")
    return base | record


def is_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def available_systems(requested: list[str]) -> list[str]:
    chosen = []
    for system in requested:
        package = PEER_PACKAGES.get(system)
        if package and not is_installed(package):
            note(f"skipping {system}: {package} is not installed ({BOOTSTRAP_HINT})")
            continue
        chosen.append(system)
    return chosen


# ---- summary and report ----------------------------------------------------------------

def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per system: metrics of its first run, median train seconds and process seconds (start to
    exit: start-up, reading, training, writing the model, scoring the test rows), rows/s by
    each, largest peak RSS."""
    summary = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        ok = [r for r in runs if r["system"] == name and "error" not in r]
        if not ok:
            continue
        seconds = statistics.median(r["train_seconds"] for r in ok)
        wall = statistics.median(r["process_seconds"] for r in ok)
        summary[name] = {"auc": ok[0]["auc"], "logloss": ok[0]["logloss"], "calibration": ok[0]["calibration"],
                         "train_rows": ok[0]["train_rows"], "train_seconds": seconds,
                         "rows_per_s": ok[0]["train_rows"] / seconds, "process_seconds": wall,
                         "wall_rows_per_s": ok[0]["train_rows"] / wall,
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in ok), "runs": len(ok)}
    return summary


def ratios(s: dict[str, dict]) -> dict[str, float | None]:
    def get(system: str, key: str):
        return s.get(system, {}).get(key)

    def div(a, b):
        return a / b if a is not None and b else None

    lr_ll, vw_ll = get("mariana-lr", "logloss"), get("vw", "logloss")
    lr_auc, dnn_auc = get("mariana-lr", "auc"), get("mariana-dnn", "auc")
    return {
        "lr_vs_vw_rows_per_s": div(get("mariana-lr", "rows_per_s"), get("vw", "rows_per_s")),
        "lr_vs_vw_wall_rows_per_s": div(get("mariana-lr", "wall_rows_per_s"), get("vw", "wall_rows_per_s")),
        "lr_vs_vw_logloss_pct": None if lr_ll is None or not vw_ll else 100.0 * (lr_ll - vw_ll) / vw_ll,
        "lr_vs_sklearn_rows_per_s": div(get("mariana-lr", "rows_per_s"), get("sklearn", "rows_per_s")),
        "dnn_minus_lr_auc": None if dnn_auc is None or lr_auc is None else dnn_auc - lr_auc,
    }


def fmt(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def markdown_table(s: dict[str, dict]) -> str:
    lines = ["| system | AUC | logloss | train s | rows/s | process s | rows/s by process | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in s.items():
        lines.append(f"| {name} | {fmt(r['auc'], '.4f')} | {fmt(r['logloss'], '.4f')} | "
                     f"{r['train_seconds']:.2f} | {r['rows_per_s']:,.0f} | {r['process_seconds']:.2f} | "
                     f"{r['wall_rows_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} |")
    return "\n".join(lines)


def ratio_lines(r: dict) -> str:
    return "\n".join([
        f"- mariana-lr rows/s / vw rows/s: {fmt(r['lr_vs_vw_rows_per_s'], '.2f', 'x')} by train seconds, "
        f"{fmt(r.get('lr_vs_vw_wall_rows_per_s'), '.2f', 'x')} by process start to exit",
        f"- mariana-lr logloss vs vw logloss: {fmt(r['lr_vs_vw_logloss_pct'], '+.2f', '%')}"
        " (negative: mariana-lr lower)",
        f"- mariana-lr rows/s / sklearn rows/s: {fmt(r['lr_vs_sklearn_rows_per_s'], '.2f', 'x')}",
        f"- mariana-dnn AUC - mariana-lr AUC: {fmt(r['dnn_minus_lr_auc'], '+.4f')}",
    ])


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


PACKAGES = ("mariana", "torch", "numpy", "scipy", "pyarrow", "vowpalwabbit", "scikit-learn")


def machine_info(packages: tuple[str, ...] = PACKAGES) -> dict:
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "git": git.stdout.strip() or None,
    }


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")
    note(f"wrote {path}")


def report_targets(targets: dict[str, bool], machine: dict, results: Path) -> int:
    """Print each target as met or MISSED and the run's machine line; 0 when all are met."""
    print()
    for name, ok in targets.items():
        print(f"- {'met' if ok else 'MISSED'}: {name}")
    print(f"\n{machine['date']}, {machine['cpu_model']}, {machine['nproc']} cores; results in {results}")
    return 0 if all(targets.values()) else 1


# ---- the two modes -----------------------------------------------------------------------

def prepare_data(args: argparse.Namespace, out_dir: Path) -> dict | None:
    if args.criteo:
        src = find_data_path(args.criteo)
        if src is None:
            note(f"skipped: Criteo file {args.criteo} not found (also looked under $MARIANA_DATA and "
                 f"{REPO.parent / 'shared' / 'data'})")
            return None
        train, test = split_criteo(src, out_dir)
        data = {"source": str(src), "train": train, "test": test}
    else:
        data = {"source": f"mariana gen criteo, seeds {TRAIN_SEED}/{TEST_SEED}",
                "train": synthetic_file(out_dir, "train", args.rows, TRAIN_SEED, note),
                "test": synthetic_file(out_dir, "test", max(args.rows // 5, 1), TEST_SEED, note)}
    data["train_rows"], data["test_rows"] = count_lines(data["train"]), count_lines(data["test"])
    return data


def bench(args: argparse.Namespace, out_dir: Path) -> int:
    systems = available_systems(args.systems)
    data = prepare_data(args, out_dir)
    if data is None:
        return 0
    if "vw" in systems:
        data["train_vw"] = write_vw_file(data["train"], data["train"].with_suffix(".vw"))
        data["test_vw"] = write_vw_file(data["test"], data["test"].with_suffix(".vw"))
    work_dir = out_dir / "models"
    work_dir.mkdir(exist_ok=True)

    runs = [run_system(system, data, args.bits, work_dir, k)
            for k in range(1, args.repeat + 1) for system in systems]
    summary = summarize(runs)
    ratio = ratios(summary)
    print(f"\n{data['train_rows']:,} train rows, {data['test_rows']:,} test rows ({data['source']}); "
          f"2^{args.bits} hash slots; train s and process s (start to exit, test scoring included) = medians "
          f"of {args.repeat} run(s), peak RSS = largest\n")
    print(markdown_table(summary))
    print()
    print(ratio_lines(ratio))

    name = f"ctr_peers_criteo_{data['train_rows']}.json" if args.criteo else f"ctr_peers_{args.rows}.json"
    write_json(out_dir / name, {
        "machine": machine_info(),
        "settings": {"bits": args.bits, "repeat": args.repeat, "systems": [SYSTEMS[s] for s in systems],
                     "sklearn_chunk_rows": SKLEARN_CHUNK_ROWS},
        "data": {k: str(v) if isinstance(v, Path) else v for k, v in data.items()},
        "summary": summary, "ratios": ratio, "runs": runs,
    })
    return 0 if len(summary) == len(systems) else 1


def rss_check(args: argparse.Namespace, out_dir: Path) -> int:
    """mariana-lr on N and 5N rows: peak RSS should follow table + block size, not the file."""
    test = synthetic_file(out_dir, "test", max(args.rows // 5, 1), TEST_SEED, note)
    sizes = [args.rows, 5 * args.rows]
    work_dir = out_dir / "models"
    work_dir.mkdir(exist_ok=True)
    results = []
    for rows in sizes:
        data = {"train": synthetic_file(out_dir, "train", rows, TRAIN_SEED, note), "test": test}
        results.append(run_system("lr", data, args.bits, work_dir, rows))
    if any("error" in r for r in results):
        return 1
    small, large = (r["peak_rss_mb"] for r in results)
    print(f"\nmariana-lr peak RSS (2^{args.bits} hash slots):")
    for rows, r in zip(sizes, results):
        print(f"- {rows:,} train rows: {r['peak_rss_mb']:,.0f} MB")
    print(f"- ratio {large / small:.2f} for {sizes[1] // sizes[0]}x the rows")
    write_json(out_dir / f"ctr_peers_rss_{args.rows}.json",
               {"machine": machine_info(), "bits": args.bits, "runs": results, "rss_ratio": large / small})
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="generated training rows (test: rows/5)")
    p.add_argument("--criteo", metavar="PATH",
                   help="a real Criteo TSV(.gz) instead: first 80%% train, last 20%% test")
    p.add_argument("--systems", default="lr,dnn,vw,sklearn", help="comma-separated subset of lr,dnn,vw,sklearn")
    p.add_argument("--bits", type=int, default=22, help="hash bits, for every system")
    p.add_argument("--repeat", type=int, default=1, help="runs per system, interleaved; the median time counts")
    p.add_argument("--rss-check", action="store_true", help="only mariana-lr on N and 5N rows: peak RSS of each")
    p.add_argument("--out-dir", default=str(REPO / "bench-out"),
                   help="data, models and results (default: bench-out/ in the repository)")
    for hidden in ("--child", "--train", "--test", "--work"):  # the per-system child processes
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    if args.rows < 5 or args.repeat < 1 or not 1 <= args.bits <= 30:
        p.error("--rows must be >= 5, --repeat >= 1, --bits in 1..30")
    if args.rss_check and args.criteo:
        p.error("--rss-check uses generated data; leave out --criteo")
    if args.child and args.child not in PEER_PACKAGES:
        p.error(f"--child: one of {list(PEER_PACKAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    return rss_check(args, out_dir) if args.rss_check else bench(args, out_dir)


if __name__ == "__main__":
    sys.exit(main())
