"""Model quality on real click logs and on two planted generators, in one run:
AUC (with a 95% interval), logloss, calibration and train seconds of every system
on every data set, all scored by `sparse.metrics.BinaryMetrics` on the same test
rows (issue 15).

    .venv/bin/python bench/quality.py                       # every set and system (docs/benchmarks.md)
    .venv/bin/python bench/quality.py --quick               # 20k generated rows, small grids
    .venv/bin/python bench/quality.py --sets criteo,zozo --systems lr,dnn,vw

Data sets (`--sets`; real files from $MARIANA_DATA or ../shared/data, never copied
into the repository; a missing one is skipped with a note):

- `criteo`: criteo_1tb_sample1000.tsv.gz then criteo_1tb_day0_sample1010.tsv.gz
  (2,010 real rows), first 80% train, last 20% test;
- `attribution`: Criteo Attribution 1% sample, its own train / valid files (CSV);
- `zozo`: ZOZO Open Bandit small, 40,000 rows in time order, first 80% / last
  20%; features campaign, item_id, position, user_feature_0..3, behavior_policy;
- `synth`: `mariana gen criteo`, --rows train rows (seed 1), rows / 4 test (seed 2);
- `drift`: `mariana gen criteo-drift` (sparse/synth_drift.py), rows * 5 / 4 rows
  in time order, first 80% / last 20%.

Systems (`--systems`):

- `lr`, `dnn`: `mariana train --json [--model dnn] [--config CSV_SCHEMA]` with no
  tuning flag (whatever the defaults are today), then `mariana predict` on the
  test rows; train s = the `mariana train` process's wall time;
- `tuned`, `tuned-dnn`: `mariana tune --budget B --json` (lr, dnn), B = 10 x the
  wall time of that set's default LR run; "n/a" when `mariana tune --help` fails;
- `vw`: Vowpal Wabbit, `--loss_function logistic -b 22` (mariana's table size),
  one pass; and a grid: --passes {1,3,5} x --l2 {0,1e-6,1e-5} (multi-pass with a
  cache file and --holdout_off); "best on test" (optimistic: chosen by test
  logloss) and "picked on valid" (chosen by logloss on the last 20% of the train
  rows, then retrained on all of them: the honest one);
- `sklearn`: OneHotEncoder(handle_unknown="ignore") + LogisticRegression over the
  same tokens, C in {0.01, 0.1, 1, 10}; best on test and picked on valid as VW;
- `dlrm`: torchrec's DLRM, one epoch, generated sets only, in its own venv under
  bench-out/quality/dlrm-venv (made on first use: torch==2.13.0 CPU, fbgemm-gpu-cpu
  1.8.0, torchrec 1.8.0 --no-deps and its runtime deps); "n/a" with the reason if
  that fails.

Features are the same tokens for every peer (bench/ctr_peers.py): I1..I13 as
`I<k>_<log bucket>`, C1..C26 as `C<k>_<hex>`, a missing value `<field>_m`; for CSV
sets every feature column is a categorical token `<column>_<value>`. DLRM sees the
same tokens (a vocabulary of the training rows, unseen -> one OOV row per field)
plus the 13 integers as `sign(x) log1p(|x|)` dense inputs, its usual Criteo input.
Each generated set also shows the planted model's own score on the test rows
(the best any model can do) and the constant predictor (train CTR).

Writes bench-out/quality/results.json (every number, the machine, the versions,
the date, this command line) and results.md (the table).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

ALL_SETS = ("criteo", "attribution", "zozo", "synth", "drift")
ALL_SYSTEMS = ("lr", "dnn", "tuned", "tuned-dnn", "vw", "sklearn", "dlrm")
CRITEO_FILES = ("criteo/criteo_1tb_sample1000.tsv.gz", "criteo/criteo_1tb_day0_sample1010.tsv.gz")
ATTRIBUTION = ("criteo_attribution/criteo_attribution_1pct_train.csv.gz",
               "criteo_attribution/criteo_attribution_1pct_valid.csv.gz")
ZOZO = "zozo_obd/zozo_obd_small_by_time.csv.gz"
ZOZO_FEATURES = ("behavior_policy", "campaign", "item_id", "position",
                 "user_feature_0", "user_feature_1", "user_feature_2", "user_feature_3")
ZOZO_IGNORED = ("timestamp", "propensity_score")
VW_BITS = 22
VW_GRID = [(p, l2) for p in (1, 3, 5) for l2 in (0.0, 1e-6, 1e-5)]
SK_GRID = (0.01, 0.1, 1.0, 10.0)
SK_MAX_ITER = 300
TUNE_FACTOR = 10
MAX_RSS_GIB = 8.0   # any one system's process tree
DLRM_PACKAGES = (["torch==2.13.0"], ["fbgemm-gpu-cpu==1.8.0"], ["--no-deps", "torchrec==1.8.0"],
                 ["torch==2.13.0", "tensordict", "torchmetrics==1.0.3", "tqdm", "pyre-extensions"])


def note(message: str) -> None:
    print(f"quality: {message}", file=sys.stderr, flush=True)


# ---- scoring ----------------------------------------------------------------------------

def hanley_mcneil(auc: float | None, n_pos: int, n_neg: int) -> tuple[float, float] | None:
    """95% interval of an AUC from its value and class counts (Hanley & McNeil 1982)."""
    if auc is None or n_pos == 0 or n_neg == 0:
        return None
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    half = 1.96 * math.sqrt(max(var, 0.0))
    return max(0.0, auc - half), min(1.0, auc + half)


def score(labels, probs) -> dict:
    import numpy as np

    from mariana.sparse.metrics import BinaryMetrics

    probs = np.asarray(probs, np.float64)
    if probs.shape != labels.shape or not np.isfinite(probs).all():
        raise RuntimeError(f"{probs.size} predictions ({int((~np.isfinite(probs)).sum())} not finite) "
                           f"for {labels.size} test rows")
    m = BinaryMetrics()
    m.update(labels, probs)
    r = m.result()
    pos = int(labels.sum())
    return {"auc": r["auc"], "auc_ci95": hanley_mcneil(r["auc"], pos, labels.size - pos),
            "logloss": r["logloss"], "calibration": r["calibration"], "ne": r["ne"], "test_rows": r["count"],
            PROBS: probs}  # for the paired tests; left out of results.json


PROBS = "_probs"
# (a, b) pairs tested on the same test rows: issue 15's targets compare these
PAIRS = (("mariana-lr", "vw (defaults, 1 pass)"), ("mariana-dnn", "vw (defaults, 1 pass)"),
         ("mariana-dnn", "mariana-lr"),
         ("mariana-tuned (lr)", "vw grid, picked on valid"), ("mariana-tuned (lr)", "sklearn grid, picked on valid"),
         ("mariana-tuned (dnn)", "vw grid, picked on valid"), ("mariana-tuned (dnn)", "sklearn grid, picked on valid"),
         ("mariana-dnn", "torchrec DLRM"))


def paired(rows: list[dict], labels) -> list[dict]:
    """DeLong's paired AUC test and a paired logloss interval for each pair in PAIRS that ran:
    the two models scored the same rows, so their difference is far tighter than two intervals."""
    from mariana.sparse.metrics import paired_auc_test, paired_logloss_test

    probs = {r["system"]: r[PROBS] for r in rows if PROBS in r}
    out = []
    for a, b in PAIRS:
        if a in probs and b in probs:
            auc = paired_auc_test(labels, probs[a], probs[b])
            ll = paired_logloss_test(labels, probs[a], probs[b])
            out.append({"a": a, "b": b, "auc_delta": auc["delta"], "auc_ci95": auc["ci95"], "auc_p": auc["p"],
                        "logloss_delta": ll["delta"], "logloss_ci95": ll["ci95"]})
    return out


def without_probs(value):
    """`value` with the prediction arrays taken out (results.json keeps the numbers only)."""
    if isinstance(value, dict):
        return {k: without_probs(v) for k, v in value.items() if k != PROBS}
    if isinstance(value, list):
        return [without_probs(v) for v in value]
    return value


# ---- data sets --------------------------------------------------------------------------

def data_root() -> list[Path]:
    roots = [Path(os.environ["MARIANA_DATA"])] if os.environ.get("MARIANA_DATA") else []
    return roots + [REPO.parent / "shared" / "data"]


def find(rel: str) -> Path | None:
    return next((r / rel for r in data_root() if (r / rel).is_file()), None)


def read_lines(path: Path) -> list[bytes]:
    import gzip

    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        return [ln if ln.endswith(b"\n") else ln + b"\n" for ln in f]


def write_split(lines: list[bytes], train: Path, test: Path, header: bytes = b"", frac: float = 0.8) -> int:
    cut = int(len(lines) * frac)
    for path, part in ((train, lines[:cut]), (test, lines[cut:])):
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(header + b"".join(part))
        tmp.replace(path)
    return cut


def csv_config(path: Path, columns: list[str], label: str, features, ignore) -> Path:
    """A `mariana train --config` for a CSV with a header: every feature categorical."""
    q = lambda xs: "[" + ", ".join(f'"{x}"' for x in xs) + "]"  # noqa: E731
    path.write_text(f'[data]\nformat = "csv"\n\n[data.schema]\ncolumns = {q(columns)}\nlabel = "{label}"\n'
                    f'categorical = {q(features)}\nignore = {q(ignore)}\ndelimiter = ","\nheader = true\n')
    return path


def set_criteo(out: Path, args) -> dict | str:
    srcs = [find(rel) for rel in CRITEO_FILES]
    if None in srcs:
        return f"{' and '.join(CRITEO_FILES)} not found under {', '.join(map(str, data_root()))}"
    lines = [ln for src in srcs for ln in read_lines(src)]
    train, test = out / "train.tsv", out / "test.tsv"
    write_split(lines, train, test)
    return {"train": train, "test": test, "format": "criteo", "time_split": True,
            "source": " + ".join(map(str, srcs)) + ", first 80% / last 20% of the lines"}


def set_attribution(out: Path, args) -> dict | str:
    srcs = [find(rel) for rel in ATTRIBUTION]
    if None in srcs:
        return f"{' and '.join(ATTRIBUTION)} not found under {', '.join(map(str, data_root()))}"
    columns = ["click", "cat1", "cat4", "cat6", "cat8", "cat9"]
    return {"train": srcs[0], "test": srcs[1], "format": "csv", "time_split": False, "label": "click",
            "features": columns[1:], "config": csv_config(out / "mariana.toml", columns, "click", columns[1:], []),
            "source": f"{srcs[0]} / {srcs[1]} (the source's own random split)"}


def set_zozo(out: Path, args) -> dict | str:
    src = find(ZOZO)
    if src is None:
        return f"{ZOZO} not found under {', '.join(map(str, data_root()))}"
    header, *lines = read_lines(src)
    columns = header.decode().strip().split(",")
    train, test = out / "train.csv", out / "test.csv"
    write_split(lines, train, test, header)
    return {"train": train, "test": test, "format": "csv", "time_split": True, "label": "click",
            "features": list(ZOZO_FEATURES),
            "config": csv_config(out / "mariana.toml", columns, "click", ZOZO_FEATURES, ZOZO_IGNORED),
            "source": f"{src}, sorted by time: first 80% / last 20%; ignored: {', '.join(ZOZO_IGNORED)}"}


def set_synth(out: Path, args) -> dict | str:
    from gendata import synthetic_file

    train = synthetic_file(out, "train", args.rows, 1, note)
    test = synthetic_file(out, "test", max(args.rows // 4, 1), 2, note)
    return {"train": train, "test": test, "format": "criteo", "time_split": False, "generated": "synth",
            "source": f"mariana gen criteo --rows {args.rows} --seed 1 / --rows {args.rows // 4} --seed 2"}


def set_drift(out: Path, args) -> dict | str:
    from mariana.sparse.synth_drift import DEFAULT_MODEL_SEED, generate_drift

    rows = args.rows * 5 // 4
    full = out / f"drift_{rows}.tsv"
    stamp = out / f"drift_{rows}.json"
    if not (full.exists() and stamp.exists()):
        note(f"generating {full.name} ({rows:,} rows)")
        stamp.write_text(json.dumps(generate_drift(full, rows, seed=1)))
    train, test = out / "train.tsv", out / "test.tsv"
    cut = write_split(read_lines(full), train, test)
    return {"train": train, "test": test, "format": "criteo", "time_split": True, "generated": "drift",
            "drift": {"rows": rows, "seed": 1, "model_seed": DEFAULT_MODEL_SEED, "cut": cut,
                      **json.loads(stamp.read_text())},
            "source": f"mariana gen criteo-drift --rows {rows} --seed 1, first 80% / last 20%"}


SET_MAKERS = {"criteo": set_criteo, "attribution": set_attribution, "zozo": set_zozo,
              "synth": set_synth, "drift": set_drift}


# ---- tokens: the peers' features ------------------------------------------------------------

def criteo_tokens(path: Path):
    """(labels, 39 token columns, 13 raw integer columns) of a Criteo TSV."""
    import numpy as np
    import pyarrow as pa

    from ctr_peers import read_tsv_chunks, token_columns
    from mariana.sparse.schema import CRITEO_NUMERIC

    tables = list(read_tsv_chunks(path))
    table = pa.concat_tables(tables) if tables else None
    cols = [pa.chunked_array(c) if not isinstance(c, pa.ChunkedArray) else c for c in token_columns(table)]
    ints = np.stack([table.column(n).to_numpy() for n in CRITEO_NUMERIC], axis=1)
    return table.column("label").to_numpy().astype(np.float64), cols, ints


def csv_tokens(path: Path, label: str, features):
    """(labels, one token column per feature, None): `<column>_<value>`, missing `<column>_m`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(
        column_types={c: pa.string() for c in features}, include_columns=[label, *features],
        strings_can_be_null=True))
    cols = []
    for c in features:
        v = pc.fill_null(pc.if_else(pc.equal(table[c], ""), None, table[c]), "m")
        v = pc.replace_substring_regex(v, r"[\s:|]", "_")  # VW's separators
        cols.append(pc.binary_join_element_wise(f"{c}_", v, ""))
    return table[label].to_numpy().astype(np.float64), cols, None


