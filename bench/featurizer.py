"""Image featurizer benchmark (issue 6), one run, peers beside it:

1. Throughput at batch 256 (28x28 MNIST images), images/s, median of --repeat
   timed windows each:
   - mariana: `ImageFeaturizer.embed` (frozen ops, torch.nn.functional, padded
     to whole row blocks so an image's bits do not depend on its batch);
   - torch-module: the same weights in `trainer.models.image_cnn.ImageCNN`,
     eager, `inference_mode` (the plain torch reference);
   - numpy: the same network in numpy (im2col + matmul), no torch.
   Target: mariana >= 2,000 images/s. The systems take turns, one window each
   per round, so a burst of load on the host hits them alike.
2. The cache-hit path against preprocess: for each block of a
   `gen ads-with-images` train.tsv, parse + hash (`BlockParser` and `Encoder`,
   what preprocess does) vs the creative lookup (`CreativeFeatures.lookup` of
   the block's C26 column and the concatenation into the dense block), and a
   Python dict lookup as the peer. Target: lookup <= 10% of parse + hash.
3. The same in the pipeline (`--pipeline`, default on): one `mariana train
   --mode cluster --images` job (W1 S1 P1, LR) on that data; from its record,
   preprocess's image stage (Redis lookups of ids new to the process + the
   attach) against its parse + hash + cache, and rows/s beside the same job
   without images.

    .venv/bin/python bench/featurizer.py              # ~1 min (first run: + data and featurizer, ~1 min)
    .venv/bin/python bench/featurizer.py --repeat 15 --seconds 2

Writes bench-out/featurizer/results.json (with the machine); exits 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ctr_peers import machine_info  # noqa: E402  (bench/ is on sys.path when run as a script)
from mariana.featurizer.creatives import CreativeFeatures, ImageFeatureEncoder  # noqa: E402
from mariana.featurizer.image import ImageFeaturizer, load_mnist, mnist_dir, to_input  # noqa: E402
from mariana.sparse.encode import Encoder  # noqa: E402
from mariana.sparse.hashing import HashSpec  # noqa: E402
from mariana.sparse.parse import Reader  # noqa: E402
from mariana.sparse.schema import criteo  # noqa: E402


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed_rate(fn, items: int, seconds: float, repeat: int) -> list[float]:
    """items/s of fn() over `repeat` windows of about `seconds` each (after one warm-up call)."""
    fn()
    rates = []
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            fn()
            n += items
        rates.append(n / elapsed)
    return rates


# ---- the numpy peer ------------------------------------------------------------------------

def numpy_embed(f: ImageFeaturizer, images: np.ndarray) -> np.ndarray:
    """The featurizer's ops in numpy: conv as im2col + matmul."""
    w = {k: v.numpy() for k, v in f.weights.items()}
    x = ((images.astype(np.float32) / 255.0 - f.pixel_mean) / f.pixel_std)[:, None]  # (N, 1, S, S)
    for op in f.ops:
        kind = op["op"]
        if kind == "conv2d":
            x = _conv3x3(x, w[op["weight"]], w[op["bias"]], op["padding"][0])
        elif kind == "relu":
            x = np.maximum(x, 0)
        elif kind == "max_pool2d":
            k = op["kernel"]
            n, c, h, wd = x.shape
            x = x.reshape(n, c, h // k, k, wd // k, k).max(axis=(3, 5))
        elif kind == "flatten":
            x = x.reshape(len(x), -1)
        elif kind == "linear":
            x = x @ w[op["weight"]].T + w[op["bias"]]
    return (x - f.out_mean.numpy()) / f.out_std.numpy()


def _conv3x3(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, pad: int) -> np.ndarray:
    n, c, h, wd = x.shape
    o, _, kh, kw = weight.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    cols = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))  # (N, C, Ho, Wo, kh, kw)
    cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kh * kw)
    out = cols @ weight.reshape(o, -1).T + bias                                  # (N*Ho*Wo, O)
    return out.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)


# ---- 1. throughput --------------------------------------------------------------------------

