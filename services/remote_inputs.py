"""A job's files read on the loader's host: `coordinator.data_via_loader = true`.

On one host, or with the data on a filesystem every host mounts, the coordinator reads a
job's files itself: it checks them when the job is submitted, scores the validation rows
after each epoch and the test files at the end. With the data only on the loader's host
(docs/operations.md, "Several hosts"), those reads go through the loader:

    CheckJob{ticket, body}                    coordinator -> loader (a command)
        the loader runs `check_data` (the files exist and parse, the held-out rows, the
        config's data-dependent numbers) and answers
    JobChecked{ticket, error, request, spec, size}   loader -> coordinator -> Ok
        the coordinator then runs `check_model_side` (its model directory, a warm start)
    FetchInput{ticket, job, kind, ...}        coordinator -> loader (a command)
        kind "file": one test or validation file, as it is on disk (gzip stays gzip);
        kind "holdout": the held-out tail of the training rows, as text (its header first)
    InputPart{ticket, seq, last, error} + data   loader -> coordinator -> Ok, in order

The coordinator keeps the copies in <coordinator.state_dir>/inputs/<job>/ (fetched once per
job, removed when the job ends) and scores them as local mode would the originals.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from typing import Iterator

import numpy as np

from mariana.services.assemble import check_data, data_bytes, job_validation
from mariana.services.protocol import BadMessage, Message, encode
from mariana.sparse.errors import ConfigError, MarianaError
from mariana.sparse.parse import is_parquet, iter_spans, open_binary
from mariana.trainer.data import RowRange
from mariana.trainer.strategies.local import Validation

log = logging.getLogger(__name__)

PART_BYTES = 4 << 20
CHECK_SECONDS = 120.0   # a submit waits this long for the loader's check


# ---- the loader's side (files, no sockets) -----------------------------------------------

def check_on_loader(body: dict, workers: int = 1) -> dict:
    """JobChecked's fields for a job body: its request, spec and data bytes, or its error
    (`workers`: the cluster's worker processes, `check_data`)."""
    try:
        request, spec = check_data(body, workers)
        return {"error": "", "request": request, "spec": spec.to_dict(), "size": data_bytes(request)}
    except (ConfigError, MarianaError) as e:
        return {"error": str(e)}
    except OSError as e:
        return {"error": f"{e.filename}: {e.strerror}" if e.filename else str(e)}


def file_parts(path: str) -> Iterator[bytes]:
    """A file's bytes as they are on disk."""
    with open(path, "rb") as f:
        while block := f.read(PART_BYTES):
            yield block


def holdout_parts(files: list[str], rows: dict) -> Iterator[bytes]:
    """The text of rows [start, stop) of `files` (RowRange's fields), the first file's header
    line first when the files have one: what local mode reads as the job's validation rows."""
    rng = RowRange(**rows)
    if any(is_parquet(p) for p in files):
        raise MarianaError("a held-out tail of Parquet files cannot be sent from the loader's host: give the "
                           "validation rows as --valid-data files instead (or data_via_loader = false)")
    wrote_header = False
    ends = [rng.offsets[p] for p in files[1:]] + [rng.stop]
    for path, end in zip(files, ends):
        if rng.offsets[path] >= rng.stop:
            break
        if end <= rng.start and not (rng.headers[path] and not wrote_header):
            continue  # every row of this file is trained on
        with open_binary(path) as f:
            for _, first_line, block, lines in iter_spans(f, PART_BYTES, name=path):
                text = block.split(b"\n")[:lines]
                out = []
                for i, line in enumerate(text):
                    n = first_line + i
                    if n <= rng.headers[path]:
                        if not wrote_header:
                            out.append(line)
                            wrote_header = True
                        continue
                    if rng.start <= rng.index(path, n) < rng.stop:
                        out.append(line)
                if out:
                    yield b"\n".join(out) + b"\n"
                if rng.index(path, first_line + lines) >= rng.stop:
                    break


def check_fetch(msg: Message) -> None:
    """BadMessage unless FetchInput names a file, or files and rows."""
    kind = msg["kind"]
    if kind == "file" and isinstance(msg.get("path"), str):
        return
    if kind == "holdout" and isinstance(msg.get("files"), list) and isinstance(msg.get("rows"), dict) \
            and all(isinstance(p, str) for p in msg["files"]):
        return
    raise BadMessage("field", f"FetchInput: kind file needs a path, kind holdout files and rows; got {kind!r:.40}")


async def serve_fetch(msg: Message, tell) -> None:
    """The loader streams FetchInput's bytes as InputParts through `tell` (its report to the
    coordinator, retried until acknowledged)."""
    ticket, seq = msg["ticket"], 0
    try:
        parts = file_parts(msg["path"]) if msg["kind"] == "file" else holdout_parts(msg["files"], msg["rows"])
        while (block := await asyncio.to_thread(next, parts, None)) is not None:
            await tell("InputPart", {"data": np.frombuffer(block, np.uint8)}, ticket=ticket, seq=seq, last=False,
                       error="")
            seq += 1
        await tell("InputPart", None, ticket=ticket, seq=seq, last=True, error="")
    except (MarianaError, OSError, TypeError, KeyError, ValueError) as e:  # unreadable, or rows not a RowRange
        await tell("InputPart", None, ticket=ticket, seq=seq, last=True, error=f"{type(e).__name__}: {e}")


# ---- the coordinator's side --------------------------------------------------------------

class _Fetch:
    def __init__(self, path: str):
        self.path, self.seq, self.done = path, 0, asyncio.get_running_loop().create_future()
        self.file = open(path, "wb")


class RemoteInputs:
    """The coordinator's end: checks and copies by ticket. Its handlers take the loader's
    JobChecked and InputPart (the coordinator's `handle` finds them here)."""

    def __init__(self, coord):
        self.coord = coord
        self.checks: dict[str, asyncio.Future] = {}
        self.fetches: dict[str, _Fetch] = {}
        self.copies: dict[tuple[str, str], tuple[list[str], str]] = {}

    @property
    def enabled(self) -> bool:
        return self.coord.cfg.coordinator.data_via_loader

    def root(self, job: str) -> str:
        return os.path.join(self.coord.cfg.coordinator_state_dir, "inputs", job)

    async def check(self, body: dict) -> tuple[dict, dict, int]:
        """(request, spec, data bytes) of a job body, checked on the loader's host;
        ConfigError with the loader's message when the job is wrong, MarianaError when no
        loader answers."""
        ticket = secrets.token_hex(8)
        done = self.checks[ticket] = asyncio.get_running_loop().create_future()
        try:
            if not await self.coord.command("loader", "CheckJob", ticket=ticket, body=body):
                raise MarianaError("no loader is registered to check the job's files (coordinator.data_via_loader)")
            reply = await asyncio.wait_for(done, CHECK_SECONDS)
        except asyncio.TimeoutError:
            raise MarianaError(f"the loader did not check the job's files within {CHECK_SECONDS:g}s") from None
        finally:
            self.checks.pop(ticket, None)
        if reply["error"]:
            raise ConfigError(reply["error"])
        return reply["request"], reply["spec"], reply["size"]

    async def on_JobChecked(self, peer: bytes, msg: Message) -> list:
        done = self.checks.get(msg["ticket"])
        if done is not None and not done.done():
            done.set_result(msg.fields)
        return encode("Ok", msg.msg_id)

    async def on_InputPart(self, peer: bytes, msg: Message) -> list:
        f = self.fetches.get(msg["ticket"])
        if f is None or f.done.done() or msg["seq"] != f.seq:  # unknown, over, or a retried part
            return encode("Ok", msg.msg_id)
        if "data" in msg.arrays:
            f.file.write(msg.arrays["data"].tobytes())
        f.seq += 1
        if msg["last"]:
            f.file.close()
            f.done.set_result(msg["error"])
        return encode("Ok", msg.msg_id)

    async def fetch(self, job: str, name: str, **what) -> str:
        """One file fetched from the loader into the job's inputs dir; its path."""
        os.makedirs(self.root(job), exist_ok=True)
        ticket = secrets.token_hex(8)
        f = self.fetches[ticket] = _Fetch(os.path.join(self.root(job), name))
        try:
            if not await self.coord.command("loader", "FetchInput", ticket=ticket, job=job, **what):
                raise MarianaError("no loader is registered to send the job's files")
            error = await f.done
        finally:
            f.file.close()
            self.fetches.pop(ticket, None)
        if error:
            raise MarianaError(f"reading {what.get('path') or 'the held-out rows'} on the loader's host: {error}")
        return f.path

    async def test_paths(self, job: str, paths: list[str]) -> list[str]:
        return [await self.fetch(job, f"test-{i}-{os.path.basename(p)}", kind="file", path=p)
                for i, p in enumerate(paths)]

    async def validation(self, job: str, request: dict) -> Validation | None:
        """The job's validation rows as local copies, fetched at the first epoch's end."""
        valid = job_validation(request)
        if valid is None:
            return None
        if ("valid", job) not in self.copies:
            held = request.get("holdout")
            if held:
                name = "holdout-" + os.path.basename(request["data"][0]).removesuffix(".gz")
                paths = [await self.fetch(job, name, kind="holdout", files=request["data"], rows=held["rows"])]
            else:
                paths = [await self.fetch(job, f"valid-{i}-{os.path.basename(p)}", kind="file", path=p)
                         for i, p in enumerate(request["valid_data"])]
            self.copies[("valid", job)] = (paths, valid.source)
        paths, source = self.copies[("valid", job)]
        return Validation(paths, None, source)

    def fetched(self, job: str) -> bool:
        return ("valid", job) in self.copies

    def forget(self, job: str) -> None:
        """A job ended: its copies go."""
        self.copies.pop(("valid", job), None)
        shutil.rmtree(self.root(job), ignore_errors=True)
