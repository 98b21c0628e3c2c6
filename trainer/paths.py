"""Checks of the paths a job will write, made before any work: a name the file system
cannot take, or a directory that cannot be made there, found when the job starts, not at
the publish after an hour of training."""
from __future__ import annotations

import os
import tempfile

from mariana.sparse.errors import MarianaError


def check_can_create_in(path: str | os.PathLike, what: str, shown: str | os.PathLike | None = None) -> None:
    """MarianaError unless a directory can be made in `path`, or, where `path` does not exist,
    in its nearest existing ancestor (which must then be a directory): probed with a real
    mkdir, since os.access trusts the mode bits (root "may" write /proc; a read-only mount
    passes too). A dangling symbolic link on the way is named as one: os.makedirs would
    only say "File exists" once the work was done. `shown`: the path the user named.

    >>> check_can_create_in("/proc/m/x", "--out")
    Traceback (most recent call last):
    mariana.sparse.errors.MarianaError: --out /proc/m/x: cannot create a directory in /proc (No such file or directory)
    """
    shown = os.fspath(path if shown is None else shown)
    where = os.path.abspath(path)
    while not os.path.lexists(where):
        where = os.path.dirname(where)
    if not os.path.exists(where):
        raise MarianaError(f"{what} {shown}: {where} is a symbolic link to {os.readlink(where)!r}, which does not "
                           "exist; make its target, or name another directory")
    if not os.path.isdir(where):
        raise MarianaError(f"{what} {shown}: {where} is a file, not a directory; name a directory that can be created")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mariana-probe-", dir=where))
    except OSError as e:
        raise MarianaError(f"{what} {shown}: cannot create a directory in {where} ({e.strerror})") from None


def check_path_name(path: str, what: str) -> None:
    """MarianaError unless `path` can name a file here: os.path.exists answers False for a
    NUL byte, a lone surrogate or a 300-byte name, and the job fails only when it writes.

    >>> check_path_name("/tmp/" + "x" * 300, "--out")
    Traceback (most recent call last):
    mariana.sparse.errors.MarianaError: --out: a name in it is 300 bytes long, more than file names may be (255)
    """
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:
        raise MarianaError(f"{what}: {path!r} is not a file name (it holds characters no file name can)") from None
    if b"\0" in raw:
        raise MarianaError(f"{what}: {path!r} holds a NUL byte, which no file name can")
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > NAME_MAX:
        raise MarianaError(f"{what}: a name in it is {longest} bytes long, more than file names may be ({NAME_MAX})")
    if len(raw) >= PATH_MAX:
        raise MarianaError(f"{what}: the path is {len(raw)} bytes long, more than paths may be ({PATH_MAX - 1})")


NAME_MAX, PATH_MAX = 255, 4096  # Linux's (limits.h): every local file system Mariana writes to
