"""The training pipeline against local mode, in one run (issue 3): local vs
cluster with 1 worker, 1 shard, 1 preprocess; the cached epoch 2 vs the
parsed epoch 1; rows/s and stage seconds for 1-2 workers x 1-2 shards.

The numbers for docs/benchmarks.md come from this command, in the repository root:

    .venv/bin/python bench/pipeline.py --rows 1000000 --repeat 3

Other uses:

    .venv/bin/python bench/pipeline.py --rows 100000 --grid 1x1             # a quick look
    .venv/bin/python bench/pipeline.py --model dnn --grid 1x1,2x1 --preprocess 2
    .venv/bin/python bench/pipeline.py --rows 1000000 --cpu 5 --repeat 2   # CPU per cached epoch by process
    .venv/bin/python bench/pipeline.py --rows 1000000 --cpu-first --repeat 3  # epoch 1's CPU, local and W1 S1

Data (in bench-out/pipeline/, reused when the row count matches):
`train-<N>.tsv` (`mariana gen criteo`, seed 1) and `test-<M>.tsv` (seed 2,
M = max(N/10, 20000)).

Every configuration is its own `mariana train --json` process: local mode, or
`--mode cluster --workers W --ps S --preprocess P`, which starts a fresh local
cluster for the job and stops it afterwards (MARIANA_CLUSTER__DIR points at an
empty dir, so a cluster someone has up is never used). What is compared is the
record's `epoch_seconds`: training only; cluster start-up and stop, model
save and test evaluation are outside it. rows/s = rows of all epochs / sum of
epoch_seconds, in both modes. `--repeat R` runs local and W1 S1 R times each,
interleaved (local, cluster, local, ...); tables show medians, the JSON keeps
every run. `stage_seconds` (read, parse, hash, cache, fetch, pull, compute,
push) are summed over processes, so with several of them they can exceed the
wall time.

Writes bench-out/pipeline/results.json (every record, the machine) and
results.md (to paste into docs/benchmarks.md). Exits 1 when a run fails or a
cluster run does not apply every row exactly once per epoch.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gendata import synthetic_file  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
TRAIN_SEED, TEST_SEED = 1, 2
MIN_TEST_ROWS = 20_000
TARGET_RATIO, TARGET_SPEEDUP = 0.80, 3.0
FIXED_ROWS = 1_000  # --cpu-first: a job on this many rows costs what every job costs besides its epoch
DEFAULT_GRID = "1x1,1x2,2x1,2x2"  # workers x shards


class RunFailed(Exception):
    pass


def note(message: str) -> None:
    print(f"pipeline: {message}", file=sys.stderr, flush=True)


# ---- one run -------------------------------------------------------------------------------

def config_label(cluster: tuple[int, int, int] | None) -> str:
    return "local" if cluster is None else "cluster W{} S{} P{}".format(*cluster)


def train_command(args: argparse.Namespace, data: dict, cluster: tuple | None, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "mariana.services.cli", "-q", "train", "--data", str(data["train"]),
           "--test-data", str(data["test"]), "--model", args.model, "--epochs", str(args.epochs),
           "--out", str(out), "--json"]
    if cluster is not None:
        cmd += ["--mode", "cluster", "--workers", str(cluster[0]), "--ps", str(cluster[1]),
                "--preprocess", str(cluster[2])]
    return cmd


def run_train(args: argparse.Namespace, data: dict, cluster: tuple | None, run: int, out_dir: Path) -> dict:
    """One `mariana train` process; its record plus the derived rows/s."""
    label = config_label(cluster)
    model_dir = out_dir / "models" / f"{label.replace(' ', '-')}-r{run}"
    shutil.rmtree(model_dir, ignore_errors=True)  # mariana would add a version to an old model dir
    env = os.environ | {"MARIANA_CLUSTER__DIR": str(out_dir / "no-cluster")}
    proc = subprocess.run(train_command(args, data, cluster, model_dir), cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-15:]
        note(f"{label} run {run} failed (exit {proc.returncode}):\n    " + "\n    ".join(tail))
        raise RunFailed(label)
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    rows, seconds = record["rows_per_epoch"], record["epoch_seconds"]
    result = {"label": label, "run": run, "rows_per_s": sum(rows) / sum(seconds),
              "epoch_rows_per_s": [r / s for r, s in zip(rows, seconds)], "record": record}
    result["check"] = exactly_once(result, data["train_rows"], args.epochs)
    note(f"{label} run {run}: {result['rows_per_s']:,.0f} rows/s, epochs "
         f"{', '.join(f'{s:.2f}' for s in seconds)} s, auc {record['auc']:.4f}; {result['check']['text']}")
    return result


def exactly_once(result: dict, file_rows: int, epochs: int) -> dict:
    """Cluster: rows_applied == rows_in_data x epochs (and every file row seen); local: train rows."""
    r = result["record"]
    if "rows_applied" not in r:
        ok = r["train_rows"] == file_rows * epochs
        return {"ok": ok, "text": f"train_rows {r['train_rows']:,} == {file_rows:,} x {epochs}: "
                                  f"{'ok' if ok else 'MISMATCH'}"}
    ok = r["rows_applied"] == r["rows_in_data"] * epochs and r["rows_in_data"] == file_rows
    return {"ok": ok, "text": f"rows_applied {r['rows_applied']:,} == rows_in_data {r['rows_in_data']:,} "
                              f"(file: {file_rows:,}) x {epochs}: {'ok' if ok else 'MISMATCH'}; "
                              f"bad_messages {r['bad_messages']}; cache misses {r['cache_misses']}"}


# ---- CPU per cached epoch (--cpu) ------------------------------------------------------------

def cluster_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of `mariana train` (pid `root`) and the processes it
    started: the services of its cluster and their redis-server."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(pid) != root and int(fields[1]) != root:  # fields[1]: the parent's pid
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone
            continue
        role = ("" if argv == [""]  # a zombie: its CPU is final, its command line gone
                else "redis" if any("redis-server" in a for a in argv)
                else argv[argv.index("run") + 1] if "run" in argv[:-1] else "train")
        out[int(pid)] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return out


def run_cpu(args: argparse.Namespace, data: dict, epochs: int, run: int, out_dir: Path,
            local: bool = False) -> dict:
    """A W1 S1 job (or a local one) of `epochs` epochs; CPU seconds of its processes by role,
    sampled from /proc."""
    model_dir = out_dir / "models" / f"cpu-{epochs}-r{run}"
    shutil.rmtree(model_dir, ignore_errors=True)
    cmd = train_command(argparse.Namespace(**{**vars(args), "epochs": epochs}), data,
                        None if local else (1, 1, args.preprocess), model_dir)
    seen: dict[int, tuple[str, float]] = {}
    with subprocess.Popen(cmd, cwd=REPO, env=os.environ | {"MARIANA_CLUSTER__DIR": str(out_dir / "no-cluster")},
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        while proc.poll() is None:
            for pid, (role, cpu) in cluster_cpu(proc.pid).items():  # a process that ended keeps its last
                seen[pid] = (role or seen.get(pid, ("train", 0.0))[0], cpu)
            time.sleep(0.05)
        out = proc.stdout.read()
    if proc.returncode != 0:
        note(f"cpu run of {epochs} epochs failed (exit {proc.returncode})")
        raise RunFailed(f"cpu {epochs}")
    by_role: dict[str, float] = {}
    for role, seconds in seen.values():
        by_role[role] = by_role.get(role, 0.0) + seconds
    record = json.loads(out.strip().splitlines()[-1])
    note(f"cpu run {run}, {'local' if local else 'W1 S1'}, {data['train_rows']:,} rows, {epochs} epochs: epochs "
         f"{record['epoch_seconds']} s; core-seconds " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_role.items())))
    return {"epochs": epochs, "run": run, "cpu": by_role, "epoch_seconds": record["epoch_seconds"],
            "rows": data["train_rows"], "mode": "local" if local else "W1 S1"}


def bench_first_cpu(args: argparse.Namespace, out_dir: Path) -> int:
    """Epoch 1's CPU by role, local mode and W1 S1: a 1-epoch job on --rows rows less one on
    FIXED_ROWS rows (start, stop, model save and test scoring cost both alike); rounds of
    local and cluster interleaved."""
    data = bench_data(args, out_dir)
    small = {**data, "train": synthetic_file(out_dir, "train", FIXED_ROWS, TRAIN_SEED, note), "train_rows": FIXED_ROWS}
    rounds = []
    for k in range(1, args.repeat + 1):
        for local in (True, False):
            big, tiny = run_cpu(args, data, 1, k, out_dir, local), run_cpu(args, small, 1, k, out_dir, local)
            roles = sorted(set(big["cpu"]) | set(tiny["cpu"]))
            rounds.append({"run": k, "mode": big["mode"], "epoch_seconds": big["epoch_seconds"][0],
                           "cpu": {r: big["cpu"].get(r, 0.0) - tiny["cpu"].get(r, 0.0) for r in roles}})
    roles = sorted({r for x in rounds for r in x["cpu"]} - {"train"}) + ["train"]
    lines = [f"Epoch 1's CPU, core-seconds (a 1-epoch job on {args.rows:,} rows - one on {FIXED_ROWS:,} rows), "
             f"model {args.model}; `train` is the `mariana train` process (local mode: all of it):", "",
             "| run | mode | epoch 1 s | " + " | ".join(roles) + " | all | all / epoch 1 s |",
             "|---|---|---:|" + "---:|" * (len(roles) + 2)]
    for x in rounds:
        total = sum(x["cpu"].values())
        lines.append(f"| {x['run']} | {x['mode']} | {x['epoch_seconds']:.2f} | "
                     + " | ".join(f"{x['cpu'][r]:.2f}" if r in x["cpu"] else "-" for r in roles)
                     + f" | {total:.2f} | {total / x['epoch_seconds']:.2f} |")
    med = {m: (statistics.median(x["epoch_seconds"] for x in rounds if x["mode"] == m),
               statistics.median(sum(x["cpu"].values()) for x in rounds if x["mode"] == m)) for m in ("local", "W1 S1")}
    lines += ["", f"Medians: local epoch 1 {med['local'][0]:.2f} s on {med['local'][1]:.2f} core-s; W1 S1 "
              f"{med['W1 S1'][0]:.2f} s on {med['W1 S1'][1]:.2f} core-s: epoch 1 rows/s ratio "
              f"{med['local'][0] / med['W1 S1'][0]:.2f}, CPU ratio {med['W1 S1'][1] / med['local'][1]:.2f}x"]
    print("\n".join(lines))
    (out_dir / "cpu_first.json").write_text(json.dumps({"machine": machine_info(), "rounds": rounds}, indent=1))
    note(f"wrote {out_dir / 'cpu_first.json'}")
    return 0


def bench_data(args: argparse.Namespace, out_dir: Path) -> dict:
    """The generated train and test files (made once per row count), and their row counts."""
    rows_test = max(args.rows // 10, MIN_TEST_ROWS)
    return {"train": synthetic_file(out_dir, "train", args.rows, TRAIN_SEED, note),
            "test": synthetic_file(out_dir, "test", rows_test, TEST_SEED, note),
            "train_rows": args.rows, "test_rows": rows_test}


def bench_cpu(args: argparse.Namespace, out_dir: Path) -> int:
    """CPU per cached epoch by role: (an N-epoch job - a 1-epoch job) / (N - 1), runs interleaved."""
    data = bench_data(args, out_dir)
    n, pairs = args.cpu, []
    for k in range(1, args.repeat + 1):
        pairs.append((run_cpu(args, data, 1, k, out_dir), run_cpu(args, data, n, k, out_dir)))
    roles = sorted({r for one, many in pairs for r in (*one["cpu"], *many["cpu"])})
    lines = [f"CPU per cached epoch, core-seconds ({n}-epoch job - 1-epoch job) / {n - 1}, W1 S1, "
             f"{args.rows:,} rows, model {args.model}:", "",
             "| run | " + " | ".join(roles) + " | all | cached epochs s |",
             "|---|" + "---:|" * (len(roles) + 2)]
    for one, many in pairs:
        per = {r: (many["cpu"].get(r, 0.0) - one["cpu"].get(r, 0.0)) / (n - 1) for r in roles}
        lines.append(f"| {one['run']} | " + " | ".join(f"{per[r]:.2f}" for r in roles)
                     + f" | {sum(per.values()):.2f} | " + ", ".join(f"{s:.2f}" for s in many["epoch_seconds"][1:])
                     + " |")
    print("\n".join(lines))
    (out_dir / "cpu.json").write_text(json.dumps({"machine": machine_info(), "pairs": pairs}, indent=1))
    note(f"wrote {out_dir / 'cpu.json'}")
    return 0


# ---- summary ---------------------------------------------------------------------------------

def median_of(runs: list[dict], get) -> float:
    return statistics.median(get(r) for r in runs)


def summarize(runs: list[dict]) -> dict:
    """Per configuration: medians over its runs (stage seconds stage by stage)."""
    rec = runs[0]["record"]
    epochs = range(len(rec["epoch_seconds"]))
    stages = rec.get("stage_seconds", {})
    return {
        "runs": len(runs),
        "rows_per_s": median_of(runs, lambda r: r["rows_per_s"]),
        "epoch_rows_per_s": [median_of(runs, lambda r: r["epoch_rows_per_s"][e]) for e in epochs],
        "epoch_seconds": [median_of(runs, lambda r: r["record"]["epoch_seconds"][e]) for e in epochs],
        "speedup": median_of(runs, lambda r: r["record"]["epoch_seconds"][0] / r["record"]["epoch_seconds"][1]),
        "auc": median_of(runs, lambda r: r["record"]["auc"]),
        "logloss": median_of(runs, lambda r: r["record"]["logloss"]),
        "stage_seconds": {s: median_of(runs, lambda r: r["record"]["stage_seconds"][s]) for s in stages},
    }


def targets(local: dict, cluster: dict) -> dict:
    ratio = cluster["rows_per_s"] / local["rows_per_s"]
    return {"cluster_vs_local_rows_per_s": ratio, "ratio_pass": ratio >= TARGET_RATIO,
            "cluster_vs_local_epoch_rows_per_s": [c / l for c, l in zip(cluster["epoch_rows_per_s"],
                                                                        local["epoch_rows_per_s"])],
            "cluster_minus_local_auc": cluster["auc"] - local["auc"],
            "cluster_epoch1_over_epoch2": cluster["speedup"], "speedup_pass": cluster["speedup"] >= TARGET_SPEEDUP,
            "local_epoch1_over_epoch2": local["speedup"]}


# ---- report ----------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def compare_table(s: dict[str, dict], pair: list[str]) -> str:
    lines = ["| mode | runs | rows/s | epoch 1 rows/s | epoch 2 rows/s | epoch 1 s | epoch 2 s | AUC | logloss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label in pair:
        r = s[label]
        lines.append(f"| {label} | {r['runs']} | {r['rows_per_s']:,.0f} | {r['epoch_rows_per_s'][0]:,.0f} | "
                     f"{r['epoch_rows_per_s'][1]:,.0f} | {r['epoch_seconds'][0]:.2f} | {r['epoch_seconds'][1]:.2f} | "
                     f"{r['auc']:.4f} | {r['logloss']:.4f} |")
    return "\n".join(lines)


def grid_table(s: dict[str, dict], grid: list[str]) -> str:
    stages = list(s[grid[0]]["stage_seconds"])
    lines = ["| config | rows/s | epoch 1 rows/s | epoch 2 rows/s | " + " | ".join(stages) + " | largest |",
             "|---|" + "---:|" * (3 + len(stages)) + "---|"]
    for label in grid:
        r, st = s[label], s[label]["stage_seconds"]
        lines.append(f"| {label} | {r['rows_per_s']:,.0f} | {r['epoch_rows_per_s'][0]:,.0f} | "
                     f"{r['epoch_rows_per_s'][1]:,.0f} | " + " | ".join(f"{st[k]:.2f}" for k in stages) +
                     f" | {max(st, key=st.get)} |")
    return "\n".join(lines)


def target_lines(t: dict, runs: list[dict], pair: list[str]) -> str:
    def seconds(label: str) -> str:
        return ", ".join(f"{sum(r['record']['epoch_seconds']):.2f}" for r in runs if r["label"] == label)

    e1, e2 = t["cluster_vs_local_epoch_rows_per_s"][:2]
    return "\n".join([
        f"- {pair[1]} rows/s / local rows/s: **{t['cluster_vs_local_rows_per_s']:.2f}** (target >= "
        f"{TARGET_RATIO:.2f}: {verdict(t['ratio_pass'])}); epoch 1 {e1:.2f}, epoch 2 {e2:.2f} "
        f"(training s per run: local {seconds(pair[0])}; cluster {seconds(pair[1])})",
        f"- {pair[1]} epoch 1 s / epoch 2 s (epoch 2 replayed from the Redis sample cache): "
        f"**{t['cluster_epoch1_over_epoch2']:.2f}x** (target >= {TARGET_SPEEDUP:.0f}x: "
        f"{verdict(t['speedup_pass'])}); local, which parses both epochs: {t['local_epoch1_over_epoch2']:.2f}x",
        f"- cluster AUC - local AUC: {t['cluster_minus_local_auc']:+.4f}",
    ])


def check_lines(runs: list[dict]) -> str:
    return "\n".join(f"- {r['label']} run {r['run']}: {r['check']['text']}" for r in runs)


def report_body(args, data: dict, s: dict, t: dict, runs: list[dict], pair: list[str], grid: list[str]) -> str:
    return "\n\n".join([
        f"{data['train_rows']:,} train rows, {data['test_rows']:,} test rows; model {args.model}, "
        f"{args.epochs} epochs; medians of {args.repeat} run(s) for local and {pair[1]}",
        compare_table(s, pair), target_lines(t, runs, pair),
        "Cluster grid. Stage seconds: medians over runs of wall-clock spans summed over every process "
        "of a stage, so with several workers or preprocess they can exceed the run's time, and on a busy "
        "host they include waiting for a core; read, parse, hash (encode + split + pack), cache: the "
        "source pass (epoch 1, and refills); fetch, pull, compute, push: every epoch.",
        grid_table(s, grid),
        "Each run: every row applied exactly once per epoch, and bad messages:", check_lines(runs),
    ])


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv), "cpu_model": cpu,
            "cores": len(os.sched_getaffinity(0)), "git": git.stdout.strip() or None}


def markdown(machine: dict, body: str) -> str:
    return (f"## Training pipeline: local vs cluster (`bench/pipeline.py`)\n\n"
            f"- **Date:** {machine['date'][:10]}, at commit {machine['git']}\n"
            f"- **Machine:** {machine['cores']} cores ({machine['cpu_model']})\n"
            f"- **Command:** `{machine['command']}`\n\n{body}\n")


# ---- main ------------------------------------------------------------------------------------

def bench(args: argparse.Namespace, out_dir: Path) -> int:
    data = bench_data(args, out_dir)
    base = (1, 1, args.preprocess)
    grid_configs = [(w, s, args.preprocess) for w, s in args.grid]
    runs = []
    for k in range(1, args.repeat + 1):  # interleaved: the host's load drifts
        runs += [run_train(args, data, None, k, out_dir), run_train(args, data, base, k, out_dir)]
    runs += [run_train(args, data, c, 1, out_dir) for c in grid_configs if c != base]

    labels = list(dict.fromkeys(r["label"] for r in runs))
    summary = {label: summarize([r for r in runs if r["label"] == label]) for label in labels}
    pair, grid = [config_label(None), config_label(base)], [config_label(c) for c in grid_configs]
    t = targets(summary[pair[0]], summary[pair[1]])
    body = report_body(args, data, summary, t, runs, pair, grid)
    print("\n" + body)

    machine = machine_info()
    (out_dir / "results.md").write_text(markdown(machine, body))
    (out_dir / "results.json").write_text(json.dumps({
        "machine": machine, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "data": {k: str(v) for k, v in data.items()}, "summary": summary, "targets": t, "runs": runs}, indent=1))
    note(f"wrote {out_dir / 'results.md'} and results.json")
    return 0 if all(r["check"]["ok"] for r in runs) else 1


def parse_grid(spec: str) -> list[tuple[int, int]]:
    """'1x1,2x2' -> [(1, 1), (2, 2)]: workers x shards."""
    try:
        cells = [tuple(int(n) for n in cell.split("x")) for cell in spec.split(",") if cell.strip()]
    except ValueError:
        cells = []
    if not cells or any(len(c) != 2 or min(c) < 1 for c in cells):
        raise argparse.ArgumentTypeError(f"{spec!r}: want WORKERSxSHARDS,... e.g. {DEFAULT_GRID}")
    return cells


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="generated training rows (test: rows/10, >= 20k)")
    p.add_argument("--model", choices=("lr", "dnn"), default="lr")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (>= 2: epoch 2 is the cached one)")
    p.add_argument("--repeat", type=int, default=1, help="runs of local and W1 S1, interleaved; medians count")
    p.add_argument("--grid", type=parse_grid, default=DEFAULT_GRID,
                   help=f"cluster configs WORKERSxSHARDS, comma-separated (default {DEFAULT_GRID}); one run each, "
                        "W1 S1 reuses the paired runs")
    p.add_argument("--preprocess", type=int, default=1, help="preprocess processes in every cluster run")
    p.add_argument("--cpu", type=int, metavar="EPOCHS", default=0,
                   help="instead: CPU per cached epoch by process role, from W1 S1 jobs of 1 and EPOCHS (>= 2) "
                        "epochs (--repeat pairs), read from /proc")
    p.add_argument("--cpu-first", action="store_true",
                   help="instead: epoch 1's CPU by process role, local and W1 S1 (--repeat rounds), from jobs on "
                        f"--rows and on {FIXED_ROWS:,} rows")
    p.add_argument("--out-dir", default=str(REPO / "bench-out" / "pipeline"),
                   help="data, models and results (default: bench-out/pipeline/ in the repository)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.epochs < 2 or args.repeat < 1 or args.preprocess < 1 or args.cpu == 1 or args.cpu < 0:
        p.error("--rows, --repeat and --preprocess must be >= 1, --epochs and --cpu >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    (out_dir / "models").mkdir(parents=True, exist_ok=True)
    try:
        if args.cpu_first:
            return bench_first_cpu(args, out_dir)
        return bench_cpu(args, out_dir) if args.cpu else bench(args, out_dir)
    except RunFailed:
        return 1


if __name__ == "__main__":
    sys.exit(main())
