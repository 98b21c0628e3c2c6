"""Synchronous data parallel training over torch.distributed (gloo on the CPU,
NCCL on CUDA): every rank holds the whole model, takes its slice of each global
batch, and the gradients are exchanged every step before the optimizer runs.
Read top to bottom:

    ctx = DistContext.from_env()                 RANK / WORLD_SIZE as torchrun sets them
    init_distributed(ctx, init_method, timeout)  every collective times out (a lost rank
                                                 fails the job, never hangs it)
    batches = global_batches(n, B, seed, epoch)  one seeded global order, the same on every rank
    for batch in batches:
        mine = rank_slice(batch, ctx)            N ranks see exactly the rows one rank would
        loss = sum of my rows' losses * N / B    DDP averages: the gradient of the global mean
        backward                                 the exchange hook runs per gradient bucket
        optimizer.step()                         fed the exchanged (averaged) gradient

The exchange (`--exchange`):

    exact        fp32 all-reduce, bucketed and overlapped with backward (DDP)
    fp16         torch's fp16_compress_hook: half the bytes
    powersgd:R   torch's PowerSGD, rank R, error feedback, compression after a warm-up
                 (5% of the steps); one bucket on gloo (several aborted there now and then)
    onebit       1-bit SGD (Seide et al. 2014): the signs of (gradient + the error left last
                 step) packed 8 to a byte, and one scale per row of each parameter (the row's
                 mean |value|; a vector is one row); every rank all-gathers the messages and
                 decodes them in rank order. A scale per row, not per tensor: on the speech
                 DNN one per tensor lost 11 points of accuracy (docs/benchmarks.md)
    approx       the default approximate exchange (DEFAULT_APPROX)

The adaptive learning rate is approximate in the seed's sense: the optimizer's
accumulators (AdaGrad's sums, Adam's moments) are fed the exchanged gradient and
are never sent, so every replica computes the same update and stays identical;
only gradients cross the wire.

Bytes: `CollectiveBytes` counts what each hook hands to a collective (payload)
and what a ring sends for it (all-reduce 2(N-1)/N, all-gather (N-1) times the
payload); `io_written()` (wchar of /proc/self/io) counts what gloo really wrote.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mariana.sparse.errors import ConfigError
from mariana.sparse.host import available_cpus, proc_stat

log = logging.getLogger(__name__)

EXCHANGES = ("exact", "fp16", "powersgd", "onebit")
DEFAULT_APPROX = "onebit"      # what `--exchange approx` names: chosen by bench/speech_dp.py (docs/benchmarks.md)
POWERSGD_WARMUP = 0.05          # share of the steps before PowerSGD compresses (exact all-reduce until then)


@dataclass(frozen=True)
class Exchange:
    """How gradients cross between ranks.

    >>> parse_exchange("powersgd:2")
    Exchange(kind='powersgd', rank=2)
    >>> parse_exchange("approx") == parse_exchange(DEFAULT_APPROX)
    True
    >>> parse_exchange("zip")
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.ConfigError: --exchange 'zip': use exact, fp16, powersgd:R (R >= 1), onebit or approx
    """

    kind: str = "exact"
    rank: int = 0          # powersgd's matrix rank

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}" if self.kind == "powersgd" else self.kind


def parse_exchange(text: str) -> Exchange:
    text = text.strip().lower()
    if text == "approx":
        text = DEFAULT_APPROX
    kind, _, arg = text.partition(":")
    bad = ConfigError(f"--exchange {text!r}: use exact, fp16, powersgd:R (R >= 1), onebit or approx")
    if kind not in EXCHANGES:
        raise bad
    if kind == "powersgd":
        try:
            rank = int(arg or 1)
        except ValueError:
            raise bad from None
        if rank < 1:
            raise bad
        return Exchange(kind, rank)
    if arg:
        raise bad
    return Exchange(kind)


# ---- processes ------------------------------------------------------------------------

@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env=None) -> "DistContext":
        """RANK, WORLD_SIZE and LOCAL_RANK as torchrun (or `mariana train --nproc`) sets them;
        none set: one process.

        >>> DistContext.from_env({"RANK": "1", "WORLD_SIZE": "2"})
        DistContext(rank=1, world_size=2, local_rank=1)
        """
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", 1))
        rank = int(env.get("RANK", 0))
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        return cls(rank, world, int(env.get("LOCAL_RANK", rank)))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def place_rank(device: torch.device, threads: int, ctx: DistContext) -> tuple[torch.device, int]:
    """This rank's device (CUDA: GPU LOCAL_RANK when there are several ranks) and torch threads
    (`threads`, or 0: the cores shared out among the ranks), which it sets."""
    if device.type == "cuda" and ctx.distributed:
        device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
    threads = threads or max(1, available_cpus() // ctx.world_size)
    torch.set_num_threads(threads)
    return device, threads


MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()  # what the process group's timedelta holds


def check_rank_flags(threads: int, timeout_s: float) -> None:
    """ConfigError unless --threads and --timeout (`services.ranks.add_rank_flags`, every
    multi-rank mode's) can be used: a negative thread count failed in torch on every rank, a
    timeout of 0 in gloo's start-up, nan, inf or 1e300 in the process group's timedelta."""
    if threads < 0:
        raise ConfigError(f"--threads {threads}: must be >= 0 (0: the cores shared out among the ranks)")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout {timeout_s:g}: must be a number of seconds > 0 (what any collective "
                          "may wait for a lost rank; default 120)")


def init_distributed(ctx: DistContext, backend: str, init_method: str | None = None,
                     timeout_s: float = 60.0) -> None:
    """Join the process group. Every collective after this times out after `timeout_s`, so a
    rank that dies fails the others with an error instead of a hang. `init_method` None:
    env:// (MASTER_ADDR / MASTER_PORT, as torchrun sets them)."""
    global _timeout
    if not ctx.distributed or dist.is_initialized():
        return
    _timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method or "env://", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=_timeout)


