"""Running a training command as N ranks (services/speech_cli.py, services/images_cli.py):

    run_job(mode_argv, argv, nproc, device, train_rank)
      under torchrun, or as a rank that run_ranks started (RANK / WORLD_SIZE set):
          train_rank(ctx, init_method) -> record; rank 0 prints it, or writes it where
          MARIANA_DIST_RESULT says; a failed collective is one error line
      else, nproc == 1: train_rank in this process
      else: data_parallel.run_ranks starts `mariana MODE_ARGV ARGV` nproc times and the
            record rank 0 wrote is returned
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

from mariana.sparse.errors import MarianaError
from mariana.sparse.host import available_cpus


def add_rank_flags(p, out_help: str) -> None:
    """The flags every rank-launching training command takes, after its own."""
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any collective may wait: a lost rank fails the job after at most this")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")


def run_job(mode_argv: list[str], argv: list[str], nproc: int, device: str, train_rank: Callable,
            check: Callable | None = None, nproc_checked: bool = False) -> dict | None:
    """The record to print (None: this process is a rank that is not to print). `nproc` is
    checked against the machine (check_nproc) unless this process is already a rank, or the
    caller checked it (`nproc_checked`: before its other checks, naming its own flags)."""
    from mariana.trainer.strategies import data_parallel as dp

    ctx = dp.DistContext.from_env()
    if ctx.distributed:
        try:
            record = train_rank(ctx, os.environ.get("MARIANA_DIST_INIT"))
        except RuntimeError as e:  # gloo / NCCL: a peer gone, a collective timed out; a pipeline stage's error
            why = " ".join(f"{type(x).__name__}: {' '.join(str(x).split())}" for x in _chain(e))
            raise MarianaError(f"rank {ctx.rank} of {ctx.world_size}: {why[:500]}") from None
        target = os.environ.get("MARIANA_DIST_RESULT")
        if ctx.rank == 0 and target:
            with open(target, "w") as f:
                json.dump(record, f)
            return None
        return record if ctx.rank == 0 else None
    if not nproc_checked:
        check_nproc(nproc, device)
    if nproc == 1:
        return train_rank(ctx, None)
    if check is not None:
        check()  # what every rank would find wrong, found once, before starting them
    with tempfile.TemporaryDirectory(prefix="mariana-ranks-") as tmp:
        target = os.path.join(tmp, "result.json")
        dp.run_ranks([*mode_argv, *argv], nproc, tmp, {"MARIANA_DIST_RESULT": target})
        with open(target) as f:
            return json.load(f)


OVERSUBSCRIBE = 4  # ranks per CPU core at most: more only thrash (tests run a 2 x 2 layout on 2 cores)


def _chain(e: BaseException) -> list[BaseException]:
    """An exception and the ones it was raised from (a pipeline stage wraps the real error)."""
    out = [e]
    while out[-1].__cause__ is not None and len(out) < 4:
        out.append(out[-1].__cause__)
    return out


def check_nproc(nproc: int, device: str) -> None:
    """At most one rank per GPU with a CUDA device; on the CPU, up to OVERSUBSCRIBE per core
    (a warning above one: each rank then gets a share of a core, fine for checking a layout,
    not for measuring it)."""
    import logging

    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        allowed = torch.cuda.device_count()
        if not allowed:
            raise MarianaError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
                               "use --device cpu")
        what = f"{allowed} CUDA device{'s' if allowed > 1 else ''}, one rank per GPU"
    else:
        cores = available_cpus()
        allowed, what = OVERSUBSCRIBE * cores, f"{cores} CPU cores, {OVERSUBSCRIBE} ranks per core at most"
        if cores < nproc <= allowed:
            logging.getLogger("mariana").warning("%d ranks on %d cores: each gets a share of a core (fine to check "
                                                 "a layout, not to time one)", nproc, cores)
    if not 1 <= nproc <= allowed:
        raise MarianaError(f"{nproc} ranks: must be between 1 and {allowed} (this machine: {what})")
