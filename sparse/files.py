"""Writing a file whole or not at all, with an error a person can act on.

A full disk, a read-only filesystem or a directory of another owner surfaced as
"mariana: error: no space left on device", naming no file, and left the temp file
(`cluster.toml.tmp`, a trials `.json.tmp`, a 0-byte plot) behind.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import IO, Callable

from mariana.sparse.errors import MarianaError

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