_timeout: datetime.timedelta | None = None


def new_group(ranks: list[int]):
    """dist.new_group with the timeout init_distributed was given: without one, gloo gives a
    group 30 minutes, and a rank stopped (SIGSTOP) hung the image mode's pipeline and its
    exchange for that long, whatever --timeout said."""
    return dist.new_group(ranks, timeout=_timeout)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def comm_device() -> torch.device:
    """Where tensors handed to a collective must live: this rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---- batches ----------------------------------------------------------------------------

def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Row indices of each global batch of an epoch: one order drawn from (seed, epoch), so
    every rank (and a run with any number of ranks) cuts the same batches.

    >>> [b.tolist() for b in global_batches(5, 2, 0, 0)] == [b.tolist() for b in global_batches(5, 2, 0, 0)]
    True
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return list(order.split(batch_size))


def rank_slice(batch: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """This rank's contiguous share of a global batch (sizes differ by at most one).

    >>> [rank_slice(torch.arange(5), DistContext(r, 2)).tolist() for r in (0, 1)]
    [[0, 1, 2], [3, 4]]
    """
    return batch.tensor_split(ctx.world_size)[ctx.rank]


def train_step(net: nn.Module, optimizer: torch.optim.Optimizer, loss_sum, x: torch.Tensor, y: torch.Tensor,
               global_rows: int, world_size: int) -> torch.Tensor:
    """One synchronous step on this rank's rows (x, y) of a global batch of `global_rows`:
    the loss is the sum over my rows * N / global_rows, so DDP's average over N ranks is the
    gradient of the global batch's mean loss, whatever the share each rank got. Returns my
    rows' summed loss (detached).

    >>> net, opt = nn.Linear(2, 1), None
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> mse = lambda out, y: ((out.squeeze(1) - y) ** 2).sum()
    >>> float(train_step(net, opt, mse, torch.zeros(4, 2), torch.ones(4), 4, 1)) >= 0
    True
    """
    loss = loss_sum(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    (loss * (world_size / global_rows)).backward()
    optimizer.step()
    return loss.detach()


# ---- counting bytes -----------------------------------------------------------------------

@dataclass
class CollectiveBytes:
    """Bytes handed to collectives by the exchange hooks, and what a ring sends for them."""

    payload: int = 0        # bytes of the tensors handed to all_reduce / all_gather
    sent: int = 0           # bytes this rank sends for them (ring all-reduce, ring all-gather)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, op: str, payload: int, world: int) -> None:
        sent = 2 * (world - 1) * payload // world if op == "all_reduce" else (world - 1) * payload
        with self.lock:
            self.payload += payload
            self.sent += sent

    def snapshot(self) -> dict:
        with self.lock:
            return {"payload": self.payload, "sent": self.sent}


_COUNTERS: list[CollectiveBytes] = []
_ORIGINAL: dict = {}
_PATCH_LOCK = threading.Lock()


def count_collectives(counter: CollectiveBytes) -> None:
    """From now on, count every dist.all_reduce / dist.all_gather call of this process in
    `counter`. torch's hooks look these up in the module at each call (PowerSGD's warm-up
    all-reduce too, through default_hooks._allreduce_fut), so theirs are counted as well.
    `stop_counting(counter)` undoes it."""
    with _PATCH_LOCK:
        if not _ORIGINAL:
            _ORIGINAL.update(all_reduce=dist.all_reduce, all_gather=dist.all_gather)

            def all_reduce(tensor, *args, **kwargs):
                group = kwargs.get("group", args[1] if len(args) > 1 else None)
                _tally("all_reduce", tensor.numel() * tensor.element_size(), group)
                return _ORIGINAL["all_reduce"](tensor, *args, **kwargs)

            def all_gather(tensor_list, tensor, *args, **kwargs):
                group = kwargs.get("group", args[0] if args else None)
                _tally("all_gather", tensor.numel() * tensor.element_size(), group)
                return _ORIGINAL["all_gather"](tensor_list, tensor, *args, **kwargs)
            dist.all_reduce, dist.all_gather = all_reduce, all_gather
        _COUNTERS.append(counter)


def stop_counting(counter: CollectiveBytes) -> None:
    with _PATCH_LOCK:
        if counter in _COUNTERS:
            _COUNTERS.remove(counter)
        if not _COUNTERS and _ORIGINAL:
            dist.all_reduce, dist.all_gather = _ORIGINAL["all_reduce"], _ORIGINAL["all_gather"]
            _ORIGINAL.clear()


def _tally(op: str, payload: int, group=None) -> None:
    """`group`: the process group the collective runs over (None: the default, all ranks)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    for c in list(_COUNTERS):
        c.add(op, payload, world)


