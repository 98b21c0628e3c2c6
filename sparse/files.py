"""Writing a file whole or not at all, with an error a person can act on.

A full disk, a read-only filesystem or a directory of another owner surfaced as
"mariana: error: no space left on device", naming no file, and left the temp file
(`cluster.toml.tmp`, a trials `.json.tmp`, a 0-byte plot) behind.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from typing import IO, Callable

from mariana.sparse.errors import MarianaError, ModelDirError

DISK_FULL = "no space left on its filesystem"
_REASONS = {errno.ENOSPC: DISK_FULL, errno.EDQUOT: "the disk quota is used up",
            errno.EROFS: "its filesystem is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted"}


class WriteError(MarianaError, OSError):
    """A file that could not be written: a MarianaError (one line, exit 2) that is an OSError
    too, so that a caller going on through a full disk (the cluster's supervisor) still does;
    `strerror` is the reason alone."""

    def __init__(self, path: str, reason: str, code: int | None = None):
        super().__init__(f"{path}: cannot write it: {reason}")
        self.path, self.strerror, self.errno = path, reason, code

    def __reduce__(self):
        return type(self), (self.path, self.strerror, self.errno)

    def __str__(self) -> str:  # OSError's would be "[Errno 28] <the reason alone>"
        return str(self.args[0])


def why(e: OSError) -> str:
    """An OSError as a reason: its errno's words (pyarrow's carry the errno in the text).

    >>> why(OSError("error writing bytes to file. detail: [errno 28] No space left on device"))
    'no space left on its filesystem'
    >>> why(OSError(errno.EIO, "Input/output error"))
    'Input/output error'
    """
    code = e.errno
    if code is None:
        m = re.search(r"\[errno (\d+)\]", str(e), re.IGNORECASE)
        code = int(m.group(1)) if m else None
    return _REASONS.get(code) or e.strerror or str(e)


def write_atomically(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False,
                     mode: int | None = None) -> str:
    """`write(f)` into a temp file beside `path`, then renamed over it: readers find the old
    file or the new one. On an error the temp file is removed and WriteError names `path`
    and why. `mode`: the file's permission bits (default: the umask's). Returns `path`."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        if mode is not None:
            os.fchmod(fd, mode)  # O_CREAT leaves the mode of a file that was there alone
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException as e:  # a ValueError from json.dump, a Ctrl-C: the temp file goes too
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(path, why(e), e.errno) from None
        raise
    return path


def loads_json(raw: bytes | str) -> object:
    r"""json.loads whose every refusal of the text is a ValueError saying what was wrong: JSON
    nested deeper than Python's recursion limit raised RecursionError, and a number of more
    than 4,300 digits a ValueError about `sys.set_int_max_str_digits`, and readers of
    manifests and journals let both through as tracebacks.

    >>> loads_json('{"a": [1]}')
    {'a': [1]}
    >>> loads_json("[" * 100000)
    Traceback (most recent call last):
    ...
    ValueError: it nests too deeply
    >>> loads_json('{"n": ' + "9" * 5000 + "}")
    Traceback (most recent call last):
    ...
    ValueError: it holds a number of more than 4300 digits
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
    except ValueError as e:
        if "int_max_str_digits" in str(e) or "integer string conversion" in str(e):
            raise ValueError("it holds a number of more than 4300 digits") from None
        raise


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


DIGESTS = "sha256"  # a version manifest's key: {"manifest": ..., FILE: ...}, what `digests` gives


def manifest_sha256(manifest: dict) -> str:
    """The sha256 of a manifest's content without its DIGESTS: the same for the same values,
    however the file is laid out (key order, indentation).

    >>> manifest_sha256({"b": 1, "a": [1.5]}) == manifest_sha256({"a": [1.5], "b": 1, DIGESTS: {}})
    True
    """
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != DIGESTS}))  # as read back: int keys
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()  # are text


def file_digests(vdir: str | os.PathLike, files: tuple[str, ...]) -> dict:
    """Each of `files`' sha256: with the manifest's (`manifest_sha256`), the DIGESTS a version
    records when it is written."""
    return {f: file_sha256(os.path.join(vdir, f)) for f in files}


def check_digests(vdir: str | os.PathLike, manifest: dict, files: tuple[str, ...]) -> None:
    """ModelDirError when the manifest or one of `files` is not what the version recorded when
    it was written (a manifest edited to other hashing bits was served, its pCTRs collapsed; a
    flipped bit in the weights, or another version's weights copied in, was served without a
    word). A version written before the digests (no DIGESTS) is taken as it is."""
    recorded = manifest.get(DIGESTS)
    if recorded is None:
        return
    if not isinstance(recorded, dict) or recorded.get("manifest") != manifest_sha256(manifest):
        raise ModelDirError(f"{vdir}/manifest.json: changed since the version was written (its content is not what "
                            "its sha256 recorded): an edited manifest changes what the weights mean; not loaded "
                            "(restore it, or train again)")
    for name in files:
        want = recorded.get(name)
        if want is None:
            continue
        try:
            got = file_sha256(os.path.join(vdir, name))
        except OSError:
            continue  # a file that cannot be read: its reader says why
        if got != want:
            raise ModelDirError(f"{vdir}/{name}: changed or damaged since the version was written (its sha256 is "
                                "not the one the manifest recorded); not loaded (restore it, or train again)")
