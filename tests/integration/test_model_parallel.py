"""Model parallel x data parallel (trainer/strategies/model_parallel.py) in real processes over
gloo: P partitions in a pipeline and G data-parallel groups against one process on the global
batch; gradients and parameters must agree."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def run(out: Path, groups: int, parts: int, micro: int = 4, schedule: str = "1f1b", steps: int = 5,
        recompute: bool = False) -> dict[str, torch.Tensor]:
    """The model's first-step gradients and final parameters, put together from group 0's ranks."""
    out.mkdir(parents=True, exist_ok=True)
    world = groups * parts
    args = [sys.executable, "-m", "tests.integration.mp_rank", str(out), str(groups), str(parts), str(micro),
            schedule, str(steps), "1" if recompute else "0"]
    env = {**os.environ, "WORLD_SIZE": str(world), "MARIANA_DIST_INIT": f"file://{out}/store"}
    procs = [subprocess.Popen(args, cwd=ROOT, env={**env, "RANK": str(r)} if world > 1 else dict(os.environ),
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    merged: dict[str, torch.Tensor] = {}
    for r in range(parts):  # group 0: ranks 0 .. P-1
        merged.update(load_file(str(out / f"rank{r}.safetensors")))
    if groups > 1:  # every group's replica of a partition agrees
        for r in range(parts, world):
            other = load_file(str(out / f"rank{r}.safetensors"))
            for k, v in other.items():
                if k.startswith("param."):
                    assert torch.equal(v, load_file(str(out / f"rank{r % parts}.safetensors"))[k]), k
    return merged


def close(a: dict, b: dict, prefix: str, tol: float = 1e-6) -> float:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith(prefix))
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("p1g1"), 1, 1)


@pytest.mark.parametrize("groups,parts,schedule", [(1, 2, "1f1b"), (1, 2, "gpipe"), (2, 1, "1f1b"),
                                                    (2, 2, "1f1b"), (2, 2, "gpipe")])
def test_partitions_and_groups_match_one_process(tmp_path, one, groups, parts, schedule):
    got = run(tmp_path, groups, parts, schedule=schedule)
    assert close(got, one, "grad.") <= 1e-6
    assert close(got, one, "param.") <= 1e-6
    if parts == 2 and groups == 1:  # the last stage's loss: the batch's mean (with G > 1, its group's rows')
        assert torch.allclose(got["loss"], one["loss"], atol=1e-6)


def test_recomputation_changes_no_gradient(tmp_path, one):
    got = run(tmp_path, 1, 2, recompute=True)
    assert close(got, one, "grad.") <= 1e-6 and close(got, one, "param.") <= 1e-6
