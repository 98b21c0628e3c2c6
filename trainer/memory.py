"""What a training step holds in memory, by component, the same meaning on any device:

    parameters    the module's parameters
    gradients     their .grad tensors
    optimizer     the optimizer's state tensors (Adam: two moments per parameter)
    activations   the peak of the tensors autograd saved for the backward during the step,
                  seen through saved-tensor hooks; each storage counted once however many
                  views of it are saved, parameters left out (they are counted above)
    buffers       tensors other objects keep between steps (a pipeline stage's buffers for
                  the activations and gradients it receives, one per micro-batch)

Every figure counts storages once (`storage_bytes`). Two cross-checks, for a bench to run
once: `profile_step` runs a step under torch's profiler and returns its memory timeline's
peak by category (CPU or CUDA), and `rss_step` the growth of this process's peak resident
set over a step (Linux, CPU: the first step, before the allocator has memory to reuse).
On CUDA `cuda_peak` adds `max_memory_allocated`.

    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> opt = torch.optim.Adam(net.parameters())
    >>> def step():
    ...     net(torch.ones(16, 4)).sum().backward(); opt.step()
    >>> r = measure_step(step, net, opt)
    >>> r.parameters, r.gradients, r.optimizer      # 49 floats; Adam: 2 x 49 floats + 4 step counters
    (196, 196, 408)
    >>> r.activations   # the input 16x4 and the ReLU's output 16x8, saved by the ReLU and by Linear 2: once
    768
"""
from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mariana.trainer.strategies.local import proc_status

_TRACKERS: list["SavedActivations"] = []   # the SavedActivations in force, innermost last


