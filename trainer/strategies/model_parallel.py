"""Model parallel x data parallel, as the seed's CNN framework: the ranks form a
(G, P) mesh, G data-parallel groups of P model partitions. Inside a group the
model's stages are cut into P partitions that pass activations forward and
gradients back (a pipeline of M micro-batches, 1F1B or GPipe); across groups,
each partition exchanges its gradients only with the same partition of the
other groups (an all-reduce over its `dp` group). Read top to bottom:

    layout = Layout(groups=G, partitions=P); g, p = layout.coords(rank)
    costs = probe_stages(stages, micro-batch)  each stage's state bytes, saved activations, seconds
    cuts = cut_partitions(costs, P, by)      contiguous partitions, the largest (memory: state +
                                             activations x micro-batches in flight; or time) minimised
    part = Partition(model.stages()[cut p])  the stages of partition p (recomputed in ~sqrt(k)
                                             segments with `recompute`, balanced by bytes)
    step = PipelineStep(part, layout, ...)   PipelineStage + Schedule1F1B / ScheduleGPipe over the
                                             group's `pp` ranks; one all-reduce over the partition's `dp` ranks
    for global batch: group g takes its contiguous share; stage 0 feeds the images, the last
    stage the labels; the schedule runs M micro-batches and averages their gradients; the
    all-reduce averages over the G groups: the gradient of the global batch's mean loss, as
    one process.

Parameter names stay the model's (a Partition holds the model's own stage modules), so the
partitions of group 0 put together are the model's state_dict.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mariana.sparse.errors import ConfigError
from mariana.trainer.memory import SavedActivations, recomputation
from mariana.trainer.strategies.data_parallel import new_group

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Layout:
    """G data-parallel groups x P partitions; rank r is partition r % P of group r // P.

    >>> Layout(groups=2, partitions=2).coords(3), Layout(2, 2).pp_ranks(1), Layout(2, 2).dp_ranks(0)
    ((1, 1), [2, 3], [0, 2])
    """

    groups: int = 1
    partitions: int = 1

    def __post_init__(self) -> None:
        if self.groups < 1 or self.partitions < 1:
            raise ConfigError(f"--groups and --partitions must be >= 1, got {self.groups}, {self.partitions}")

    @property
    def world_size(self) -> int:
        return self.groups * self.partitions

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.partitions)

    def pp_ranks(self, group: int) -> list[int]:
        return [group * self.partitions + p for p in range(self.partitions)]

    def dp_ranks(self, partition: int) -> list[int]:
        return [g * self.partitions + partition for g in range(self.groups)]


def balance(costs: list[float], parts: int, price: Callable[[int, int, int], float] | None = None,
            starts: set[int] | None = None) -> list[tuple[int, int]]:
    """Cut `costs` (one per stage, in order) into `parts` contiguous non-empty runs whose
    largest sum is as small as it can be; returns each run's [start, stop). `price(k, start,
    stop)`, when given, is the cost of stages [start, stop) as partition k instead of their sum
    (a pipeline's first partitions hold more micro-batches in flight than its last); `starts`,
    when given, the only stages a run may begin at (besides the first).

    >>> balance([4, 1, 1, 1, 1], 2)
    [(0, 1), (1, 5)]
    >>> balance([1, 2, 3, 4, 5], 2)   # 6 | 9: no cut does better than 9
    [(0, 3), (3, 5)]
    >>> balance([1, 1, 1, 1], 2, lambda k, i, j: (j - i) * (2 if k == 0 else 1))   # the first costs double
    [(0, 1), (1, 4)]
    >>> balance([1, 1, 1, 1], 2, starts={3})
    [(0, 3), (3, 4)]
    """
    n = len(costs)
    if not 1 <= parts <= n or (starts is not None and parts > 1 + len(set(starts) & set(range(1, n)))):
        raise ConfigError(f"--partitions {parts}: the model has {n} stages, so 1 to {n} partitions")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest-run over cutting the first i stages into k runs
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if j and starts is not None and j not in starts:
                    continue
                run = prefix[i] - prefix[j] if price is None else price(k - 1, j, i)
                worst = max(best[k - 1][j], run)
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        runs.append((cut[k][i], i))
        i = cut[k][i]
    return runs[::-1]


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch, measured by `probe_stages`."""

    name: str
    state_bytes: int     # parameters, their gradients and Adam's two moments (4 x the parameters)
    activation_bytes: int  # saved for the backward (trainer/memory.SavedActivations)
    input_bytes: int     # its input: what a recomputed segment starting here keeps
    seconds: float       # forward + backward
    forward_seconds: float = 0.0  # forward alone: what recomputing it costs


def probe_stages(stages: list[tuple[str, nn.Module]], x: torch.Tensor, repeats: int = 2) -> list[StageCost]:
    """Run each stage forward and backward on `x` (one micro-batch's input; each stage's
    output feeds the next) and measure it: the best of `repeats` timings."""
    out = []
    x = x.clone()  # a view would count its base's whole storage
    for i, (name, stage) in enumerate(stages):
        # the model's input needs no gradient (for a 1-channel conv, that one costs more than the rest)
        x = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        params = list(stage.parameters())
        seconds = forward = math.inf
        for _ in range(repeats):
            with SavedActivations({p.untyped_storage().data_ptr() for p in params}) as saved:
                t0 = time.perf_counter()
                y = stage(x)
                _sync(y)
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                _sync(y)
                seconds, forward = min(seconds, time.perf_counter() - t0), min(forward, t1 - t0)
        stage.zero_grad(set_to_none=True)
        out.append(StageCost(name, 16 * sum(p.numel() for p in params), saved.peak,
                             x.numel() * x.element_size(), seconds, forward))
        x = y
    return out


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def in_flight(schedule: str, microbatches: int, partitions: int, k: int) -> int:
    """Micro-batches whose activations partition k holds at once: all M under GPipe; under
    1F1B the warm-up's P - k (at most M).

    >>> [in_flight("1f1b", 8, 4, k) for k in range(4)], in_flight("gpipe", 8, 4, 3)
    ([4, 3, 2, 1], 8)
    """
    return microbatches if schedule == "gpipe" else min(microbatches, partitions - k)


Plan = list[tuple[int, int, bool]]   # a partition's segments: [start, stop) of its stages, recomputed or not


def recompute_plan(run: list[StageCost], held: int, recompute: bool) -> Plan:
    """A partition's stages in about sqrt(k) segments balanced by saved bytes (Chen et al.
    2016), none beginning where its input would be a large share of what it saves, and which
    of them to recompute: of every choice, the one whose activations peak
    lowest (`plan_bytes`), then the one that recomputes the least forward time. A segment is
    left stored when recomputing it would not lower the peak (e.g. the last partition's last
    segment, whose backward follows at once). Without `recompute`: one stored segment.

    >>> big, small = StageCost("a", 0, 100, 1, 1.0), StageCost("b", 0, 10, 1, 1.0)
    >>> recompute_plan([big, small, small, small], 1, True)   # only the big one pays back
    [(0, 1, True), (1, 4, False)]
    >>> recompute_plan([big, small, small, small], 2, True)   # two in flight: both segments
    [(0, 1, True), (1, 4, True)]
    """
    # a segment begins only at a stage whose input (what the segment keeps per micro-batch) is
    # at most half of what the stage saves: not at a max pool, whose input is its conv's output
    narrow = {i for i, c in enumerate(run) if 2 * c.input_bytes <= c.activation_bytes}
    cuts = segments([c.activation_bytes for c in run], recompute, narrow)
    if not recompute:
        return [(a, b, False) for a, b in cuts]
    choices = [[(a, b, bool(mask >> i & 1)) for i, (a, b) in enumerate(cuts)] for mask in range(1 << len(cuts))]
    return min(choices, key=lambda plan: (plan_bytes(run, plan, held),
                                          sum(c.forward_seconds or c.seconds for a, b, r in plan if r
                                              for c in run[a:b])))


def plan_bytes(run: list[StageCost], plan: Plan, held: int) -> int:
    """Saved activations at their peak for stages run as `plan`, with `held` micro-batches in
    flight: each keeps the inputs of its recomputed segments and all of its stored ones; the
    one in its backward also holds the segment being recomputed, while the segments before
    it are still kept."""
    kept = [sum(c.activation_bytes for c in run[a:b]) if not r else run[a].input_bytes for a, b, r in plan]
    each = sum(kept)
    busiest = max([each] + [sum(kept[:j]) + sum(c.activation_bytes for c in run[a:b])
                            for j, (a, b, r) in enumerate(plan) if r])
    return (held - 1) * each + busiest


def cut_partitions(costs: list[StageCost], parts: int, by: str = "memory", schedule: str = "1f1b",
                   microbatches: int = 1, recompute: bool = False) -> list[tuple[int, int]]:
    """The stages cut into `parts` partitions: `by` "memory" minimises the largest partition's
    bytes (its state, the activations of the micro-batches it holds in flight, recomputed or
    not, and the pipeline's receive buffers), "time" its seconds per micro-batch (forward and
    backward, and the forward again of what it recomputes)."""
    if by not in ("memory", "time"):
        raise ConfigError(f"--balance {by!r}: use memory or time")

    def price(k: int, start: int, stop: int) -> float:
        run = costs[start:stop]
        held = in_flight(schedule, microbatches, parts, k)
        plan = recompute_plan(run, held, recompute)
        if by == "time":
            return sum(c.seconds for c in run) + sum(c.forward_seconds for a, b, r in plan if r for c in run[a:b])
        # torch's PipelineStage keeps a receive buffer per micro-batch: activations from the
        # partition before, gradients from the one after
        buffers = microbatches * ((run[0].input_bytes if k > 0 else 0)
                                  + (costs[stop].input_bytes if stop < len(costs) else 0)) if parts > 1 else 0
        return float(sum(c.state_bytes for c in run) + plan_bytes(run, plan, held) + buffers)
    return balance([float(c.state_bytes + c.activation_bytes) for c in costs], parts, price)


def segments(weights: list[float], recompute: bool, starts: set[int] | None = None) -> list[tuple[int, int]]:
    """A partition's stages (one weight each: their saved activation bytes) cut into about
    sqrt(k) segments for recomputation (Chen et al. 2016), balanced by weight so no segment's
    recomputation holds much more than another's, each beginning at one of `starts` (all
    stages when None); one segment without `recompute`.

    >>> segments([8, 4, 2, 1, 1, 1, 1, 1], True), segments([1, 1, 1, 1], True), segments([1, 1], False)
    ([(0, 1), (1, 2), (2, 8)], [(0, 2), (2, 4)], [(0, 2)])
    >>> segments([8, 4, 2, 1], True, starts={2})
    [(0, 2), (2, 4)]
    """
    n = len(weights)
    count = max(1, round(math.sqrt(n))) if recompute else 1
    if starts is not None:
        count = min(count, 1 + len(set(starts) & set(range(1, n))))
    return balance([float(w) for w in weights], count, starts=starts)


class _ToChannelsLast(torch.autograd.Function):
    """x in NHWC; its gradient handed back in NCHW, as the pipeline sends it (gloo sends
    contiguous tensors only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Partition(nn.Module):
    """Consecutive stages of a model, run in order; the parameter names stay the model's.
    `plan` (from `recompute_plan`) runs them in segments, some recomputed: their activations
    are not kept but recomputed in the backward (activation checkpointing). Without a plan,
    `recompute` checkpoints about sqrt(k) segments of equal length."""

    def __init__(self, stages: list[tuple[str, nn.Module]], recompute: bool = False, plan: Plan | None = None,
                 channels_last: bool = False):
        super().__init__()
        self.channels_last = channels_last  # images NHWC inside; what crosses to another rank NCHW
        self.names = [name for name, _ in stages]
        for name, module in stages:
            self.add_module(name, module)
        if plan is None:
            plan = [(a, b, recompute) for a, b in segments([1.0] * len(stages), recompute)]
        self.segments = [(self.names[a:b], r) for a, b, r in plan]

    def _run(self, names: list[str], x: torch.Tensor) -> torch.Tensor:
        for name in names:
            x = getattr(self, name)(x)
        return x

    def _segment(self, names: list[str], x: torch.Tensor) -> torch.Tensor:
        return recomputation(lambda: self._run(names, x))  # measured by trainer/memory when it runs again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            x = _ToChannelsLast.apply(x)
        for names, checkpointed in self.segments:
            if checkpointed and torch.is_grad_enabled():
                x = checkpoint(self._segment, names, x, use_reentrant=False)
            else:
                x = self._run(names, x)
        return x.contiguous() if self.channels_last else x  # the pipeline sends (and receives) NCHW


class PipelineStep:
    """One rank's part of a (G, P) job: its partition, in a pipeline over its group's ranks
    (P > 1), its gradients averaged with the same partition of the other groups (G > 1).
    `step(x, y)` trains on this group's rows of a global batch (stage 0 reads x, the last
    stage y) and returns the mean loss on the last stage (None elsewhere)."""

    def __init__(self, partition: Partition, layout: Layout, rank: int, microbatches: int, schedule: str,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device):
        if schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {schedule!r}: use one of {list(SCHEDULES)}")
        if microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {microbatches}")
        self.layout, self.rank, self.loss_fn = layout, rank, loss_fn
        self.group, self.part = layout.coords(rank)
        self.first, self.last = self.part == 0, self.part == layout.partitions - 1
        self.module = partition.to(device)
        self.dp_group = self.pp_group = None
        if dist.is_initialized() and layout.world_size > 1:
            # every rank creates every group, in the same order (new_group is collective)
            dp = [new_group(layout.dp_ranks(p)) for p in range(layout.partitions)]
            pp = [new_group(layout.pp_ranks(g)) for g in range(layout.groups)]
            self.dp_group, self.pp_group = dp[self.part], pp[self.group]
        self.schedule = self.stage = None
        if layout.partitions > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            self.stage = PipelineStage(self.module, self.part, layout.partitions, device, group=self.pp_group)
            kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            self.schedule = kind(self.stage, n_microbatches=microbatches, loss_fn=loss_fn)
        self.microbatches = microbatches

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        """Forward and backward of this group's rows, then the exchange of this partition's
        gradients with its replicas; the caller steps its optimizer after."""
        if self.schedule is None:  # the whole model here: micro-batches as gradient accumulation
            losses = []
            for xb, yb in zip(x.tensor_split(self.microbatches), y.tensor_split(self.microbatches)):
                loss = self.loss_fn(self.module(xb), yb) / self.microbatches
                loss.backward()
                losses.append(loss.detach())
            out = torch.stack(losses).sum()
        else:
            losses: list[torch.Tensor] = []
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            out = torch.stack([loss.detach() for loss in losses]).mean() if self.last else None
        if self.layout.groups > 1:
            self.average_gradients()
        return out

    def average_gradients(self) -> None:
        """The mean of this partition's gradients over the G groups: one flat fp32 all-reduce
        over the partition's `dp` ranks, after the schedule (through dist.all_reduce, so
        data_parallel.CollectiveBytes counts it). Not DDP: in torch 2.13 DDP under a GPipe
        schedule fails its first-step bucket rebuild (it counts each micro-batch's backward),
        and with static_graph=True the replicas drifted apart."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.layout.groups)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
