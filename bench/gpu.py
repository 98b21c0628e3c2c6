"""One-GPU figures and checks for the speech and image modes (issues 17 and 18), for a host
with one CUDA device (the lent GPU machines). N=2, P=2 and G=2 on CUDA need one GPU per
rank, so a host with 2+ GPUs; here they must be refused before any rank starts.

1. speech: `mariana train speech --nproc 1 --device cuda` (official split, defaults):
   test accuracy and frames/s.
2. image, mnist preset (its defaults), P=1 on CUDA: held-out accuracy and images/s.
3. image, wide preset on `mariana gen images` data (batch 64, M=8, as
   bench/image_parallel.py): each component of trainer/memory.py's meter against
   `max_memory_allocated`'s rise over the first step and torch's profiler (its CUDA
   timeline), with and without --recompute.
4. image, wide preset, images/s on CUDA (the median of the epochs after the first): NHWC
   (the default) and NCHW, --recompute, a 256-image batch, and the input pipeline: in-memory
   images and the same images as JPEG files, each with --prefetch 2 and --prefetch 0.
5. refusals on a one-GPU host: `train speech --nproc 2` and `train image --partitions 2`
   with --device cuda exit 2 with one error line.
6. unless --no-cpu-scaling, the CPU scaling targets of issues 17 and 18 on the host's own
   cores (16 on the lent hosts, against this project's 2-core VM, where the ranks share the
   cores with everything else): speech N=2 against N=1, one thread per rank, `exact` and
   the default approximate exchange (samples/s, efficiency N=2 / (2 x N=1)); the wide
   preset's P=2 (`--balance time`, M=8) against P=1, one thread per rank.

    python3 bench/gpu.py                                   # ~4 min on one H100 without step 6 (--no-cpu-scaling)
    python3 bench/gpu.py --only cpu-scaling --epochs 3     # step 6 alone: ~4 min on the lent H200 host (16 cores)
    .venv/bin/python bench/gpu.py --device cpu --rows 300 --epochs 2   # the same steps on the CPU

Writes OUT_DIR/results.json (with the machine) and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ctr_peers import machine_info  # noqa: E402  (bench/ is on sys.path when run as a script)
from image_parallel import BATCH, MICRO, mariana, steady  # noqa: E402

MIB = 2 ** 20
STEPS = ("speech", "mnist", "memory", "speed", "cpu-scaling", "refusals")


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_json(*args: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as out:
        return json.loads(mariana(*args, "--out", out, "--json").stdout)


def wide(device: str, data: str, epochs: int, *extra: str) -> dict:
    return run_json("train", "image", "--data", data, "--preset", "wide", "--device", device, "--epochs",
                    str(epochs), "--batch-size", str(BATCH), "--microbatches", str(MICRO), "--test-images", "200",
                    *extra)


def refusals(device: str) -> dict:
    """What a one-GPU host answers to two ranks on CUDA: exit 2 and its one error line."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as d:
        for key, args in (("speech --nproc 2", ("train", "speech", "--nproc", "2")),
                          ("image --partitions 2", ("train", "image", "--partitions", "2"))):
            proc = mariana(*args, "--device", device, "--out", d, check=False)
            lines = [x for x in proc.stderr.splitlines() if x.strip()]
            out[key] = {"rc": proc.returncode, "last_line": lines[-1] if lines else ""}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=3000, help="generated 64x64 images (200 held out)")
    ap.add_argument("--jpeg-size", type=int, default=256, help="side of the JPEG files of the input-pipeline runs")
    ap.add_argument("--epochs", type=int, default=4, help="epochs of each speed run (the first is warm-up)")
    ap.add_argument("--mnist-epochs", type=int, help="the mnist preset's epochs (default: its own, 20)")
    ap.add_argument("--no-cpu-scaling", action="store_true", help="skip step 6 (N=2 / P=2 on the CPU)")
    ap.add_argument("--only", help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all)")
    ap.add_argument("--out-dir", default=str(REPO / "bench-out" / "gpu"))
    args = ap.parse_args()
    only = set(STEPS) if not args.only else set(args.only.split(","))
    if unknown := only - set(STEPS):
        ap.error(f"--only: unknown step(s) {', '.join(sorted(unknown))} (use {', '.join(STEPS)})")
    if args.no_cpu_scaling:
        only.discard("cpu-scaling")
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "gpus": torch.cuda.device_count()}
    note(f"{env}")
    record: dict = {"machine": machine_info(), "env": env, "device": args.device}

    def speech() -> None:
        r = run_json("train", "speech", "--nproc", "1", "--device", args.device)
        record["speech"] = {k: r[k] for k in ("test_accuracy", "test_errors", "train_seconds", "samples_per_s",
                                              "steps", "epochs")}
        record["speech"]["epoch_frames_per_s"] = [e["frames_per_s"] for e in r["per_epoch"]]
        note(f"speech: {record['speech']}")

    def mnist() -> None:
        r = run_json("train", "image", "--partitions", "1", "--groups", "1", "--device", args.device,
                     *(("--epochs", str(args.mnist_epochs)) if args.mnist_epochs else ()))
        record["mnist"] = {"test_accuracy": r["test_accuracy"], "epochs": r["epochs"], "images_per_s": steady(r),
                           "train_seconds": r["train_seconds"]}
        note(f"mnist: {record['mnist']}")

    def memory(data: str) -> None:
        for key, extra in (("P=1", ()), ("P=1 recompute", ("--recompute",))):
            r = wide(args.device, data, 1, "--memory", "--profile-memory", *extra)
            record.setdefault("memory", {})[key] = r["ranks"][0]
            note(f"memory {key}: {r['ranks'][0]}")

    def speed(data: str, jpeg: str) -> None:
        for key, extra in (("NHWC", ()), ("NCHW", ("--no-channels-last",)), ("recompute", ("--recompute",)),
                           ("batch 256, M=1", ("--batch-size", "256", "--microbatches", "1")),
                           ("prefetch 0", ("--prefetch", "0")), ("JPEG files", ("--data", jpeg)),
                           ("JPEG files, prefetch 0", ("--data", jpeg, "--prefetch", "0"))):
            r = wide(args.device, data, args.epochs, *extra)  # a later --data wins over the first
            wait = statistics.median(e["input_wait_share"] for e in r["per_epoch"][1:] or r["per_epoch"])
            record.setdefault("speed", {})[key] = {
                "images_per_s": steady(r), "epochs": [e["images_per_s"] for e in r["per_epoch"]],
                "input_wait_share": wait, "test_accuracy": r["test_accuracy"]}
            note(f"speed {key}: {record['speed'][key]}")

    def cpu_scaling(data: str) -> None:
        out = record["cpu_scaling"] = {}
        for key, extra in (("N=1", ("--nproc", "1")), ("N=2 exact", ("--nproc", "2")),
                           ("N=2 approx", ("--nproc", "2", "--exchange", "approx"))):
            r = run_json("train", "speech", "--device", "cpu", "--threads", "1", *extra)
            out[f"speech {key}"] = {"samples_per_s": r["samples_per_s"], "test_accuracy": r["test_accuracy"]}
            note(f"cpu speech {key}: {out[f'speech {key}']}")
        for key, extra in (("P=1", ()), ("P=2", ("--partitions", "2", "--balance", "time"))):
            r = wide("cpu", data, args.epochs, "--threads", "1", *extra)
            out[f"image {key}"] = {"images_per_s": steady(r), "cuts": r["cuts"]}
            note(f"cpu image {key}: {out[f'image {key}']}")
        one = out["speech N=1"]["samples_per_s"]
        for key in ("exact", "approx"):
            out[f"speech N=2 {key}"]["efficiency"] = round(out[f"speech N=2 {key}"]["samples_per_s"] / (2 * one), 3)
        out["image P=2 / P=1"] = round(out["image P=2"]["images_per_s"] / out["image P=1"]["images_per_s"], 3)

    def section(name: str, fn) -> None:  # one failing step is recorded, the others still run
        if name not in only:
            return
        try:
            fn()
        except (Exception, SystemExit) as e:  # noqa: BLE001  (SystemExit: a failed `mariana` command)
            record.setdefault("errors", {})[name] = str(e)[-3000:]
            note(f"{name} FAILED: {str(e)[-3000:]}")

    section("speech", speech)
    section("mnist", mnist)
    if only & {"memory", "speed", "cpu-scaling"}:
        with tempfile.TemporaryDirectory(prefix="gpu-bench-data-") as data, \
                tempfile.TemporaryDirectory(prefix="gpu-bench-jpeg-") as jpeg:
            mariana("gen", "images", "--rows", str(args.rows), "--size", "64", "--seed", "7", "--out", data)
            if "speed" in only:
                mariana("gen", "images", "--rows", str(args.rows), "--size", str(args.jpeg_size), "--seed", "7",
                        "--format", "jpeg", "--out", jpeg)
            section("memory", lambda: memory(data))
            section("speed", lambda: speed(data, jpeg))
            section("cpu-scaling", lambda: cpu_scaling(data))
    if args.device.startswith("cuda") and env["gpus"] == 1:
        section("refusals", lambda: record.update(refusals=refusals(args.device)))

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{env}\n\n| run | test accuracy | speed |\n|---|---:|---|")
    if s := record.get("speech"):
        print(f"| speech, nproc 1 | {100 * s['test_accuracy']:.2f}% ({s['test_errors']} errors) | "
              f"{s['samples_per_s']:,.0f} frames/s over the run; epochs "
              f"{', '.join(f'{x:,.0f}' for x in s['epoch_frames_per_s'])} |")
    if m := record.get("mnist"):
        print(f"| image, mnist preset, P=1 | {100 * m['test_accuracy']:.2f}% | {m['images_per_s']:,.0f} images/s |")
    print("\n| wide preset, MiB | parameters | gradients | optimizer | activations | total | first step's peak "
          "rise (CUDA: max_memory_allocated, CPU: RSS) | profiler activations | profiler peak |\n|---|" + "---:|" * 8)
    for key, x in record.get("memory", {}).items():
        print(f"| {key} | " + " | ".join(f"{(x.get(k) or 0) / MIB:.1f}" for k in (
            "parameters", "gradients", "optimizer", "activations", "total", "rss_first_step",
            "profiler_activations", "profiler_peak")) + " |")
    print("\n| wide preset | images/s (epochs after the first) | waiting for input | test accuracy |\n"
          "|---|---:|---:|---:|")
    for key, v in record.get("speed", {}).items():
        print(f"| {key} | {v['images_per_s']:,.0f} | {100 * v['input_wait_share']:.1f}% | "
              f"{100 * v['test_accuracy']:.1f}% |")
    if c := record.get("cpu_scaling"):
        print(f"\nOn this host's CPU ({record['machine']['nproc']} cores), one thread per rank:\n")
        for key in ("exact", "approx"):
            r = c[f"speech N=2 {key}"]
            print(f"- speech N=2 {key}: {r['samples_per_s']:,.0f} frames/s against N=1's "
                  f"{c['speech N=1']['samples_per_s']:,.0f}: efficiency {r['efficiency']:.3f} "
                  f"(issue 17: >= {0.77 if key == 'exact' else 0.85}); accuracy {100 * r['test_accuracy']:.2f}%")
        print(f"- image P=2 / P=1 (wide, M={MICRO}): {c['image P=2 / P=1']:.3f} ({c['image P=2']['images_per_s']:,.0f} "
              f"against {c['image P=1']['images_per_s']:,.0f} images/s; issue 18: >= 1.4)")
    for key, v in record.get("refusals", {}).items():
        print(f"- {key}: exit {v['rc']}: {v['last_line']}")
    for key, err in record.get("errors", {}).items():
        print(f"- FAILED {key}: {err.splitlines()[-1] if err else ''}")
    print(f"\n{record['machine']['date']}; results in {out / 'results.json'}")
    return 1 if record.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