def throughput(f: ImageFeaturizer, images: np.ndarray, seconds: float, repeat: int) -> dict:
    from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig

    batch = images[:256]
    module = ImageCNN(ImageCNNConfig.from_dict(f.manifest["cnn"])).eval()
    module.load_state_dict({k: v for k, v in f.weights.items() if not k.startswith("output.")})

    def torch_module() -> None:
        with torch.inference_mode():
            x = to_input(batch, f.pixel_mean, f.pixel_std)
            ((module.embed_features(x) - f.out_mean) / f.out_std).numpy()

    ref = f.embed(batch)
    gap = float(np.abs(numpy_embed(f, batch) - ref).max())
    systems = {"mariana": lambda: f.embed(batch, batch_size=256), "torch-module": torch_module,
               "numpy": lambda: numpy_embed(f, batch)}
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeat):  # interleaved windows: a burst of load on the host hits every system alike
        for name, fn in systems.items():
            runs[name] += timed_rate(fn, len(batch), seconds, 1)
    out = {}
    for name, rates in runs.items():
        out[name] = {"images_per_s": round(statistics.median(rates)), "runs": [round(r) for r in rates]}
        note(f"{name}: {out[name]['images_per_s']:,} images/s at batch 256 (runs {out[name]['runs']})")
    out["numpy_max_abs_diff"] = gap
    return out


# ---- 2. lookup vs preprocess -----------------------------------------------------------------

def lookup_overhead(train_tsv: Path, table: CreativeFeatures, field: str, block_bytes: int) -> dict:
    encoder = Encoder(criteo(), HashSpec())
    attach = ImageFeatureEncoder(encoder, table, field)
    as_dict = {cid: i for i, cid in enumerate(table.ids)}
    t = {"parse": 0.0, "hash": 0.0, "lookup": 0.0, "dict_lookup": 0.0}
    rows = 0
    for task in Reader([str(train_tsv)], criteo(), block_bytes).tasks():
        t0 = time.perf_counter()
        chunk, _ = task.run()
        t1 = time.perf_counter()
        batch = encoder.encode(chunk)
        base_dense = batch.dense
        t2 = time.perf_counter()
        attach.attach(batch, chunk)  # what preprocess and local mode run
        t3 = time.perf_counter()
        idx = np.fromiter((as_dict.get(v, -1) for v in chunk.columns[field].to_pylist()), np.int64, chunk.num_rows)
        np.concatenate([base_dense, table.table[idx]], axis=1)  # the same concatenation, ids found in a dict
        t4 = time.perf_counter()
        for key, dt_ in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[key] += dt_
        rows += chunk.num_rows
    pre = t["parse"] + t["hash"]
    return {"rows": rows, "block_bytes": block_bytes, **{f"{k}_s": round(v, 4) for k, v in t.items()},
            "lookup_share_of_preprocess": round(t["lookup"] / pre, 4),
            "dict_lookup_share_of_preprocess": round(t["dict_lookup"] / pre, 4),
            "lookup_us_per_row": round(1e6 * t["lookup"] / max(rows, 1), 3)}


# ---- setup and report --------------------------------------------------------------------------

def prepare(args) -> tuple[Path, ImageFeaturizer, CreativeFeatures, Path]:
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images
    from mariana.trainer.config import ImagesConfig
    from mariana.trainer.images import load_creative_set, open_featurizer

    data = Path(args.out_dir) / f"ads-{args.rows}"
    if not (data / "train.tsv").exists():
        note(f"generating {args.rows:,} rows into {data}")
        generate_ads_with_images(data, AdsSpec(rows=args.rows, seed=1), mnist_dir(args.mnist))
    cset = load_creative_set(str(data))
    f, fdir, how = open_featurizer(ImagesConfig(creatives=str(data), featurizer=args.featurizer or ""), cset)
    note(f"featurizer {fdir} ({how})")
    return data, f, CreativeFeatures(cset.ids, f.embed(cset.images)), Path(fdir)


