"""Image mode benchmark (issue 18): the wide CNN (6 blocks, 64-256 channels, 64x64) as
partitions x groups, on `mariana gen images` data, every configuration in one run.

1. Memory, `mariana train image --memory --profile-memory` (global batch 64, M=8
   micro-batches, 1F1B): each rank's parameters, gradients, optimizer state and saved
   activations (trainer/memory.py), cross-checked against torch's profiler (its peak and
   its activation + input categories) and the rise of peak RSS on the first step; for
   P=1 and P=2 (the stages cut by memory), each with and without --recompute. The
   largest partition against the whole model on one rank (P=1, same batch and micro-batches).
2. Speed, one thread per rank, images/s (the median of the epochs after the first; the
   median of --rounds interleaved rounds):
   P=1; P=2 (M=8; the stages cut by measured time); G=2; --recompute at P=1 and P=2;
   the input pipeline with --prefetch 2 and 0 under `shift` and `elastic` augmentation,
   and on the same images as JPEG files of --jpeg-size px (an image folder, decoded and
   scaled batch by batch on the prefetch thread's pool, or in the training thread), with
   the share of the job spent waiting for input.
3. Bytes: P=2 x G=2, what each rank hands to its gradient all-reduce per step against its
   own partition's gradient bytes, and what the process wrote (/proc/self/io).
4. fully_shard (FSDP2) at N=2 on the same model and batch: images/s, per-rank memory by
   the same meter, bytes written per step.

    .venv/bin/python bench/image_parallel.py              # ~25 min on 2 cores
    .venv/bin/python bench/image_parallel.py --rows 1200 --epochs 2 --rounds 1   # a quick look
    .venv/bin/python bench/image_parallel.py --no-channels-last   # NCHW, the default before 2026-11-26

Writes bench-out/image_parallel/results.json (with the machine), prints Markdown tables;
exits 1 when a target of issue 18 is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ctr_peers import machine_info, report_targets  # noqa: E402  (bench/ is on sys.path when run as a script)

BATCH, MICRO = 64, 8


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def mariana(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mariana", "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc


LAYOUT: list[str] = []  # --channels-last / --no-channels-last for every run; none: the job's default (NHWC)


def train(data: str, epochs: int, *extra: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="image-bench-") as out:
        proc = mariana("train", "image", "--data", data, "--preset", "wide", "--epochs", str(epochs), "--batch-size",
                       str(BATCH), "--microbatches", str(MICRO), "--threads", "1", "--test-images", "200",
                       "--out", out, "--json", *LAYOUT, *extra)
        return json.loads(proc.stdout)


def steady(r: dict) -> float:
    """Images/s of the epochs after the first (warm-up: the pipeline's shapes, the allocator)."""
    rates = [e["images_per_s"] for e in r["per_epoch"]]
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


# ---- 1. memory -----------------------------------------------------------------------------

def memory_rows(data: str) -> dict:
    rows = {}
    for key, extra in [("P=1", ()), ("P=1 recompute", ("--recompute",)), ("P=2", ("--partitions", "2")),
                       ("P=2 recompute", ("--partitions", "2", "--recompute"))]:
        r = train(data, 1, "--memory", "--profile-memory", "--balance", "memory", *extra)
        rows[key] = {"cuts": r["cuts"], "ranks": r["ranks"]}
        note(f"memory {key}: {r['cuts']}: " + "; ".join(
            f"rank {x['rank']} total {x['total'] / 2**20:.1f} MiB (activations {x['activations'] / 2**20:.1f}, "
            f"buffers {x.get('buffers', 0) / 2**20:.1f}, profiler {x['profiler_activations'] / 2**20:.1f})"
            for x in r["ranks"]))
    return rows


# ---- 4. fully_shard --------------------------------------------------------------------------

def fsdp_rank(out: str, data: str, steps: int) -> None:
    """One rank of the FSDP2 comparison (run by `fsdp` below as RANK of WORLD_SIZE)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from mariana.featurizer.image import load_mnist, pixel_stats, to_input
    from mariana.trainer import memory
    from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig
    from mariana.trainer.strategies import data_parallel as dp
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    torch.set_num_threads(1)
    ctx = dp.DistContext.from_env()
    dp.init_distributed(ctx, "gloo", os.environ["MARIANA_DIST_INIT"], 120)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    images = load_mnist(data)
    mean, std = pixel_stats(images.images)
    x = to_input(images.images, mean, std)
    y = torch.from_numpy(images.labels.astype(np.int64))
    torch.manual_seed(0)
    model = ImageCNN(ImageCNNConfig.wide())
    for _, stage in model.stages():
        fully_shard(stage, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    share = BATCH // ctx.world_size
    micro = max(1, share // (BATCH // MICRO))  # micro-batches of the same rows as the pipeline's

    def step(k: int) -> None:
        rows = (torch.arange(BATCH) + BATCH * k) % len(x)
        mine = rows[ctx.rank * share:(ctx.rank + 1) * share]
        opt.zero_grad(set_to_none=True)
        for i, part in enumerate(mine.tensor_split(micro)):
            model.set_requires_gradient_sync(i == micro - 1)
            (F.cross_entropy(model(x[part]), y[part]) / micro).backward()
        opt.step()
    step(0)
    report = memory.measure_step(lambda: step(1), model, opt).to_dict()
    dist.barrier()
    io0, t0 = dp.io_written(), time.perf_counter()
    for k in range(2, steps + 2):
        step(k)
    took = time.perf_counter() - t0
    report.update(images_per_s=BATCH * steps / took, io_written_per_step=(dp.io_written() - io0) / steps,
                  rank=ctx.rank)
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dp.shutdown_distributed()


def fsdp(data: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        env = {**os.environ, "WORLD_SIZE": "2", "MARIANA_DIST_INIT": f"file://{tmp}/store",
               "PYTHONPATH": str(REPO / "bench") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs = [subprocess.Popen([sys.executable, __file__, "--fsdp-rank", tmp, "--data", data, "--steps",
                                   str(steps)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        errors = [p.communicate(timeout=900)[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit("fully_shard run failed:\n" + "\n".join(e[-2000:] for e in errors))
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    return {"images_per_s": min(r["images_per_s"] for r in ranks), "ranks": ranks}


# ---- the run ---------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3000, help="generated 64x64 images (200 held out)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each speed run (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the speed runs; the table shows medians")
    ap.add_argument("--jpeg-size", type=int, default=256, help="side of the JPEG files of the decoding runs")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                    help="pass --channels-last or --no-channels-last to every `train image` run (default: the "
                         "job's own, NHWC since 2026-11-26; NCHW before)")
    ap.add_argument("--out-dir", default=str(REPO / "bench-out" / "image_parallel"))
    ap.add_argument("--fsdp-rank", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fsdp_rank:
        fsdp_rank(args.fsdp_rank, args.data, args.steps)
        return 0
    if args.channels_last is not None:
        LAYOUT.append("--channels-last" if args.channels_last else "--no-channels-last")
    with tempfile.TemporaryDirectory(prefix="image-bench-data-") as data, \
            tempfile.TemporaryDirectory(prefix="image-bench-jpeg-") as jpeg:
        mariana("gen", "images", "--rows", str(args.rows), "--size", "64", "--seed", "7", "--out", data)
        mariana("gen", "images", "--rows", str(args.rows), "--size", str(args.jpeg_size), "--seed", "7", "--format",
                "jpeg", "--out", jpeg)
        mem = memory_rows(data)
        speed, runs = {}, {}
        configs = [("P=1", ()), ("P=2", ("--partitions", "2", "--balance", "time")),
                   ("G=2", ("--groups", "2")), ("P=1 recompute", ("--recompute",)),
                   ("P=2 recompute", ("--partitions", "2", "--balance", "time", "--recompute")),
                   ("P=1 prefetch 0", ("--prefetch", "0")),
                   ("P=1 elastic", ("--augment", "elastic")),
                   ("P=1 elastic prefetch 0", ("--augment", "elastic", "--prefetch", "0")),
                   ("P=1 JPEG files", ()), ("P=1 JPEG files prefetch 0", ("--prefetch", "0"))]
        for rnd in range(args.rounds):  # interleaved: a burst of host load hits every configuration alike
            for key, extra in configs:
                r = train(jpeg if "JPEG" in key else data, args.epochs, *extra)
                runs.setdefault(key, []).append(r)
                note(f"round {rnd} speed {key}: {steady(r):,.1f} images/s, cuts {r['cuts']}, waiting for input "
                     f"{100 * statistics.median(e['input_wait_share'] for e in r['per_epoch']):.1f}%, busy "
                     f"{[x.get('cpu_share') for x in r['ranks']]}")
        for key, rs in runs.items():
            speed[key] = {"images_per_s": statistics.median(steady(r) for r in rs),
                          "rounds": [steady(r) for r in rs], "cuts": rs[0]["cuts"],
                          "input_wait_share": statistics.median(e["input_wait_share"] for r in rs
                                                                for e in r["per_epoch"][1:] or r["per_epoch"]),
                          "busy": [statistics.median(r["ranks"][i]["cpu_share"] for r in rs)
                                   for i in range(len(rs[0]["ranks"]))]}
        grid = train(data, 1, "--partitions", "2", "--groups", "2")
        sent = [{k: x.get(k) for k in ("rank", "partition", "gradient_bytes", "allreduce_payload_per_step",
                                      "allreduce_sent_per_step", "io_written_per_step")} for x in grid["ranks"]]
        note("bytes P=2 x G=2: " + "; ".join(f"rank {x['rank']}: {x['allreduce_payload_per_step']:,.0f} of "
                                            f"{x['gradient_bytes']:,} B" for x in sent))
        shard = fsdp(data, steps=max(10, (args.rows - 200) // BATCH))
        note(f"fully_shard N=2: {shard['images_per_s']:,.1f} images/s")
    whole = mem["P=1"]["ranks"][0]
    largest = {key: max(x["total"] for x in mem[key]["ranks"]) for key in mem}
    acts = {key: sum(x["activations"] for x in mem[key]["ranks"]) for key in mem}
    sp = {key: v["images_per_s"] for key, v in speed.items()}
    ratios = {
        "largest partition / whole (P=2)": largest["P=2"] / whole["total"],
        "largest partition / whole (P=2 recompute)": largest["P=2 recompute"] / whole["total"],
        "activation cut by recompute (P=1)": 1 - acts["P=1 recompute"] / acts["P=1"],
        "activation cut by recompute (P=2, all ranks)": 1 - acts["P=2 recompute"] / acts["P=2"],
        "step time with recompute (P=1)": sp["P=1"] / sp["P=1 recompute"],
        "step time with recompute (P=2)": sp["P=2"] / sp["P=2 recompute"],
        "P=2 / P=1 images/s": sp["P=2"] / sp["P=1"],
        "G=2 / P=1 images/s": sp["G=2"] / sp["P=1"],
        "prefetch on / off (shift)": sp["P=1"] / sp["P=1 prefetch 0"],
        "prefetch on / off (elastic)": sp["P=1 elastic"] / sp["P=1 elastic prefetch 0"],
        "prefetch on / off (JPEG files, shift)": sp["P=1 JPEG files"] / sp["P=1 JPEG files prefetch 0"],
        "fully_shard N=2 / P=1 images/s": shard["images_per_s"] / sp["P=1"],
        "worst gradient exchange / own partition's gradient bytes": max(
            x["allreduce_payload_per_step"] / x["gradient_bytes"] for x in sent),
    }
    targets = {
        "largest partition <= 0.60 of the whole (1F1B, P=2)": ratios["largest partition / whole (P=2)"] <= 0.60,
        "recompute cuts activations >= 40% (P=1)": ratios["activation cut by recompute (P=1)"] >= 0.40,
        "... for <= 35% more step time (P=1)": ratios["step time with recompute (P=1)"] <= 1.35,
        "each rank sends its own partition's gradient bytes within 5%": all(
            abs(x["allreduce_payload_per_step"] / x["gradient_bytes"] - 1) <= 0.05 for x in sent),
        "P=2 >= 1.4x P=1": ratios["P=2 / P=1 images/s"] >= 1.4,
        "prefetch on >= 1.2x off": ratios["prefetch on / off (shift)"] >= 1.2,
        "prefetch on >= 1.2x off (JPEG files)": ratios["prefetch on / off (JPEG files, shift)"] >= 1.2,
    }
    record = {"machine": machine_info(), "rows": args.rows, "jpeg_size": args.jpeg_size, "epochs": args.epochs,
              "batch": BATCH,
              "microbatches": MICRO, "memory": mem, "speed": speed, "bytes": sent, "fully_shard": shard,
              "ratios": {k: round(v, 3) for k, v in ratios.items()}, "targets": targets,
              "runs": {k: [{kk: vv for kk, vv in r.items() if kk not in ("train_index", "config")} for r in v]
                       for k, v in runs.items()}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=2))
    mib = 2 ** 20
    print(f"Memory per rank, MiB (wide preset, batch {BATCH}, {MICRO} micro-batches, 1F1B; cross-checks: the "
          "profiler's activation + input peak, its peak of everything, peak RSS rise on the first step)\n")
    print("| layout | rank: stages | parameters | gradients | optimizer | activations | pipeline buffers | total | "
          "profiler activations | profiler peak | RSS rise |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, m in mem.items():
        for x, cut in zip(m["ranks"], m["cuts"]):
            print(f"| {key} | {x['rank']}: {cut[0]}..{cut[-1]} | " + " | ".join(
                f"{x.get(k, 0) / mib:.1f}" for k in ("parameters", "gradients", "optimizer", "activations", "buffers",
                                                     "total", "profiler_activations", "profiler_peak",
                                                     "rss_first_step")) + " |")
    print(f"\n| speed (1 thread per rank) | images/s, median of {args.rounds} | stages | busy (CPU / wall) per rank | "
          "waiting for input |")
    print("|---|---:|---|---|---:|")
    for key, v in speed.items():
        print(f"| {key} | {v['images_per_s']:,.1f} ({', '.join(f'{x:,.0f}' for x in v['rounds'])}) | "
              f"{' / '.join(c[0] + '..' + c[-1] for c in v['cuts'])} | {', '.join(f'{b:.2f}' for b in v['busy'])} | "
              f"{100 * v['input_wait_share']:.1f}% |")
    print(f"| fully_shard N=2 | {shard['images_per_s']:,.1f} | (all, sharded) | |")
    print("\n| P=2 x G=2 rank | partition | own gradient bytes | all-reduce payload/step | ring sends/step | "
          "process wrote/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for x in sent:
        print(f"| {x['rank']} | {x['partition']} | {x['gradient_bytes']:,} | {x['allreduce_payload_per_step']:,.0f} | "
              f"{x['allreduce_sent_per_step']:,.0f} | {x['io_written_per_step'] or 0:,.0f} |")
    print("\n| fully_shard N=2 rank | parameters | gradients | optimizer | activations | total | wrote/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for x in shard["ranks"]:
        print(f"| {x['rank']} | " + " | ".join(f"{x[k] / mib:.1f}" for k in ("parameters", "gradients", "optimizer",
                                                                              "activations", "total"))
              + f" | {x['io_written_per_step']:,.0f} |")
    print()
    for name, v in ratios.items():
        print(f"- {name}: {v:.3f}")
    return report_targets(targets, record["machine"], out / "results.json")


if __name__ == "__main__":
    sys.exit(main())