def load_tokens(ds: dict) -> dict:
    """Train and test tokens, integer codes of the tokens (one dictionary per field over
    train + test), and the validation cut (last 20% of the train rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    read = (lambda p: criteo_tokens(p)) if ds["format"] == "criteo" else \
        (lambda p: csv_tokens(p, ds["label"], ds["features"]))
    y_tr, tok_tr, int_tr = read(ds["train"])
    y_te, tok_te, int_te = read(ds["test"])
    codes = []
    for a, b in zip(tok_tr, tok_te):
        joined = pa.chunked_array(a.chunks + b.chunks) if isinstance(a, pa.ChunkedArray) else pa.chunked_array([a, b])
        codes.append(pc.dictionary_encode(joined).combine_chunks().indices.to_numpy(zero_copy_only=False))
    codes = np.stack(codes, axis=1).astype(np.int64)
    n = y_tr.size
    return {"y_tr": y_tr, "y_te": y_te, "tok_tr": tok_tr, "tok_te": tok_te, "codes_tr": codes[:n],
            "codes_te": codes[n:], "int_tr": int_tr, "int_te": int_te, "valid_cut": int(n * 0.8)}


# ---- mariana ------------------------------------------------------------------------------

def mariana_cmd() -> list[str]:
    script = Path(sys.executable).parent / "mariana"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mariana"]


def rss_gib(pid: int) -> float:
    """Resident memory of a process and its children, GiB (from /proc)."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("VmRSS:")), 0)
    return total / (1 << 20)