@dataclass
class MemoryReport:
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0      # tensors kept between steps by `holders` (a pipeline stage's receive buffers)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the memory under `t`: a view shares its base's storage; a sharded
    DTensor (fully_shard's parameters) is this rank's shard."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
        return id(t), t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages under `tensors`, leaving out those keyed in `exclude`.

    >>> x = torch.zeros(10)
    >>> storage_bytes([x, x[:5], x.view(2, 5)]), storage_bytes([x], exclude={x.untyped_storage().data_ptr()})
    (40, 0)
    """
    seen: dict[int, int] = {}
    for t in tensors:
        key, size = _storage(t)
        if exclude is None or key not in exclude:
            seen[key] = size
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class SavedActivations:
    """A context in which every tensor autograd saves for the backward is tallied by storage:
    `live` bytes now, `peak` the most at once. A storage counts while any saved reference to
    it is alive (autograd drops them when the backward has used them), and storages in
    `exclude` (the parameters) not at all."""

    def __init__(self, exclude: set[int] | None = None):
        self.exclude = exclude or set()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self.lock = threading.Lock()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        _TRACKERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TRACKERS.remove(self)
        self._hooks.__exit__(*exc)

    def recomputed(self, storages: dict[int, int]) -> None:
        """A checkpointed segment was just recomputed in the backward: its tensors that
        checkpoint keeps (`storages`: key -> bytes) are alive on top of what is saved until
        that segment's backward has used them, which ends before the next recomputation."""
        with self.lock:
            extra = sum(size for key, size in storages.items() if key not in self.refs and key not in self.exclude)
            self.peak = max(self.peak, self.live + extra)

    def _pack(self, t: torch.Tensor):
        key, size = _storage(t)
        if key in self.exclude:
            return t
        with self.lock:
            if self.refs.get(key, 0) == 0:
                self.sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
            self.refs[key] = self.refs.get(key, 0) + 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        with self.lock:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                del self.refs[key]
                self.live -= self.sizes.pop(key)


def recomputation(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run a checkpointed segment (trainer/strategies/model_parallel.Partition calls this
    for each of its segments). When it runs as the backward's recomputation inside a
    SavedActivations, the tensors it makes that are still alive when it stops (those the
    checkpoint keeps for the segment's backward) are counted as activations at that moment:
    checkpoint saves them through its own hooks, which ours cannot see."""
    if not _TRACKERS or torch._C._current_graph_task_id() == -1:  # not measured, or the first forward
        return run()
    made = _Made()
    try:
        with made:
            return run()
    finally:  # also when checkpoint stops the recomputation early (it raises once it has all it needs)
        _TRACKERS[-1].recomputed(made.alive())


class _Made(TorchDispatchMode):
    """Every tensor the ops under it make, held weakly: `alive()` the storages still in use."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[weakref.ref, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), *_storage(t)))
        return out

    def alive(self) -> dict[int, int]:
        return {key: size for ref, key, size in self.made if ref() is not None}


class _Saved:
    """One saved reference; autograd frees it with the graph node that held it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedActivations):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


def measure_step(step: Callable[[], object], module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 holders: tuple = ()) -> MemoryReport:
    """Run `step` (forward, backward and the optimizer's step) with its saved activations
    tallied; then the parameters, gradients and optimizer state as they are after it, and
    the other tensors `holders` keep (`held_tensors`)."""
    params = list(module.parameters())
    exclude = {_storage(p)[0] for p in params}
    with SavedActivations(exclude) as saved:
        step()
    grads = [p.grad for p in params if p.grad is not None]
    state = optimizer_tensors(optimizer)
    known = exclude | {_storage(t)[0] for t in grads + state}
    return MemoryReport(parameters=storage_bytes(params), gradients=storage_bytes(grads),
                        optimizer=storage_bytes(state), activations=saved.peak,
                        buffers=storage_bytes(held_tensors(holders), exclude=known))


def held_tensors(holders: tuple, depth: int = 6) -> list[torch.Tensor]:
    """The tensors reachable from `holders` through their attributes, dicts, lists and
    tuples (not through modules: their parameters are counted as such), `depth` levels down.

    >>> class Stage: pass
    >>> s = Stage(); s.recv = [{"buffer": torch.zeros(4)}, (torch.zeros(2),)]; s.net = torch.nn.Linear(2, 2)
    >>> storage_bytes(held_tensors((s,)))
    24
    """
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj, left: int) -> None:
        if id(obj) in seen or left < 0 or isinstance(obj, (torch.nn.Module, str, bytes, int, float, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, left - 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v, left - 1)
        elif hasattr(obj, "__dict__") and not callable(obj):
            for v in vars(obj).values():
                walk(v, left - 1)
    for h in holders:
        walk(h, depth)
    return found


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """Run `step` under torch's profiler and return its memory timeline's peaks on `device`:
    {"peak": bytes of all categories at the busiest moment, "by_category": {name: its own
    peak}}. Reads the timeline behind `export_memory_timeline` (deprecated as an export, so
    the data are taken from the class it uses)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # acc_events: one cycle here either way; without it torch 2.11 warns that it clears events per cycle
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True,
                 acc_events=True) as prof:
        step()
    where = f"{device.type}:{device.index or 0}" if device.type == "cuda" else "cpu"
    _times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(where)
    names = ["unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_INDEX]
    by_category = {name: max((row[i + 1] for row in sizes), default=0) for i, name in enumerate(names)}
    return {"peak": max((sum(row) for row in sizes), default=0), "by_category": by_category}


def rss_step(step: Callable[[], object]) -> int | None:
    """How far this process's resident set rose above where it stood, at its peak during
    `step` (Linux: VmHWM reset through /proc/self/clear_refs); None where that is not there.
    Garbage is collected first: a collection that ran inside `step` and freed earlier
    garbage would hide the step's own rise (seen in a long test run). Then glibc hands back
    the free memory it keeps (`malloc_trim`): blocks reused from it would not show either,
    and a process that raised malloc's mmap threshold (a server's, services/runtime/tuning.py)
    serves even 64 MiB from that heap (seen as a rise of 0 in a test run)."""
    gc.collect()
    _malloc_trim()
    before = proc_status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    step()
    peak = proc_status("VmHWM")
    return None if before is None or peak is None else max(0, peak - before)


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): the freed memory malloc keeps goes back to the kernel."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc's on Linux
    except (OSError, AttributeError):  # not glibc
        pass


def cuda_peak(device: torch.device, step: Callable[[], object]) -> int | None:
    """`max_memory_allocated` over `step` above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
