"""`mariana train image`: the image CNN as G groups of P pipelined partitions, end to end in
real processes: the same weights in any layout, an exported featurizer, bad input refused."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import ROOT, run_cli, run_cli_cases
from tests.integration.rankkill import children, kill_a_rank, running, wait_for_rank

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes28")
    run_cli("gen", "images", "--rows", "640", "--size", "28", "--seed", "1", "--out", d, check=True)
    return d


def train(shapes, out, *extra: str) -> dict:
    proc = run_cli("train", "image", "--data", shapes, "--epochs", "2", "--batch-size", "64", "--test-images", "128",
                   "--out", out, "--json", *extra, check=True)
    # every layout says each epoch: the last partition has the loss (with P >= 2 it said nothing)
    assert "image epoch 2/2: loss" in proc.stderr, proc.stderr[-2000:]
    return json.loads(proc.stdout)


GRID = ("--partitions", "2", "--groups", "2", "--schedule", "gpipe")


@pytest.fixture(scope="module")
def trained(shapes, tmp_path_factory) -> dict:
    """The runs several tests compare with, trained once: name -> (out dir, report)."""
    d = tmp_path_factory.mktemp("trained")
    return {"p1": (d / "p1", train(shapes, d / "p1")), "p2g2": (d / "p2g2", train(shapes, d / "p2g2", *GRID))}


def test_any_layout_trains_the_same_model_and_exports_a_featurizer(tmp_path, shapes, trained):
    (p1, one), (p2g2, grid) = trained["p1"], trained["p2g2"]
    two = train(shapes, tmp_path / "p2", "--partitions", "2", "--memory", "--balance", "memory")  # changes no number
    assert two["cuts"] == [["conv1", "pool1"], ["conv2", "pool2", "embed", "head"]] and grid["groups"] == 2
    # each rank's memory by component, its own partition's only; activations held by 1F1B
    n = {r["rank"]: r for r in two["ranks"]}
    sizes = [sum(c["state_bytes"] for c in two["stage_costs"] if c["stage"] in cut) // 4 for cut in two["cuts"]]
    assert [n[0]["parameters"], n[1]["parameters"]] == sizes and n[0]["optimizer"] > 2 * sizes[0]
    assert n[0]["activations"] > n[1]["activations"] > 0
    # each rank hands its gradient all-reduce its own partition's gradient bytes per step, no more
    assert len(grid["ranks"]) == 4
    for r in grid["ranks"]:
        assert r["allreduce_payload_per_step"] == r["gradient_bytes"] and r["partition"] == r["rank"] % 2
    assert grid["ranks"][0]["gradient_bytes"] + grid["ranks"][1]["gradient_bytes"] == 4 * sum(
        c["state_bytes"] for c in grid["stage_costs"]) // 16
    w1 = load_file(str(p1 / "weights.safetensors"))
    for other in (tmp_path / "p2", p2g2):
        w = load_file(str(other / "weights.safetensors"))
        assert w.keys() == w1.keys()
        assert max(float(np.abs(w[k] - w1[k]).max()) for k in w1) < 1e-4, other
    assert abs(two["test_accuracy"] - one["test_accuracy"]) <= 1 / 128 and one["test_accuracy"] > 0.2
    assert [e["loss"] for e in two["per_epoch"]] == pytest.approx([e["loss"] for e in one["per_epoch"]], abs=1e-4)
    from mariana.featurizer.image import ImageFeaturizer, load_mnist, split_indices
    f = ImageFeaturizer.load(tmp_path / "p2")
    data = load_mnist(shapes)
    _, test = split_indices(len(data.images), 128)
    assert float((f.classify(data.images[test]) == data.labels[test]).mean()) == pytest.approx(two["test_accuracy"],
                                                                                                abs=1e-4)


def test_either_memory_layout_trains_the_same_model_in_any_layout(tmp_path, shapes, trained):
    """NHWC inside the partitions (the default) or NCHW (`--no-channels-last`): what crosses
    between ranks stays NCHW (gloo sends only contiguous tensors), so P=2 runs and matches
    P=1 in the same layout. (The other tests here train at the default, NHWC.)"""
    (p1, one) = trained["p1"]
    two = train(shapes, tmp_path / "p2", "--partitions", "2", "--cut-after", "conv2")
    assert one["config"]["channels_last"] and two["cuts"][0][-1] == "conv2"
    w1, w2 = (load_file(str(d / "weights.safetensors")) for d in (p1, tmp_path / "p2"))
    assert max(float(np.abs(w2[k] - w1[k]).max()) for k in w1) < 1e-4
    one = train(shapes, tmp_path / "p1", "--no-channels-last")
    two = train(shapes, tmp_path / "p2", "--no-channels-last", "--partitions", "2", "--cut-after", "conv2")
    assert not one["config"]["channels_last"] and not two["config"]["channels_last"]
    w1, w2 = (load_file(str(tmp_path / d / "weights.safetensors")) for d in ("p1", "p2"))
    assert max(float(np.abs(w2[k] - w1[k]).max()) for k in w1) < 1e-4
    assert [e["loss"] for e in two["per_epoch"]] == pytest.approx([e["loss"] for e in one["per_epoch"]], abs=1e-4)


def test_an_image_folder_is_decoded_batch_by_batch_and_trains_what_its_idx_twin_trains(tmp_path, shapes, trained):
    """The same 640 images as PNG files, one folder per class (`gen images --format png`):
    decoded on the prefetch thread's pool, in the training thread with --prefetch 0, and in
    a 2 x 2 layout, each the IDX set's model bit for bit. Files that are no image are
    counted, named and left out; one damaged past its header is trained as black, counted."""
    folder = tmp_path / "png"
    made = json.loads(run_cli("gen", "images", "--rows", "640", "--size", "28", "--seed", "1", "--format", "png",
                              "--out", folder, check=True).stdout)
    assert made["content_sha256"] == json.loads(run_cli("gen", "images", "--rows", "640", "--size", "28", "--seed",
                                                        "1", "--out", tmp_path / "twin",
                                                        check=True).stdout)["content_sha256"]
    (idx, base), (idx_grid, _) = trained["p1"], trained["p2g2"]
    for name, extra, twin in [("pool", ("--decode-workers", "3"), idx), ("inline", ("--prefetch", "0"), idx),
                              ("grid", GRID, idx_grid)]:
        got = train(folder, tmp_path / name, *extra)
        assert got["source"]["images"] == 640 and got["source"]["skipped"] == 0
        assert all(r["decode_failures"] == 0 for r in got["ranks"])
        assert got["pixel_mean"] == base["pixel_mean"]
        got_bytes = (tmp_path / name / "weights.safetensors").read_bytes()
        assert got_bytes == (twin / "weights.safetensors").read_bytes(), name
    (folder / "notes.txt").write_text("not in a class")
    (folder / "3-triangle" / "readme.md").write_text("no image")
    (folder / "3-triangle" / "fake.png").write_bytes(b"not a png at all")
    (folder / "3-triangle" / "2019").mkdir()  # one level only: a nested folder is named, not walked or lost
    (folder / "3-triangle" / "2019" / "000001.png").write_bytes(next(folder.glob("*/000001.png")).read_bytes())
    from mariana.featurizer.image import split_indices
    (victim,) = folder.glob(f"*/{split_indices(640, 128)[0][0]:06d}.png")  # a training image
    victim.write_bytes(victim.read_bytes()[:60])  # the header survives, the pixels do not
    (held,) = folder.glob(f"*/{split_indices(640, 128)[1][0]:06d}.png")  # and a held-out one, scored on rank 0
    held.write_bytes(held.read_bytes()[:60])
    got = train(folder, tmp_path / "bad")
    src = got["source"]
    assert src["images"] == 640 and src["skipped"] == 4 and len(src["first_skipped"]) == 4
    assert any(s.startswith("notes.txt: not in a class directory") for s in src["first_skipped"])
    assert any(s.startswith("3-triangle/fake.png: not an image file Pillow can read") for s in src["first_skipped"])
    assert any(s.startswith("3-triangle/2019: a directory") for s in src["first_skipped"])
    # decoded for the pixel statistics, the stage probe (its first image) and 2 epochs: one file, counted once;
    # the held-out one when rank 0 scores the model
    assert got["ranks"][0]["decode_failures"] == 2 and len(got["first_decode_failures"]) == 2
    assert all("truncated or damaged" in f for f in got["first_decode_failures"])
    assert {victim.name, held.name} == {f.split(": ")[0].rsplit("/", 1)[-1] for f in got["first_decode_failures"]}


BAD_IMAGE = [
    (["--groups", "1000", "--batch-size", "4000"], "1000 ranks: must be between 1 and"),
    (["--batch-size", "30"], "--batch-size 30 must split evenly into --groups 1 x --microbatches 4"),
    (["--preset", "wide"], "but preset 'wide' takes 64x64"),
    (["--test-images", "900"], "--test-images 900: must be between 1 and 639"),  # the last one given counts
    (["--test-images", "600"], "40 training images (640 less 600 held out), fewer than one batch of 128"),
    (["--partitions", "9", "--groups", "0"], "--groups and --partitions must be >= 1"),
    (["--partitions", "2", "--cut-after", "conv9"], "--cut-after 'conv9': not a stage; the stages are ['conv1', "),
    (["--partitions", "2", "--cut-after", "head"], "each partition non-empty"),
    (["--cut-after", "conv1"], "the last stage of each partition but the last: 0 of"),
    (["--partitions", "2", "--cut-after", "pool1", "--balance", "memory"],  # accepted, the balance unused
     "--cut-after pool1 and --balance memory: cuts given by hand use no balance"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),  # trained to NaN weights, exported, exit 0
    (["--shift", "-1"], "--shift must be >= 0, got -1"),  # named all four flags and no value
    (["--partitions", "2", "--microbatches", "1"],  # a torch traceback from each rank
     "--microbatches 1: the 1f1b schedule needs at least one per partition (--partitions 2)"),
    (["--partitions", "7", "--schedule", "gpipe"],  # said by rank 0 after 7 ranks started (8 s)
     "--partitions 7: the model has 6 stages, so 1 to 6 partitions"),
    (["--partitions", "7"], "--partitions 7: the model has 6 stages"),  # asked for 7 micro-batches, which failed as above
]


@pytest.fixture(scope="module")
def bad_image_runs(shapes) -> list:
    """Every case of BAD_IMAGE, run in one `mariana` process (run_cli_cases)."""
    return run_cli_cases([["train", "image", "--data", shapes, "--out", shapes.parent / "bad-out", "--test-images",
                           "128", *args] for args, _ in BAD_IMAGE])


@pytest.mark.parametrize("case", range(len(BAD_IMAGE)), ids=[m for _, m in BAD_IMAGE])
def test_bad_input_to_train_image_is_one_error_line(bad_image_runs, case):
    (code, stderr), message = bad_image_runs[case], BAD_IMAGE[case][1]
    assert code == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith("mariana: error: ") and message in stderr
    assert "Traceback" not in stderr


def test_a_killed_partition_fails_the_job_with_a_clear_error(tmp_path, shapes):
    """Rank 1 holds the second partition: rank 0 waits on it inside the pipeline and must
    not hang there."""
    run = kill_a_rank(["train", "image", "--data", str(shapes), "--partitions", "2", "--epochs", "100000",
                       "--batch-size", "64", "--test-images", "128", "--timeout", "30", "--out", str(tmp_path / "f")],
                      after_s=2.0)
    assert run["seconds"] < 40           # an error, not a hang
    assert run["returncode"] == 2, run["stderr"]
    assert "mariana: error: rank 1 of 2 was killed by SIGKILL" in run["stderr"]
    assert not (tmp_path / "f").exists()
    assert not run["children"]


@pytest.mark.parametrize("layout", [["--partitions", "2"], ["--groups", "2"]], ids=["P2", "G2"])
def test_a_stopped_rank_fails_the_job_within_its_timeout(tmp_path, shapes, layout):
    """A rank that stops answering (SIGSTOP) without closing its sockets: the pipeline's and
    the exchange's groups were made without --timeout, so gloo gave them 30 minutes and the
    job hung (still running after 300 s in an exploratory run)."""
    run = kill_a_rank(["train", "image", "--data", str(shapes), *layout, "--epochs", "100000", "--batch-size", "64",
                       "--test-images", "128", "--timeout", "5", "--out", str(tmp_path / "f")],
                      after_s=2.0, sig=signal.SIGSTOP)
    assert run["returncode"] == 2 and run["seconds"] < 40, run
    assert "mariana: error: rank" in run["stderr"] and not (tmp_path / "f").exists()
    assert "was stopped (SIGSTOP, or a debugger held it)" in run["stderr"], run["stderr"]  # not a rank that timed out
    assert not run["children"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_launcher_stopped_takes_its_ranks_with_it(tmp_path, shapes, sig):
    """SIGTERM to `train image` alone (not its process group) left both ranks training at full
    CPU, and ~50 s later they published; kill -9 of it did the same."""
    out = tmp_path / "f"
    parent = subprocess.Popen([sys.executable, "-m", "mariana", "train", "image", "--data", str(shapes),
                               "--partitions", "2", "--epochs", "100000", "--batch-size", "64", "--test-images", "128",
                               "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        wait_for_rank(parent.pid, 1)
        time.sleep(2.0)  # into the steps
        ranks = children(parent.pid)
        assert len(ranks) == 2, ranks
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=60)  # (the ranks hold its pipes: their ends too)
    finally:
        for pid in ([parent.pid] if parent.poll() is None else []) + [r for r in ranks if running(r)]:
            try:
                os.kill(pid, signal.SIGKILL)  # a failed test leaves nothing training
            except ProcessLookupError:
                pass
    if sig == signal.SIGTERM:  # said once for the job, not once more by each rank it stopped
        assert parent.returncode == 130 and err.count("mariana: interrupted") == 1, err
    deadline = time.monotonic() + 30
    while any(running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in ranks), ranks
    assert not out.exists()