def children(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


def run_json(cmd: list[str], max_rss_gib: float = MAX_RSS_GIB) -> tuple[dict, float, float]:
    """Run `cmd`, return its last stdout line as JSON, its wall seconds and its peak
    resident GiB (sampled every 0.5 s); a process
    whose memory passes `max_rss_gib` is killed (a shared 2-core, 24 GiB machine)."""
    t0 = time.perf_counter()
    with open(os.devnull, "rb") as stdin, \
            subprocess.Popen(cmd, cwd=REPO, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) as proc:
        peak, out, err = 0.0, "", ""
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                peak = max(peak, rss_gib(proc.pid))
                if peak > max_rss_gib:
                    proc.kill()
                    proc.communicate()
                    raise RuntimeError(f"killed at {peak:.1f} GiB resident after "
                                       f"{time.perf_counter() - t0:.0f} s (limit {max_rss_gib:g} GiB)") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (err.strip() or out.strip()).splitlines()[-3:]
        raise RuntimeError(f"exit {proc.returncode}: " + " | ".join(tail))
    return json.loads(out.strip().splitlines()[-1]), wall, peak


def mariana_predict(model_dir: Path, ds: dict):
    import numpy as np

    cmd = [*mariana_cmd(), "-q", "predict", "--model", str(model_dir), "--data", str(ds["test"])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"predict exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return np.array([float(x) for x in proc.stdout.split()], np.float64)


def run_mariana(kind: str, ds: dict, tok: dict, work: Path, budget: float | None = None) -> dict:
    """`mariana train` (budget None) or `mariana tune --budget`, then predict + score."""
    out = work / (f"tuned-{kind}" if budget else kind)
    shutil.rmtree(out, ignore_errors=True)
    verb = ["tune", "--budget", f"{budget:.1f}"] if budget else ["train"]
    cmd = [*mariana_cmd(), "-q", *verb, "--data", str(ds["train"]), "--test-data", str(ds["test"]),
           "--out", str(out), "--json", *(["--model", kind] if kind != "lr" or budget else []),
           *(["--config", str(ds["config"])] if ds.get("config") else [])]
    record, wall, peak = run_json(cmd)
    result = score(tok["y_te"], mariana_predict(out, ds))
    own = {k: record.get(k) for k in ("auc", "logloss", "calibration", "train_seconds", "epochs", "model_version")}
    extra = {"trials": len(record["trials"]) if isinstance(record.get("trials"), list) else record.get("trials"),
             "best_params": record.get("tune", {}).get("best_params")} if budget else {}
    own_seconds = wall if budget else record.get("train_seconds")
    config = resolved_config(out)
    return result | {"train_seconds": own_seconds, "process_seconds": wall, "peak_rss_gib": round(peak, 2),
                     "command": shlex.join(cmd), "mariana_record": own, "config": config, **extra,
                     "detail": (f"{extra['trials']} trials in {budget:.0f} s; " if budget else "")
                     + config_text(config, record.get("epochs"))}


def resolved_config(model_dir: Path) -> dict:
    """The model, optim and train sections the CURRENT version was trained with (its manifest)."""
    version = (model_dir / "CURRENT").read_text().strip()
    config = json.loads((model_dir / version / "manifest.json").read_text())["config"]
    return {k: config.get(k) for k in ("model", "optim", "train", "hashing")}


def config_text(c: dict, epochs) -> str:
    """'ftrl, batch 1024, 1 epoch' (+ the DNN's interaction) for the table."""
    model, optim, train = c.get("model") or {}, c.get("optim") or {}, c.get("train") or {}
    parts = [optim.get("linear"), f"batch {train.get('batch_size')}", f"epochs {epochs}"]
    if model.get("kind") == "dnn":
        parts.insert(0, f"{model.get('interaction')} {model.get('hidden')}")
    return ", ".join(str(p) for p in parts if p is not None)


def tune_available() -> str | None:
    """None when `mariana tune --help` exits 0, else why not."""
    proc = subprocess.run([*mariana_cmd(), "tune", "--help"], cwd=REPO, capture_output=True, text=True)
    return None if proc.returncode == 0 else "n/a (no tune command)"


# ---- Vowpal Wabbit ----------------------------------------------------------------------

def write_vw(path: Path, labels, cols, rows: slice) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    y = pa.array(np.where(labels[rows] > 0.5, "1", "-1"))
    parts = [pa.chunked_array(c).combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in cols]
    lines = pc.binary_join_element_wise(y, "|a", *(c[rows] for c in parts), " ")
    with open(path, "w") as f:
        f.write("\n".join(lines.to_pylist()) + "\n")
    return path


def vw_fit_predict(train: Path, test: Path, passes: int, l2: float, work: Path) -> tuple:
    """Train one VW model and return (test probabilities, train seconds)."""
    import numpy as np
    from vowpalwabbit import pyvw

    model, preds, cache = work / "vw.model", work / "vw.preds", work / "vw.cache"
    args = f"-d {train} --loss_function logistic -b {VW_BITS} -f {model} --quiet --l2 {l2:g}"
    if passes > 1:
        args += f" --passes {passes} --cache_file {cache} -k --holdout_off"
    t0 = time.perf_counter()
    w = pyvw.Workspace(args)
    w.run_parser()
    w.finish()
    seconds = time.perf_counter() - t0
    p = pyvw.Workspace(f"-i {model} -t -d {test} -p {preds} --link logistic --quiet")
    p.run_parser()
    p.finish()
    return np.loadtxt(preds, dtype=np.float64, ndmin=1), seconds, args


def run_vw(ds: dict, tok: dict, work: Path, grid) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    n, cut = tok["y_tr"].size, tok["valid_cut"]
    train = write_vw(work / "train.vw", tok["y_tr"], tok["tok_tr"], slice(0, n))
    test = write_vw(work / "test.vw", tok["y_te"], tok["tok_te"], slice(None))
    fit = write_vw(work / "fit.vw", tok["y_tr"], tok["tok_tr"], slice(0, cut))
    valid = write_vw(work / "valid.vw", tok["y_tr"], tok["tok_tr"], slice(cut, n))
    points, t0 = [], time.perf_counter()
    for passes, l2 in grid:
        p_valid, _, _ = vw_fit_predict(fit, valid, passes, l2, work)
        p_test, seconds, args = vw_fit_predict(train, test, passes, l2, work)
        points.append({"passes": passes, "l2": l2, "args": args, "train_seconds": seconds,
                       "valid": score(tok["y_tr"][cut:], p_valid), "test": score(tok["y_te"], p_test)})
    grid_seconds = time.perf_counter() - t0
    default = next(p for p in points if p["passes"] == 1 and p["l2"] == 0.0)
    rows = [{"system": "vw (defaults, 1 pass)", **default["test"], "train_seconds": default["train_seconds"],
             "detail": default["args"].split(" -f ")[0].replace(f"-d {train} ", "")}]
    rows += grid_rows("vw", points, grid_seconds, lambda p: f"--passes {p['passes']} --l2 {p['l2']:g}")
    return rows


def grid_rows(name: str, points: list[dict], grid_seconds: float, label) -> list[dict]:
    """'best on test' (chosen by test logloss) and 'picked on valid' (by validation logloss)."""
    best = min(points, key=lambda p: p["test"]["logloss"])
    picked = min(points, key=lambda p: p["valid"]["logloss"])
    extra = {"grid": [{k: v for k, v in p.items() if k not in ("args",)} for p in points],
             "grid_seconds": grid_seconds}
    return [{"system": f"{name} grid, best on test", **best["test"], "train_seconds": best["train_seconds"],
             "detail": f"{label(best)} (optimistic)", **extra},
            {"system": f"{name} grid, picked on valid", **picked["test"], "train_seconds": picked["train_seconds"],
             "detail": f"{label(picked)}; grid {grid_seconds:.0f} s", "grid_seconds": grid_seconds}]


# ---- scikit-learn ---------------------------------------------------------------------------

def sk_path(x_tr, y_tr, x_te, grid):
    """OneHotEncoder (fitted once) + a fresh LogisticRegression for each C. Yields (C, test
    probabilities, seconds = encoding + this fit, converged, iterations). Not warm-started:
    lbfgs's tolerance is on the 1/n-scaled gradient, so a warm start at a larger C stopped
    after 0 iterations at the previous C's weights."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    t0 = time.perf_counter()
    enc = OneHotEncoder(handle_unknown="ignore")
    x = enc.fit_transform(x_tr)
    encode_seconds = time.perf_counter() - t0
    xt = enc.transform(x_te)
    for c in sorted(grid):
        model = LogisticRegression(C=c, max_iter=SK_MAX_ITER)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            model.fit(x, y_tr)
        seconds = encode_seconds + time.perf_counter() - t0
        converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
        yield c, model.predict_proba(xt)[:, 1], seconds, converged, int(model.n_iter_[0])


def run_sklearn(ds: dict, tok: dict, grid) -> list[dict]:
    cut = tok["valid_cut"]
    x, y = tok["codes_tr"], tok["y_tr"]
    t0 = time.perf_counter()
    valid = {c: p for c, p, *_ in sk_path(x[:cut], y[:cut], x[cut:], grid)}
    points = [{"C": c, "train_seconds": seconds, "converged": converged, "iterations": iters,
               "valid": score(y[cut:], valid[c]), "test": score(tok["y_te"], p)}
              for c, p, seconds, converged, iters in sk_path(x, y, tok["codes_te"], grid)]
    return grid_rows("sklearn", points, time.perf_counter() - t0,
                     lambda p: f"C={p['C']:g}" + ("" if p["converged"] else f", not converged in {SK_MAX_ITER} it."))


# ---- torchrec DLRM (its own venv and process) -----------------------------------------------

def dlrm_python(root: Path) -> tuple[Path | None, str]:
    """The DLRM venv's python, made on first use; (None, why) if it cannot be made."""
    venv = root / "dlrm-venv"
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import torchrec.models.dlrm"],
                                      capture_output=True).returncode == 0:
        return py, "ready"
    note(f"installing torchrec into {venv} (torch 2.13.0 CPU from local wheels)")
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
    steps += [[str(py), "-m", "pip", "install", "-q", *pkgs] for pkgs in DLRM_PACKAGES]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            errs = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING: Location")]
            return None, f"n/a ({shlex.join(cmd[-3:])} failed: {' | '.join(errs[-2:])})"
    check = subprocess.run([str(py), "-c", "import torch, torchrec.models.dlrm; "
                                           "assert torch.version.cuda is None, 'a CUDA torch'"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        return None, f"n/a (torchrec does not import: {check.stderr.strip().splitlines()[-1]})"
    return py, "installed"


def dlrm_inputs(tok: dict, path: Path) -> Path:
    """Per field a vocabulary of the training rows (0 = unseen), dense log inputs, labels."""
    import numpy as np

    tr, te = tok["codes_tr"], tok["codes_te"]
    idx_tr, idx_te, sizes = np.empty_like(tr), np.empty_like(te), []
    for f in range(tr.shape[1]):
        vocab = np.unique(tr[:, f])
        idx_tr[:, f] = np.searchsorted(vocab, tr[:, f]) + 1
        pos = np.minimum(np.searchsorted(vocab, te[:, f]), vocab.size - 1)
        idx_te[:, f] = np.where(vocab[pos] == te[:, f], pos + 1, 0)
        sizes.append(vocab.size + 1)

    def dense(x):
        return np.nan_to_num(np.sign(x) * np.log1p(np.abs(x)), nan=0.0).astype(np.float32)

    np.savez(path, sparse_tr=idx_tr, sparse_te=idx_te, dense_tr=dense(tok["int_tr"]),
             dense_te=dense(tok["int_te"]), y_tr=tok["y_tr"].astype(np.float32), sizes=np.array(sizes))
    return path


def run_dlrm(root: Path, tok: dict, work: Path) -> dict:
    import numpy as np

    py, why = dlrm_python(root)
    if py is None:
        raise RuntimeError(why)
    work.mkdir(parents=True, exist_ok=True)
    inputs = dlrm_inputs(tok, work / "dlrm_inputs.npz")
    preds = work / "dlrm_preds.npy"
    record, wall, peak = run_json([str(py), str(Path(__file__).resolve()), "--child-dlrm", str(inputs),
                                   "--child-out", str(preds)])
    return score(tok["y_te"], np.load(preds)) | {
        "train_seconds": record["train_seconds"], "process_seconds": wall, "peak_rss_gib": round(peak, 2),
        "dlrm": record,
        "detail": f"1 epoch, batch {record['batch_size']}, dim {record['embedding_dim']}, Adagrad {record['lr']}"}


def child_dlrm(inputs: str, out: str) -> int:
    """Runs in the DLRM venv: torch + torchrec + numpy only."""
    import numpy as np
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    torch.set_num_threads(2)
    d = np.load(inputs)
    sizes, dim, batch, lr = [int(s) for s in d["sizes"]], 16, 512, 0.05
    keys = [f"f{i}" for i in range(len(sizes))]
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=n, feature_names=[k])
        for k, n in zip(keys, sizes)], device=torch.device("cpu"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=d["dense_tr"].shape[1],
                 dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 32, 1])
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def batch_inputs(sparse, dense, rows):
        ids = torch.from_numpy(np.ascontiguousarray(sparse[rows].T).reshape(-1))  # (F * B,) field-major
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids,
                                                  lengths=torch.ones(len(keys) * len(rows), dtype=torch.int32))
        return torch.from_numpy(dense[rows]), kjt

    n = d["y_tr"].size
    t0 = time.perf_counter()
    model.train()
    for start in range(0, n, batch):  # one epoch, in file order
        rows = np.arange(start, min(start + batch, n))
        dense, kjt = batch_inputs(d["sparse_tr"], d["dense_tr"], rows)
        loss = loss_fn(model(dense, kjt).squeeze(-1), torch.from_numpy(d["y_tr"][rows]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - t0
    model.eval()
    preds = []
    with torch.no_grad():
        for start in range(0, d["sparse_te"].shape[0], 8192):
            rows = np.arange(start, min(start + 8192, d["sparse_te"].shape[0]))
            preds.append(torch.sigmoid(model(*batch_inputs(d["sparse_te"], d["dense_te"], rows))).squeeze(-1).numpy())
    np.save(out, np.concatenate(preds).astype(np.float64))
    print(json.dumps({"train_seconds": seconds, "train_rows": int(n), "batch_size": batch, "embedding_dim": dim,
                      "lr": lr, "optimizer": "Adagrad", "dense_arch": [64, dim], "over_arch": [64, 32, 1],
                      "torch": torch.__version__, "tables": len(sizes), "embedding_rows": int(sum(sizes))}))
    return 0


# ---- references: the planted models, the constant ---------------------------------------------

def synth_oracle(test: Path):
    """True click probabilities of a `mariana gen criteo` file (default model seed), computed
    from its rows with sparse/synth.py's world: the formula of `synth._draw`."""
    import numpy as np

    from ctr_peers import read_tsv_chunks
    from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC
    from mariana.sparse.synth import PAIRS, make_world

    world = make_world()
    logits = []
    for table in read_tsv_chunks(test):
        n = table.num_rows
        logit = np.full(n, world.bias)
        cats = np.full((n, len(CRITEO_CATEGORICAL)), -1, np.int64)
        for c, name in enumerate(CRITEO_CATEGORICAL):
            lookup = {bytes(v).decode(): i for i, v in enumerate(world.values[c])}
            col = table.column(name).to_pylist()
            cats[:, c] = [lookup.get(v, -1) if v is not None else -1 for v in col]
            logit += np.where(cats[:, c] >= 0, world.main[c][np.maximum(cats[:, c], 0)], 0.0)
        for p, (a, b) in enumerate(PAIRS):
            ka, kb = cats[:, a], cats[:, b]
            dot = np.einsum("ij,ij->i", world.latent[p, 0][np.maximum(ka, 0)], world.latent[p, 1][np.maximum(kb, 0)])
            logit += np.where((ka >= 0) & (kb >= 0), world.pair_gain * dot, 0.0)
        for j, name in enumerate(CRITEO_NUMERIC):
            x = table.column(name).to_numpy()
            _, _, _, amp, center, width = world.int_params[j]
            curve = amp * np.tanh((np.log1p(np.maximum(np.nan_to_num(x), 0)) - center) / width)
            logit += np.where(np.isnan(x), world.int_missing_effect[j], curve)
        logits.append(logit)
    return 1 / (1 + np.exp(-np.concatenate(logits)))


def reference_rows(ds: dict, tok: dict) -> list[dict]:
    import numpy as np

    rows = [{"system": "constant (train CTR)", **score(tok["y_te"], np.full(tok["y_te"].size, tok["y_tr"].mean())),
             "train_seconds": None, "detail": f"pCTR {tok['y_tr'].mean():.4f}"}]
    if ds.get("generated") == "synth":
        rows.insert(0, {"system": "planted model (oracle)", **score(tok["y_te"], synth_oracle(ds["test"])),
                        "train_seconds": None, "detail": "sparse/synth.py's own probabilities"})
    elif ds.get("generated") == "drift":
        from mariana.sparse.synth_drift import planted_probabilities

        d = ds["drift"]
        y, p = planted_probabilities(d["rows"], d["seed"], d["model_seed"], start=d["cut"])
        if not np.array_equal(y, tok["y_te"]):
            raise RuntimeError("the drift oracle's labels differ from the test file's")
        rows.insert(0, {"system": "planted model (oracle)", **score(tok["y_te"], p), "train_seconds": None,
                        "detail": f"knows t; on all {d['rows']:,} rows: AUC {d['true_auc']:.4f}"})
    return rows


# ---- the run ----------------------------------------------------------------------------

def attempt(name: str, fn) -> list[dict]:
    t0 = time.perf_counter()
    try:
        rows = fn()
    except Exception as e:  # noqa: BLE001  (a failing system is a row of the table, not the end of the run)
        note(f"{name}: {e}")
        return [{"system": name, "error": str(e)[:400]}]
    rows = rows if isinstance(rows, list) else [{"system": name, **rows}]
    for r in rows:
        note(f"{r['system']}: AUC {fmt(r.get('auc'), '.4f')}, logloss {fmt(r.get('logloss'), '.4f')} "
             f"({time.perf_counter() - t0:.1f} s)")
    return rows


def bench_set(name: str, ds: dict, args, root: Path, tune_why: str | None) -> tuple[list[dict], list[dict]]:
    """(the table's rows, the paired tests) of one data set."""
    work = root / name / "models"
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokens(ds)
    ds["train_rows"], ds["test_rows"] = int(tok["y_tr"].size), int(tok["y_te"].size)
    ds["train_clicks"], ds["test_clicks"] = int(tok["y_tr"].sum()), int(tok["y_te"].sum())
    note(f"{name}: {ds['train_rows']:,} train rows ({ds['train_clicks']:,} clicks), "
         f"{ds['test_rows']:,} test rows ({ds['test_clicks']:,} clicks)")
    rows = reference_rows(ds, tok)
    lr_wall = None
    for system in args.systems:
        if system in ("lr", "dnn"):
            got = attempt(f"mariana-{system}", lambda: run_mariana(system, ds, tok, work))
            if system == "lr" and "error" not in got[0]:
                lr_wall = got[0]["process_seconds"]
        elif system in ("tuned", "tuned-dnn"):
            kind = "dnn" if system == "tuned-dnn" else "lr"
            label = f"mariana-tuned ({kind})"
            if tune_why:
                got = [{"system": label, "error": tune_why}]
            elif lr_wall is None:
                got = [{"system": label, "error": "n/a (needs the default LR run's time: add lr to --systems)"}]
            else:
                got = attempt(label, lambda: run_mariana(kind, ds, tok, work, budget=TUNE_FACTOR * lr_wall))
        elif system == "vw":
            got = attempt("vw", lambda: run_vw(ds, tok, work / "vw", args.vw_grid))
        elif system == "sklearn":
            got = attempt("sklearn", lambda: run_sklearn(ds, tok, args.sk_grid))
        elif system == "dlrm":
            if not ds.get("generated"):
                continue
            got = attempt("torchrec DLRM", lambda: run_dlrm(root, tok, work / "dlrm"))
        rows += got
    return rows, paired(rows, tok["y_te"])


# ---- report -------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def auc_text(r: dict) -> str:
    if r.get("auc") is None:
        return "n/a"
    ci = r.get("auc_ci95")
    return f"{r['auc']:.4f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def markdown(results: dict) -> str:
    out = ["| set | system | AUC [95% CI] | logloss | calib. | train s | wall s | notes |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    for name, entry in results.items():
        if "skipped" in entry:
            out.append(f"| {name} | skipped: {entry['skipped']} | | | | | | |")
            continue
        d = entry["data"]
        label = (f"{name} ({d['train_rows']:,} / {d['test_rows']:,} rows, "
                 f"{d['test_clicks']:,} test clicks{', time split' if d['time_split'] else ''})")
        for r in entry["rows"]:
            if "error" in r:
                out.append(f"| {label} | {r['system']} | {r['error']} | | | | | |")
            else:
                out.append(f"| {label} | {r['system']} | {auc_text(r)} | {fmt(r['logloss'], '.4f')} | "
                           f"{fmt(r['calibration'], '.3f')} | {fmt(r.get('train_seconds'), '.1f')} | "
                           f"{fmt(r.get('process_seconds'), '.1f')} | {r.get('detail', '')} |")
            label = ""
        share = gap_closed(entry["rows"])
        if share is not None:
            out.append(f"| | mariana-dnn's share of the way from mariana-lr's AUC to the oracle's | "
                       f"{share:.1%} | | | | | issue 15's target: 80% |")
    return "\n".join(out)


def gap_closed(rows: list[dict]) -> float | None:
    """(DNN AUC - LR AUC) / (oracle AUC - LR AUC) on a generated set, else None."""
    auc = {r["system"]: r.get("auc") for r in rows}
    lr, dnn, oracle = auc.get("mariana-lr"), auc.get("mariana-dnn"), auc.get("planted model (oracle)")
    if None in (lr, dnn, oracle) or oracle <= lr:
        return None
    return (dnn - lr) / (oracle - lr)


def paired_markdown(results: dict) -> str:
    """One row per tested pair: the differences a - b with their 95% intervals, and what they say."""
    out = ["| set | a - b | AUC a - b [95% CI] | p (DeLong) | logloss a - b [95% CI] | reading |",
           "|---|---|---|---:|---|---|"]
    for name, entry in results.items():
        for r in entry.get("paired", []):
            lo, hi = r["auc_ci95"]
            llo, lhi = r["logloss_ci95"]
            out.append(f"| {name} | {r['a']} - {r['b']} | {r['auc_delta']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                       f"{r['auc_p']:.3f} | {r['logloss_delta']:+.5f} [{llo:+.5f}, {lhi:+.5f}] | {reading(r)} |")
    return "\n".join(out)


def reading(r: dict) -> str:
    """What a pair's intervals say: who is better in AUC and in logloss, or a tie (0 inside)."""
    def side(lo, hi, better_when_positive):
        if lo > 0:
            return "a" if better_when_positive else "b"
        return ("b" if better_when_positive else "a") if hi < 0 else None

    auc, ll = side(*r["auc_ci95"], True), side(*r["logloss_ci95"], False)
    parts = [f"AUC: {'tie' if auc is None else ('a' if auc == 'a' else 'b') + ' better'}",
             f"logloss: {'tie' if ll is None else ('a' if ll == 'a' else 'b') + ' better'}"]
    return ", ".join(parts)


def auc_matrix(results: dict) -> str:
    """Systems x sets, AUC only: the table at a glance."""
    sets = [s for s, e in results.items() if "rows" in e]
    systems = list(dict.fromkeys(r["system"] for s in sets for r in results[s]["rows"]))
    out = ["| system | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
    for system in systems:
        cells = []
        for s in sets:
            r = next((r for r in results[s]["rows"] if r["system"] == system), None)
            cells.append("" if r is None else ("n/a" if r.get("auc") is None else f"{r['auc']:.4f}"))
        out.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=",".join(ALL_SETS), help=f"comma-separated subset of {','.join(ALL_SETS)}")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--rows", type=int, help="training rows of the generated sets (default 200000; --quick 20000)")
    p.add_argument("--quick", action="store_true", help="20k generated rows, grids of 4 (VW) and 2 (sklearn) points")
    p.add_argument("--out-dir", default=str(REPO / "bench-out" / "quality"), help="prepared data, models, results")
    p.add_argument("--child-dlrm", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for flag, given, known in (("--sets", args.sets, ALL_SETS), ("--systems", args.systems, ALL_SYSTEMS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            p.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    args.rows = args.rows or (20_000 if args.quick else 200_000)
    if args.rows < 100:
        p.error("--rows must be >= 100")
    args.vw_grid = [(p_, l2) for p_, l2 in VW_GRID if not args.quick or (p_ in (1, 3) and l2 in (0.0, 1e-6))]
    args.sk_grid = (0.1, 1.0) if args.quick else SK_GRID
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_dlrm:
        return child_dlrm(args.child_dlrm, args.child_out)
    from ctr_peers import PACKAGES, machine_info

    root = Path(args.out_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # imports from a cold disk cache would count in the first mariana run, and so in the tune budget
    subprocess.run([sys.executable, "-c", "import torch, pyarrow, mariana.trainer.job, mariana.services.cli"], cwd=REPO)
    tune_why = tune_available() if {"tuned", "tuned-dnn"} & set(args.systems) else None
    results = {}
    for name in args.sets:
        (root / name).mkdir(exist_ok=True)
        ds = SET_MAKERS[name](root / name, args)
        if isinstance(ds, str):
            note(f"skipping {name}: {ds}")
            results[name] = {"skipped": ds}
            continue
        rows, pairs = bench_set(name, ds, args, root, tune_why)
        results[name] = {"data": {k: str(v) if isinstance(v, Path) else v for k, v in ds.items()},
                         "rows": without_probs(rows), "dnn_gap_closed": gap_closed(rows),
                         "paired": pairs}
    seconds = time.perf_counter() - t0
    table, matrix, pairs = markdown(results), auc_matrix(results), paired_markdown(results)
    machine = machine_info(PACKAGES + ("optuna",)) | {"seconds": round(seconds, 1)}
    header = (f"bench/quality.py, {machine['date']}, {machine['nproc']} cores ({machine['cpu_model']}), "
              f"no GPU used; {seconds / 60:.1f} min; `{machine['command']}`")
    print(f"\n{header}\n\n{table}\n\nAUC by set:\n\n{matrix}\n\nPaired on the same test rows:\n\n{pairs}\n")
    (root / "results.md").write_text(f"{header}\n\n{table}\n\n{matrix}\n\n{pairs}\n")
    settings = {"sets": args.sets, "systems": args.systems, "rows": args.rows, "quick": args.quick,
                "vw_grid": args.vw_grid, "vw_bits": VW_BITS, "sklearn_grid": list(args.sk_grid),
                "tune_factor": TUNE_FACTOR}
    (root / "results.json").write_text(json.dumps({"machine": machine, "settings": settings,
                                                   "results": results}, indent=1, default=str) + "\n")
    note(f"wrote {root / 'results.json'} and results.md in {seconds:.0f} s")
    failed = [r["system"] for e in results.values() for r in e.get("rows", []) if "error" in r]
    return 1 if failed and not all(r.startswith("mariana-tuned") or r == "torchrec DLRM" for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