def io_written() -> int | None:
    """Bytes this process has written (wchar of /proc/self/io: sockets included), or None
    where there is no such file."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# ---- the exchanges ----------------------------------------------------------------------

# DDP checks a hook's annotations against the real classes (these modules' annotations are
# strings), so the hooks below carry none.
def allreduce_hook(_state, bucket):
    """exact: the fp32 all-reduce DDP does by itself, through dist.all_reduce so it is counted."""
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


class OneBitState:
    """The error each rank's 1-bit messages left out, per bucket (added to its next gradient)."""

    def __init__(self) -> None:
        self.errors: dict[int, torch.Tensor] = {}


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of `x` (>= 0: 1), 8 to a uint8 (the first value in the high bit), the last
    byte zero-padded: numpy's packbits on the CPU.

    >>> unpack_signs(pack_signs(torch.tensor([1.0, -2.0, 0.0, -1.0, 3.0])), 5).tolist()
    [1.0, -1.0, 1.0, -1.0, 1.0]
    >>> pack_signs(torch.tensor([1.0] + [-1.0] * 8)).tolist()
    [128, 0]
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.packbits(x.numpy() >= 0))
    bits = (x >= 0).to(torch.uint8)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=x.device)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


_SIGNS: dict = {}


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_signs`'s bytes -> n values of +1.0 / -1.0 (float32): one gather from a table of
    the 256 bytes' eight signs each."""
    table = _SIGNS.get(packed.device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(7, -1, -1)) & 1
        table = _SIGNS[packed.device] = (bits.float() * 2 - 1).to(packed.device)
    if packed.device.type == "cpu":  # numpy's take: 2x index_select's speed, 7x indexing's here
        return torch.from_numpy(np.take(table.numpy(), packed.numpy(), axis=0)).view(-1)[:n]
    return table.index_select(0, packed.long()).view(-1)[:n]


def onebit_hook(state, bucket):
    """onebit: per row of each parameter (a 1-d one: the whole), sign(g + e) * mean|g + e|
    over the row; e keeps what that left out. One message per rank (the fp32 scales, then
    the packed signs), all-gathered; every rank decodes the messages in rank order, so all
    get the same averaged gradient."""
    buf = bucket.buffer()
    world, me = dist.get_world_size(), dist.get_rank()
    shapes = [_rows(g) for g in bucket.gradients()]
    err = state.errors.get(bucket.index())
    # DDP rebuilds its buckets after the first step: an error of another layout starts over
    e = buf.add_(err) if err is not None and err.shape == buf.shape else buf
    scales = torch.cat([seg.view(rows, -1).abs().mean(1) for seg, rows in
                        zip(e.split([r * c for r, c in shapes]), (r for r, _ in shapes))]).float()
    message = torch.cat([scales.view(torch.uint8), pack_signs(e)])  # the floats first: aligned for .view
    gathered = [torch.empty_like(message) for _ in range(world)]
    n_scales = 4 * scales.numel()

    def average(_fut) -> torch.Tensor:
        decoded = [_decode(m[n_scales:], m[:n_scales].view(torch.float32), shapes) for m in gathered]
        state.errors[bucket.index()] = e - decoded[me]  # e is buf: read before buf is overwritten
        total = decoded[0]
        for d in decoded[1:]:
            total.add_(d)
        return buf.copy_(total.div_(world))
    return dist.all_gather(gathered, message, async_op=True).get_future().then(average)


def _rows(g: torch.Tensor) -> tuple[int, int]:
    """(rows, values per row) of a gradient: a matrix's rows; a vector or scalar is one row."""
    return (g.shape[0], g.numel() // g.shape[0]) if g.dim() >= 2 else (1, g.numel())


def _decode(packed: torch.Tensor, scales: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
    signs = unpack_signs(packed, sum(r * c for r, c in shapes))
    at = 0
    for segment, (rows, cols) in zip(signs.split([r * c for r, c in shapes]), shapes):
        segment.view(rows, cols).mul_(scales[at:at + rows, None])
        at += rows
    return signs


def cuda_sync_skips_other_devices() -> None:
    """torch's PowerSGD hook calls `torch.cuda.synchronize(device)` whenever CUDA is
    available, with the bucket's device even when that is the CPU, which raises: a CPU job
    with `--exchange powersgd` failed on any GPU host (seen with torch 2.11 on an H200; the
    hook is the same in 2.13). A CPU tensor needs no CUDA sync: from here on this process's
    `torch.cuda.synchronize` returns at once for a device that is not CUDA, and synchronizes
    CUDA devices (and the current one, for no argument) as before."""
    sync = torch.cuda.synchronize
    if getattr(sync, "skips_other_devices", False):
        return

    def synchronize(device=None):
        if isinstance(device, (torch.device, str)) and torch.device(device).type != "cuda":
            return None
        return sync(device)

    synchronize.skips_other_devices = True
    torch.cuda.synchronize = synchronize


class _FinishedAllReduce:
    """`torch.distributed` as torch's PowerSGD hook sees it on the CPU: the same module, except
    that an async all-reduce has finished before it returns. The hook chains its compression
    steps as callbacks on those futures; a callback runs in the thread that completes the future
    (one of gloo's) or, where it is complete already, in the thread that chains it (the
    backward's). A thread torch did not start multiplies with the OpenMP default of threads
    (the cores), not the rank's `torch.set_num_threads`, and a (10 x 512) = (10 x R)(R x 512)
    product with R >= 2 then comes out with other last bits: the ranks' replicas drifted apart
    from the first compressed step in 3 runs of 4 (`powersgd:2`). Finished first, every callback
    runs in the backward's thread, on every rank. With one bucket on gloo the hook is called at
    the end of the backward, so there was nothing for the exchange to overlap with."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor, *args, **kwargs):
        work = dist.all_reduce(tensor, *args, **kwargs)  # looked up now: count_collectives patches it
        if kwargs.get("async_op"):
            work.get_future().wait()
        return work


def wrap_model(model: nn.Module, exchange: Exchange, total_steps: int, device: torch.device) -> nn.Module:
    """`model` in DDP with `exchange`'s hook (in one process: `model` itself). Buffers are not
    broadcast (every rank sets them from the same data), so only gradients cross the wire."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    one_bucket = exchange.kind == "powersgd" and dist.get_backend() == "gloo"
    # torch 2.13 renamed broadcast_buffers (2.11 knows only the old name); either way the
    # buffers are synced once at the start, not before every forward
    import inspect
    new = "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1024 if one_bucket else 25,
                                              **{"forward_sync_buffers" if new else "broadcast_buffers": False})
    if exchange.kind == "exact":
        ddp.register_comm_hook(None, allreduce_hook)
    elif exchange.kind == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif exchange.kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        if device.type != "cuda":
            cuda_sync_skips_other_devices()
            ps.dist = _FinishedAllReduce()
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=exchange.rank,
                                 start_powerSGD_iter=max(2, int(POWERSGD_WARMUP * total_steps)),
                                 use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    else:
        ddp.register_comm_hook(OneBitState(), onebit_hook)
    return ddp


# ---- launching N ranks on this machine ----------------------------------------------------

def run_ranks(argv: list[str], nproc: int, workdir: str, env: dict | None = None,
              grace_s: float = 10.0) -> None:
    """Run `python -m mariana ARGV` as ranks 0..nproc-1 of one job on this machine (what
    torchrun does): RANK, WORLD_SIZE and LOCAL_RANK set, rendezvous through a file store in
    `workdir` (no port to clash). Returns when every rank exited 0. When one fails, the
    others get `grace_s` seconds to notice (their collectives fail or time out), then are
    killed (at once when those left are all stopped: SIGSTOP, a debugger), and the first
    failure is raised as one error naming the rank. Each rank's stderr comes through
    `RankStderr`: its log lines as they come, its own error line kept for that one."""
    import signal
    import subprocess
    import sys
    import time

    base = {**os.environ, **(env or {}), "WORLD_SIZE": str(nproc),
            "MARIANA_DIST_INIT": f"file://{os.path.abspath(workdir)}/rendezvous"}
    procs, relays = [], []
    failed: dict[int, tuple[float, int]] = {}  # rank -> (when seen, exit code)

    def stop(signum, frame):  # SIGTERM to the launcher alone left its ranks training on, and publishing
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    main = threading.current_thread() is threading.main_thread()  # where Python lets one set a handler
    before = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-m", "mariana", *argv], preexec_fn=_die_with_parent,
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stderr=subprocess.PIPE, text=True, errors="replace"))
            relays.append(RankStderr(rank, nproc, procs[-1].stderr))
        while True:
            codes = [p.poll() for p in procs]  # every rank, each time: no short cut
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in failed:
                    failed[rank] = (time.monotonic(), code)
            if all(c is not None for c in codes):
                break
            if failed and time.monotonic() - min(t for t, _ in failed.values()) > grace_s:
                break
            if failed and all(_is_stopped(p.pid) for p, c in zip(procs, codes) if c is None):
                break  # the ranks left are frozen: none of them will notice, and the grace is theirs
            time.sleep(0.05)
        stopped = [rank for rank, p in enumerate(procs) if p.poll() is None and _is_stopped(p.pid)] if failed else []
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for relay in relays:
            relay.finish()
    if failed:
        raise _rank_failure(failed, relays, nproc, stopped)


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, SIGTSTP) or held by a tracer: /proc's state T or t."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] in (b"T", b"t")


def _rank_failure(failed: dict[int, tuple[float, int]], relays: list["RankStderr"], nproc: int,
                  stopped: Sequence[int] = ()) -> Exception:
    """The job's one error line: the rank that failed first, the cause before its consequences
    (a rank killed by a signal, or one that failed on its own, before the ranks whose collectives
    then failed, which may even abort on the way out), and that rank's own error if it had one."""
    import signal

    from mariana.sparse.errors import MarianaError

    def order(item):
        rank, (seen, code) = item
        return relays[rank].collective_failed, code >= 0, seen
    rank, (_, code) = min(failed.items(), key=order)
    if stopped and relays[rank].collective_failed:  # the cause is alive but frozen: name it, not the first to time out
        return MarianaError(f"rank {stopped[0]} of {nproc} was stopped (SIGSTOP, or a debugger held it): the other "
                            "ranks' collectives timed out waiting for it; the job failed (the ranks were stopped)")
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    said = relays[rank].error
    if said and relays[rank].collective_failed:  # no cause seen but this: say what kind, -v says the rest
        said = "a collective timed out (--timeout)" if "timed out" in said.lower() else \
            "a collective failed; -v shows its error"
    why = f" ({said})" if said else ""
    return MarianaError(f"rank {rank} of {nproc} {how}{why}; the job failed (the other ranks were stopped)")


ERROR_PREFIX = "mariana: error: "


class RankStderr:
    """A rank's stderr, relayed to this process's line by line (its progress and log lines, a
    traceback), up to the rank's own `mariana: error:` line: that line and what follows it go to
    the debug log, and `error` keeps it for the job's one error line. A rank whose peer died
    printed a long RuntimeError (gloo's "Connection closed by peer ... GLHF!", then "terminate
    called without an active exception") before the launcher's line that says what happened."""

    def __init__(self, rank: int, nproc: int, pipe) -> None:
        self.rank, self.nproc = rank, nproc
        self.error: str | None = None
        self._thread = threading.Thread(target=self._relay, args=(pipe,), name=f"rank{rank}-stderr", daemon=True)
        self._thread.start()

    @property
    def collective_failed(self) -> bool:
        """Whether the rank's error was a failed collective (a consequence: services/ranks.py words it
        `rank R of N: ...`) rather than a cause of its own."""
        return self.error is not None and self.error.startswith(f"rank {self.rank} of {self.nproc}: ")

    def finish(self, timeout_s: float = 5.0) -> None:
        """Wait for the rest of the output (the rank has exited: its end of the pipe is closed)."""
        self._thread.join(timeout_s)

    def _relay(self, pipe) -> None:
        import sys

        with pipe:
            for line in pipe:
                if self.error is None and line.startswith(ERROR_PREFIX):
                    self.error = line[len(ERROR_PREFIX):].strip()
                if self.error is None:
                    with _STDERR_LOCK:
                        sys.stderr.write(line)
                        sys.stderr.flush()
                else:
                    log.debug("rank %d of %d: %s", self.rank, self.nproc, line.rstrip())


_STDERR_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """In a rank, before it runs: SIGKILL when the launcher dies (kill -9 of it included), so
    no rank trains on without it (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
