"""A version is its files, not only its name: a real `mariana serve` never answers with
a deleted version's model under a name given again, nor with what it holds in memory
for a version dir since replaced in place (restored from a backup). Its pCTRs are
checked against `mariana.load` of what the dir holds now."""
from __future__ import annotations

import random
import shutil
import time

import numpy as np
import pytest

import mariana
from tests.conftest import run_cli
from tests.integration.serving import Server, tsv_instances

pytestmark = pytest.mark.slow


def train(data, out) -> str:
    """The version `mariana train` published."""
    run_cli("-q", "train", "--data", data, "--model", "lr", "--out", out, check=True)
    return (out / "CURRENT").read_text().strip()


def random_labels(src, dst) -> None:
    """`src` with each label drawn at random: a model of noise, whose pCTRs are not a good one's."""
    rng = random.Random(7)
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            out.write(str(rng.randint(0, 1)) + line[line.index("\t"):])


def served(s: Server, rows: list, version: str, before: list | None = None, timeout: float = 10.0) -> list:
    """The server's pCTRs once it answers as `version` (with other pCTRs than `before`: a
    version replaced in place keeps its name)."""
    deadline = time.monotonic() + timeout
    while True:
        status, answer = s.predict(rows)
        assert status == 200, answer
        if answer["model_version"] == version and answer["pctr"] != before:
            return answer["pctr"]
        assert time.monotonic() < deadline, f"still {answer} after {timeout:g}s:\n{s.logs()}"
        time.sleep(0.1)


def test_the_server_never_answers_with_a_deleted_or_replaced_version(gen_files, tmp_path):
    d, noise = tmp_path / "m", tmp_path / "noise.tsv"
    random_labels(gen_files["test"], noise)
    assert (train(gen_files["train"], d), train(noise, d)) == ("v000001", "v000002")
    rows = tsv_instances(gen_files["test"], 8, numbers=True)
    good, bad = (mariana.load(d, v).predict(rows) for v in ("v000001", "v000002"))
    assert np.abs(good - bad).max() > 0.01
    shutil.copytree(d / "v000002", tmp_path / "backup")
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.2}) as s:
        np.testing.assert_allclose(served(s, rows, "v000002"), bad, atol=1e-6)
        run_cli("model", "rollback", "--model-dir", d, check=True)
        np.testing.assert_allclose(served(s, rows, "v000001"), good, atol=1e-6)  # v000002 kept loaded

        # the random-label version deleted, a good one trained: a new name, and its own pCTRs
        shutil.rmtree(d / "v000002")
        assert train(gen_files["test"], d) == "v000003", "a deleted version's name given again"
        fresh = mariana.load(d, "v000003").predict(rows)
        np.testing.assert_allclose(served(s, rows, "v000003"), fresh, atol=1e-6)

        # v000001 (swapped out, kept loaded) replaced in place by the random-label backup,
        # then promoted: loaded afresh, not swapped back in from memory
        shutil.rmtree(d / "v000001")
        shutil.copytree(tmp_path / "backup", d / "v000001")
        run_cli("model", "promote", "v000001", "--model-dir", d, check=True)
        restored = served(s, rows, "v000001")
        np.testing.assert_allclose(restored, bad, atol=1e-6)

        # the version in service replaced in place (by a copy of v000003): loaded again
        shutil.rmtree(d / "v000001")
        shutil.copytree(d / "v000003", d / "v000001")
        np.testing.assert_allclose(served(s, rows, "v000001", before=restored), fresh, atol=1e-6)
    assert "kept loaded since it was swapped out" not in s.logs()