def pipeline_stage(data: Path, featurizer: str, out_dir: Path) -> dict:
    """Two cluster jobs on the ads data, with and without image features; their stage seconds."""
    out = {}
    for label, extra in (("without_images", []), ("with_images", ["--images", str(data), "--featurizer", featurizer])):
        model = out_dir / f"model-{label}"
        shutil.rmtree(model, ignore_errors=True)  # a fresh version 1, not one more in an old dir
        cmd = [sys.executable, "-m", "mariana.services.cli", "-q", "train", "--data", str(data / "train.tsv"), "--model", "lr",
               "--out", str(model), "--json", "--mode", "cluster", "--workers", "1", "--ps", "1", "--preprocess", "1",
               *extra]
        note(f"pipeline: {label}")
        env = os.environ | {"MARIANA_CLUSTER__DIR": str(out_dir / "no-cluster")}  # as bench/pipeline.py: its own
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"bench: {label} job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rec = json.loads(proc.stdout)
        st = rec["stage_seconds"]
        out[label] = {"rows_per_s": rec["rows_per_s"], "epoch_seconds": rec["epoch_seconds"], "stage_seconds": st}
        if extra:
            pre = st["parse"] + st["hash"] + st["cache"]
            out[label].update(image_share_of_preprocess=round(st["image"] / pre, 4),
                              creative_lookups=rec["images"]["train_lookups"],
                              unknown=rec["images"]["train_unknown_creative"])
    return out


def machine() -> dict:
    return {**machine_info(), "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows of the generated ads data")
    p.add_argument("--repeat", type=int, default=7, help="timed windows per system (interleaved)")
    p.add_argument("--seconds", type=float, default=1.0, help="length of one timed window")
    p.add_argument("--block-bytes", type=int, default=4 << 20, help="preprocess block size (data.block_bytes)")
    p.add_argument("--mnist", help="MNIST dir (default: $MARIANA_DATA/mnist or ../shared/data/mnist)")
    p.add_argument("--featurizer", help="featurizer dir (default: the data's cached one, trained on first use)")
    p.add_argument("--out-dir", default=str(REPO / "bench-out" / "featurizer"))
    p.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="skip the cluster jobs (part 3)")
    args = p.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    data, f, table, fdir = prepare(args)
    mnist = load_mnist(args.mnist)
    result = {"machine": machine(), "featurizer": {"dir": str(fdir.resolve()), "dim": f.dim,
                                                   "accuracy": f.manifest.get("accuracy")},
              "throughput": throughput(f, mnist.images, args.seconds, args.repeat),
              "lookup": lookup_overhead(data / "train.tsv", table, "C26", args.block_bytes)}
    if args.pipeline:
        result["pipeline"] = pipeline_stage(data, str(fdir.resolve()), Path(args.out_dir))
    ours = result["throughput"]["mariana"]["images_per_s"]
    share = result["lookup"]["lookup_share_of_preprocess"]
    result["targets"] = {"images_per_s >= 2000": ours >= 2000, "lookup <= 10% of preprocess": share <= 0.10}
    if args.pipeline:
        result["targets"]["pipeline image stage <= 10% of preprocess"] = \
            result["pipeline"]["with_images"]["image_share_of_preprocess"] <= 0.10
    (Path(args.out_dir) / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    tp = result["throughput"]
    print(f"featurizer, batch 256: mariana {ours:,} images/s; torch-module {tp['torch-module']['images_per_s']:,} "
          f"(ratio {ours / tp['torch-module']['images_per_s']:.2f}x); numpy {tp['numpy']['images_per_s']:,} "
          f"(ratio {ours / tp['numpy']['images_per_s']:.1f}x; max |diff| {tp['numpy_max_abs_diff']:.1e})")
    lk = result["lookup"]
    print(f"cache-hit lookup: {lk['lookup_s']} s for {lk['rows']:,} rows = {100 * share:.2f}% of parse + hash "
          f"({lk['parse_s']} + {lk['hash_s']} s); python dict peer {100 * lk['dict_lookup_share_of_preprocess']:.1f}%")
    if args.pipeline:
        pl = result["pipeline"]
        w, wo = pl["with_images"], pl["without_images"]
        st = w["stage_seconds"]
        print(f"pipeline (cluster W1 S1 P1, lr): image stage {st['image']} s = "
              f"{100 * w['image_share_of_preprocess']:.2f}% of preprocess (parse {st['parse']} + hash {st['hash']} + "
              f"cache {st['cache']} s); rows/s {w['rows_per_s']:,.0f} with images, {wo['rows_per_s']:,.0f} without "
              f"(ratio {w['rows_per_s'] / wo['rows_per_s']:.2f})")
    for target, ok in result["targets"].items():
        print(f"{'PASS' if ok else 'FAIL'}: {target}")
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
