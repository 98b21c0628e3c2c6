"""A version that cannot be written: the disk fills up, or the model directory's filesystem
turns read-only while the job trains. The job fails with a message naming the cause and
the version CURRENT still names, and leaves no partial version behind (trainer/checkpoint.py).
The small or read-only filesystem is a tmpfs in a mount namespace of the test's own
(`unshare -m`, as root): the test skips where that is not allowed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.debian import can_unshare_mounts

pytestmark = pytest.mark.slow


def namespaced(script: str) -> subprocess.CompletedProcess:
    if not can_unshare_mounts():
        pytest.skip("unshare -m is not allowed here (needs root or CAP_SYS_ADMIN): no small filesystem to fill")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def train(data, out, bits: int, quiet: bool = True) -> str:
    return (f"{sys.executable} -m mariana train --data {data} --model lr --out {out} --set hashing.bits={bits}"
            + " --quiet" * quiet)


@pytest.mark.timeout(300)
def test_a_full_disk_fails_the_job_and_keeps_current_whole(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 3_000, seed=31)
    m = tmp_path / "small"
    m.mkdir()
    proc = namespaced(f"set -u; mount -t tmpfs -o size=250k none {m} && {train(data, m / 'ctr', 12)} && "
                      f"{{ {train(data, m / 'ctr', 18)}; echo rc=$?; }}; cat {m}/ctr/CURRENT; ls -a {m}/ctr")
    out = proc.stdout + proc.stderr
    assert "rc=0" not in out and "rc=" in out, out
    assert "cannot write a new version: no space left on its filesystem" in out, out
    assert "CURRENT still names v000001" in out, out
    listing = proc.stdout.split()
    assert "v000001" in listing and "v000002" not in listing, out
    assert not [n for n in listing if n.startswith(".tmp-")], out  # the partial version was removed


@pytest.mark.timeout(300)
def test_a_model_dir_that_turns_read_only_fails_the_job_clearly(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 200_000, seed=32)  # a second or more an epoch: time to turn read-only after the first
    m, log = tmp_path / "ro", tmp_path / "train.log"
    m.mkdir()
    proc = namespaced(f"set -u; mount -t tmpfs none {m} && {train(data, m / 'ctr', 12)} && "
                      f"{{ {train(data, m / 'ctr', 14, quiet=False)} --set train.epochs=4 2>{log} & pid=$!; "
                      f"until grep -q 'epoch 1/4 done' {log} || ! kill -0 $pid; do sleep 0.05; done; "
                      f"until mount -o remount,ro {m}; do sleep 0.1; done; wait $pid; echo rc=$?; cat {log}; }}; "
                      f"cat {m}/ctr/CURRENT; ls -a {m}/ctr")
    out = proc.stdout + proc.stderr
    assert "epoch 2/4 done" in out, out  # read-only from the end of epoch 1: the job went on, then could not write
    assert "rc=0" not in out and "rc=" in out, out
    assert "cannot write a new version: its filesystem is read-only" in out, out
    assert "CURRENT still names v000001" in out and "v000002" not in proc.stdout.split(), out


@pytest.mark.timeout(300)
def test_a_full_disk_leaves_current_where_it_was_and_says_so(tmp_path):
    """`model promote` on a full disk said only "no space left on device" and left its
    .CURRENT.<pid> behind."""
    data = tmp_path / "train.tsv"
    generate_criteo(data, 3_000, seed=33)
    m = tmp_path / "small"
    m.mkdir()
    promote = f"{sys.executable} -m mariana model promote v000001 --model-dir {m / 'ctr'}"
    proc = namespaced(f"set -u; mount -t tmpfs -o size=400k none {m} && {train(data, m / 'ctr', 12)} && "
                      f"{train(data, m / 'ctr', 12)} && {{ dd if=/dev/zero of={m}/fill bs=4k 2>/dev/null; "
                      f"{promote}; echo rc=$?; }}; cat {m}/ctr/CURRENT; ls -a {m}/ctr")
    out = proc.stdout + proc.stderr
    assert "rc=0" not in out and "rc=2" in out, out
    assert "cannot move CURRENT to v000001: no space left on its filesystem" in out, out
    assert "CURRENT still names v000002" in out, out
    assert proc.stdout.split()[proc.stdout.split().index("rc=2") + 1] == "v000002", out
    assert not [n for n in proc.stdout.split() if n.startswith(".CURRENT")], out


@pytest.mark.timeout(300)
def test_files_written_on_a_full_disk_are_named_and_leave_nothing_behind(tmp_path):
    """`gen` said "error writing bytes to file. detail: [errno 28]" and `evaluate --plot` left
    a 0-byte png, naming no file: now one line names the file and says the disk is full, and
    no temp file stays (tune's trials and `mariana up`'s files go through the same writer)."""
    data = tmp_path / "train.tsv"
    generate_criteo(data, 3_000, seed=31)
    full = tmp_path / "full"
    full.mkdir()
    m = f"{sys.executable} -m mariana"
    proc = namespaced(f"set -u; {train(data, tmp_path / 'ctr', 12)} && mount -t tmpfs -o size=64k none {full} && "
                      f"{m} gen criteo --rows 20000 --out {full}/g.tsv; echo rc=$?; "  # refused first: it cannot fit
                      f"{m} gen criteo --rows 300 --out {full}/g.tsv; echo rc=$?; "  # may fit (~200 B a row): fills it
                      f"head -c 60000 /dev/zero > {full}/filler; "
                      f"{m} evaluate --model {tmp_path / 'ctr'} --data {data} --plot {full}/big.png; echo rc=$?; "
                      f"ls -a {full}")
    out = proc.stdout + proc.stderr
    assert f"mariana: error: {full}/g.tsv: 20,000 rows take at least 4.0 MB, and its file system has " in out, out
    assert f"mariana: error: {full}/g.tsv: cannot write it: no space left on its filesystem" in out, out
    assert f"mariana: error: {full}/big.png: cannot write it: no space left on its filesystem" in out, out
    assert out.count("rc=2") == 3, out
    listed = proc.stdout.split("rc=")[-1].split()[1:]
    assert [n for n in listed if n not in (".", "..")] == ["filler"], out  # no temp files, no partial file
