"""trainer/memory.py: each component counted once, saved activations as torch's own profiler
sees them, recomputation's transient counted; and the partition balancer that prices them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mariana.trainer import memory
from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig
from mariana.trainer.strategies.model_parallel import (Partition, StageCost, cut_partitions, in_flight, plan_bytes,
                                                       probe_stages, recompute_plan, segments)

CNN = ImageCNNConfig(size=32, channels=(16, 16, 32), embed_dim=32)


def step_of(module, opt, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        opt.step()
    return step


def fixture(plan=None, recompute=False):
    torch.manual_seed(0)
    model = ImageCNN(CNN)
    part = Partition(model.stages(), recompute, plan)
    opt = torch.optim.Adam(part.parameters())
    x, y = torch.randn(16, 1, 32, 32), torch.randint(0, 10, (16,))
    return part, opt, step_of(part, opt, x, y)


def test_components_are_the_model_and_adam_and_activations_match_the_profiler():
    part, opt, step = fixture()
    step()
    r = memory.measure_step(step, part, opt)
    n = sum(p.numel() for p in part.parameters())
    assert r.parameters == r.gradients == 4 * n
    assert r.optimizer == 8 * n + 4 * len(list(part.parameters()))  # two moments + a step counter per tensor
    prof = memory.profile_step(step, torch.device("cpu"))
    seen = prof["by_category"]["activation"] + prof["by_category"]["input"]
    assert seen == pytest.approx(r.activations, rel=0.05), (seen, r.activations)
    assert prof["peak"] >= r.total * 0.9


def test_recomputation_is_counted_while_it_lives():
    plain, opt, step = fixture()
    step()
    full = memory.measure_step(step, plain, opt).activations
    costs = probe_stages(ImageCNN(CNN).stages(), torch.randn(16, 1, 32, 32))
    assert full == pytest.approx(sum(c.activation_bytes for c in costs), rel=0.05)
    every = [(a, b, True) for a, b in segments([c.activation_bytes for c in costs], True)]
    chosen = recompute_plan(costs, 1, True)
    assert any(r for *_, r in chosen) and chosen != every
    measured = {}
    for name, plan in (("every", every), ("chosen", chosen)):
        part, opt, step = fixture(plan)
        step()
        measured[name] = rec = memory.measure_step(step, part, opt).activations
        biggest = max(sum(c.activation_bytes for c in costs[a:b]) for a, b, r in plan if r)
        assert rec >= biggest  # the segment being recomputed is there, not just the boundaries
        assert rec == pytest.approx(plan_bytes(costs, plan, 1), rel=0.1)
    # the chosen plan peaks lower than storing everything, and no higher than recomputing everything
    assert measured["chosen"] < 0.8 * full
    assert plan_bytes(costs, chosen, 1) <= plan_bytes(costs, every, 1)


def test_storages_count_once_and_rss_sees_a_big_step():
    x = torch.zeros(1000)
    assert memory.storage_bytes([x, x[10:], x.view(10, 100)]) == 4000
    held = []
    rise = memory.rss_step(lambda: held.append(torch.ones(64 * 2**20 // 4)))
    if rise is not None:  # Linux
        assert rise >= 60 * 2**20


def test_garbage_freed_during_the_step_does_not_hide_its_rise():
    """A 128 MB cycle left by earlier work, collected inside the step: the step's own 64 MB
    still shows (the baseline is taken after a collection)."""
    import gc

    cycle = [torch.ones(128 * 2**20 // 4)]
    cycle.append(cycle)
    del cycle
    held = []

    def step():
        gc.collect()
        held.append(torch.ones(64 * 2**20 // 4))
    rise = memory.rss_step(step)
    if rise is not None:  # Linux
        assert rise >= 60 * 2**20, rise


def test_a_heap_that_keeps_freed_memory_does_not_hide_the_rise():
    """A process that raised malloc's mmap threshold (a server's tuning) and
    freed big blocks earlier still sees its step's 64 MB: rss_step hands the kept memory back
    first. In a process of its own, as the settings last for the process."""
    code = """if True:
        import gc, torch
        from mariana.services.runtime import tuning
        from mariana.trainer import memory
        tuning._keep_freed_memory()
        garbage = [torch.ones(k * 2**20) for k in range(1, 30)]
        del garbage
        held = []
        print(memory.rss_step(lambda: held.append(torch.ones(64 * 2**20 // 4))))
    """
    env = {**os.environ}
    env.pop("MARIANA_NO_MALLOPT", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rise = out.stdout.split()[-1]
    if rise != "None":  # Linux
        assert int(rise) >= 60 * 2**20, rise


def test_the_balancer_prices_micro_batches_in_flight():
    costs = [StageCost("a", 0, 100, 1, 1.0), StageCost("b", 0, 10, 1, 5.0), StageCost("c", 300, 1, 1, 1.0)]
    assert [in_flight("1f1b", 8, 3, k) for k in range(3)] == [3, 2, 1]
    # a and b held twice: 220 | 301 beats 200 | 311 (with the pipeline's receive buffers: +8 | +8)
    assert cut_partitions(costs, 2, "memory", "1f1b", 8) == [(0, 2), (2, 3)]
    assert cut_partitions(costs, 2, "time") == [(0, 1), (1, 3)]                # 1 | 6, not 6 | 1: equal, first
    assert cut_partitions(costs, 3, "time") == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(Exception, match="--balance 'speed'"):
        cut_partitions(costs, 2, "speed")


def test_a_child_reports_its_own_peak_rss_not_its_parents():
    """Linux's ru_maxrss keeps the parent's peak across fork and exec; the peak a job
    reports (VmHWM) is its own program's."""
    import subprocess
    import sys

    ballast = bytearray(400 << 20)  # this process's peak: at least 400 MB
    code = "from mariana.trainer.strategies.local import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1 < child < 300 < len(ballast) >> 20, child
