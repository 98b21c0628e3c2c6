"""Speech mode benchmark (issue 17): synchronous data parallel on FSDD's spoken
digits, each exchange side by side in one run.

For each exchange (exact, fp16, powersgd:R, onebit): `mariana train speech
--nproc 2 --threads 1` (two ranks, one thread each) on the official split; and
`--nproc 1 --threads 1` as the baseline. One round runs every configuration once
(interleaved, so a burst of host load hits them alike); --seeds rounds, each with
its own seed; the table shows medians. Per configuration:

- bytes each rank sends per step: counted from what the hooks hand to the
  collectives (ring model), and what the process wrote (/proc/self/io wchar);
- test accuracy (300 utterances: one error is 0.33 points);
- samples (frames) per second of training, and the scaling efficiency
  N=2 / (2 x N=1).

Then, unless --no-speakers, the accuracy with each of the 6 speakers held out
(one process, exact, one seed: no target, for reference).

    .venv/bin/python bench/speech_dp.py                      # ~12 min on 2 cores
    .venv/bin/python bench/speech_dp.py --seeds 1 --no-speakers --exchanges exact,onebit

Writes bench-out/speech_dp/results.json (with the machine) and prints a Markdown
table; exits 1 when a target of issue 17 is missed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ctr_peers import machine_info, report_targets  # noqa: E402  (bench/ is on sys.path when run as a script)
from mariana.trainer.strategies.data_parallel import DEFAULT_APPROX, parse_exchange  # noqa: E402

SPEAKERS = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def train(nproc: int, exchange: str, seed: int, split: str = "official", threads: int = 1,
          extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="speech-bench-") as out:
        cmd = [sys.executable, "-m", "mariana", "-q", "train", "speech", "--nproc", str(nproc), "--threads",
               str(threads), "--exchange", exchange, "--seed", str(seed), "--split", split, "--out", out, "--json",
               *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout)
        result["wall_seconds"] = round(time.perf_counter() - t0, 2)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="rounds, one seed each (default 3: medians of 3)")
    ap.add_argument("--exchanges", default="exact,fp16,powersgd:1,powersgd:4,onebit")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--no-speakers", action="store_true", help="skip the held-out speaker runs")
    ap.add_argument("--out-dir", default=str(REPO / "bench-out" / "speech_dp"))
    args = ap.parse_args()
    exchanges = [str(parse_exchange(e)) for e in args.exchanges.split(",")]
    approx = str(parse_exchange(DEFAULT_APPROX))
    if "exact" not in exchanges:
        exchanges.insert(0, "exact")
    if approx not in exchanges:
        exchanges.append(approx)
    runs: dict[str, list[dict]] = {}
    epochs = ("--epochs", str(args.epochs))
    for seed in range(args.seeds):
        for key, nproc, ex in [("N=1", 1, "exact")] + [(f"N=2 {e}", 2, e) for e in exchanges]:
            r = train(nproc, ex, seed, extra=epochs)
            runs.setdefault(key, []).append(r)
            note(f"seed {seed} {key}: accuracy {r['test_accuracy']:.4f}, {r['samples_per_s']:,.0f} frames/s, "
                 f"{r['bytes_per_step']:,.0f} B/step (wrote {r['io_bytes_per_step'] or 0:,.0f}), "
                 f"identical {r['replicas_identical']}")
    base_sps = statistics.median(r["samples_per_s"] for r in runs["N=1"])
    exact_bytes = statistics.median(r["bytes_per_step"] for r in runs["N=2 exact"])
    exact_acc = statistics.median(r["test_accuracy"] for r in runs["N=2 exact"])
    rows = {}
    for key, rs in runs.items():
        sps = statistics.median(r["samples_per_s"] for r in rs)
        sent = statistics.median(r["bytes_per_step"] for r in rs)
        io = [r["io_bytes_per_step"] for r in rs if r["io_bytes_per_step"] is not None]
        rows[key] = {"accuracy_median": statistics.median(r["test_accuracy"] for r in rs),
                     "accuracies": [r["test_accuracy"] for r in rs], "samples_per_s": sps,
                     "efficiency": round(sps / (2 * base_sps), 3) if key != "N=1" else None,
                     "bytes_per_step": sent, "io_bytes_per_step": statistics.median(io) if io else None,
                     "fewer_bytes_than_exact": round(exact_bytes / sent, 1) if key != "N=1" and sent else None,
                     "replicas_identical": all(r["replicas_identical"] for r in rs)}
    speakers = {}
    if not args.no_speakers:
        for who in SPEAKERS:
            r = train(1, "exact", 0, f"speaker:{who}", threads=0, extra=epochs)
            speakers[who] = r["test_accuracy"]
            note(f"speaker {who} held out: accuracy {r['test_accuracy']:.4f}")
    a = rows[f"N=2 {approx}"]
    targets = {
        "exact N=1 accuracy >= 0.99": rows["N=1"]["accuracy_median"] >= 0.99,
        "exact N=2 accuracy >= 0.99": exact_acc >= 0.99,
        f"{approx} sends >= 10x fewer bytes": (a["fewer_bytes_than_exact"] or 0) >= 10,
        f"{approx} loses <= 0.67 points": a["accuracy_median"] >= exact_acc - 0.0067 - 1e-9,
        "exact efficiency >= 0.77": rows["N=2 exact"]["efficiency"] >= 0.77,
        f"{approx} efficiency >= 0.85": a["efficiency"] >= 0.85,
        "replicas identical under every exchange": all(r["replicas_identical"] for r in rows.values()),
    }
    record = {"machine": machine_info(), "epochs": args.epochs, "seeds": args.seeds, "default_approx": approx,
              "rows": rows, "speakers": speakers, "targets": targets, "runs": runs}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2))
    print("| ranks, exchange | test accuracy (median; seeds) | frames/s | efficiency | bytes/rank/step "
          "(counted; written) | fewer than exact |")
    print("|---|---|---:|---:|---:|---:|")
    for key, r in rows.items():
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        fewer = "" if r["fewer_bytes_than_exact"] is None else f"{r['fewer_bytes_than_exact']:.1f}x"
        io = "" if r["io_bytes_per_step"] is None else f"; {r['io_bytes_per_step']:,.0f}"
        print(f"| {key} | {r['accuracy_median']:.4f} ({', '.join(f'{x:.4f}' for x in r['accuracies'])}) | "
              f"{r['samples_per_s']:,.0f} | {eff} | {r['bytes_per_step']:,.0f}{io} | {fewer} |")
    if speakers:
        print("\n| held-out speaker | " + " | ".join(speakers) + " |")
        print("|---|" + "---:|" * len(speakers))
        print("| accuracy | " + " | ".join(f"{v:.4f}" for v in speakers.values()) + " |")
    return report_targets(targets, record["machine"], out / "results.json")


if __name__ == "__main__":
    sys.exit(main())
