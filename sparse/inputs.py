"""What `--data` names, as the list of files to read, in order.

Each item of a data spec (the CLI's comma-separated `--data`, `--test-data`,
a retrain window) is

- a file: itself;
- a directory: its files, sorted by name. Not recursive: subdirectories are
  left out, and so are names starting with '.' or '_' (hidden files, and the
  `_SUCCESS` / `_metadata` markers that Spark, Hive and pyarrow.dataset write
  beside their part files). Name a subdirectory, or use a glob such as
  `DIR/*/*.parquet`, to read deeper;
- a glob (`*`, `?`, `[...]`; `**` spans directories): its matches sorted by
  name, each a file or a directory as above. Like the shell, `*` does not
  match a leading '.'; names starting with '_' are left out too unless the
  pattern's own last part starts with '_'. A glob reads each file once: one
  reached again through a symbolic link (`**` walks each real directory once,
  so a link to a parent is no loop) is left out.

Items keep their order, and each expands in place: a file named twice is
read twice, as a list of files always was. A missing file, a glob that matches nothing, and a directory with no
data files are each an error naming the item, raised before any work starts. So is a
pipe, a device or a socket (`<(cat f)`, `/dev/stdin`): every file is read more than
once (a probe of its first rows, then the pass), and the second read of a pipe would
miss the rows the first one took. A broken symbolic link (dangling, or a loop) among
a directory's entries or a glob's matches is skipped with a warning.
"""
from __future__ import annotations

import collections
import glob
import logging
import os
import stat

from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)

HIDDEN = (".", "_")
GLOB_CHARS = "*?["
NOT_FILES = ((stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISBLK, "a block device"))


class NoDataFiles(MarianaError):
    """A data spec's item names no file to read."""


class NotAFile(MarianaError):
    """A data path is a pipe, a device or a socket: what a second read would not read again."""


def is_glob(item: str) -> bool:
    """Whether `item` is a pattern (an existing path is taken literally, even with '[' in its name).

    >>> is_glob("logs/day-*.tsv.gz"), is_glob("logs/day-0[1-7].parquet"), is_glob("logs/day01.tsv")
    (True, True, False)
    """
    return any(c in item for c in GLOB_CHARS)


def visible(name: str, pattern: str = "") -> bool:
    """A directory entry or glob match that is data, not a hidden file or a marker.

    >>> [n for n in ("part-0.parquet", "_SUCCESS", ".part-0.crc", "b.tsv") if visible(n)]
    ['part-0.parquet', 'b.tsv']
    >>> visible("_2024.tsv", pattern="logs/_*.tsv")
    True
    """
    return not name.startswith(HIDDEN) or os.path.basename(pattern).startswith(name[0])


def split_spec(spec: str) -> list[str]:
    """The items of a comma-separated `--data` value. A comma inside a file's name stays in
    it: the longest run of items that, joined by commas again, names an existing path is one
    item. Empty items (a trailing comma) are dropped.

    >>> split_spec("a.tsv,b.tsv,")
    ['a.tsv', 'b.tsv']
    """
    pieces, items, i = spec.split(","), [], 0
    while i < len(pieces):
        j = next((j for j in range(len(pieces), i + 1, -1) if os.path.lexists(",".join(pieces[i:j]))), i + 1)
        items.append(",".join(pieces[i:j]))
        i = j
    return [p for p in items if p]


def expand_data_paths(specs: list[str]) -> list[str]:
    """The files that `specs` (files, directories, globs) name, in order.

    >>> expand_data_paths(["no/such/day01.tsv"])
    Traceback (most recent call last):
    ...
    mariana.sparse.inputs.NoDataFiles: no/such/day01.tsv: no such file or directory
    >>> expand_data_paths(["no/such/day-*.tsv"])
    Traceback (most recent call last):
    ...
    mariana.sparse.inputs.NoDataFiles: no/such/day-*.tsv: the pattern matches no files
    >>> expand_data_paths(["/dev/null"])
    Traceback (most recent call last):
    ...
    mariana.sparse.inputs.NotAFile: /dev/null is a character device, not a file: Mariana reads its data \
more than once (a probe, then the pass); write it to a file first
    """
    return [path for item in specs for path in _expand_item(item)]


def check_regular(path: str) -> None:
    """NotAFile unless `path` (followed through links) is a regular file or a directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the caller's checks, or the open, say so
    kind = next((what for test, what in NOT_FILES if test(mode)), None)
    if kind:
        raise NotAFile(f"{path} is {kind}, not a file: Mariana reads its data more than once "
                       "(a probe, then the pass); write it to a file first")


def _expand_item(item: str) -> list[str]:
    if os.path.isdir(item):
        return _directory_files(item)
    if os.path.exists(item):
        check_regular(item)
        return [item]
    if not is_glob(item):
        if os.path.islink(item):
            raise NoDataFiles(f"{item}: a symbolic link to a missing file, or a loop of links")
        raise NoDataFiles(f"{item}: no such file or directory")
    matches = [m for m in sorted(_glob(item)) if visible(os.path.basename(m.rstrip(os.sep)), item) and _readable(m)]
    if not matches:
        raise NoDataFiles(f"{item}: the pattern matches no files")
    files = [f for m in matches for f in (_directory_files(m, item) if os.path.isdir(m) else [m])]
    if not files:
        raise NoDataFiles(f"{item}: the pattern matches only directories without data files")
    for f in files:
        check_regular(f)
    return _once(files)


def _readable(path: str) -> bool:
    """False (with a warning) for a broken symbolic link: dangling, or a loop."""
    if os.path.exists(path):
        return True
    log.warning("%s: skipped: a symbolic link to a missing file, or a loop of links", path)
    return False


def _once(files: list[str]) -> list[str]:
    """`files` less those that are another one of them by another name (a symbolic link)."""
    seen: set[str] = set()
    kept = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            kept.append(f)
    return kept


def _glob(pattern: str) -> list[str]:
    """`glob.glob(pattern, recursive=True)`, but a `**` walks each real directory once: the
    standard one follows a link to a parent round and round (two such links: forever).

    >>> _glob("no/such/**/*.tsv")
    []
    """
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return glob.glob(pattern)
    i = parts.index("**")
    head, rest = os.sep.join(parts[:i]) or (os.sep if i else ""), os.sep.join(parts[i + 1:])
    bases = glob.glob(head) if head and is_glob(head) else [head]
    found: list[str] = []
    for base in bases:
        if base and not os.path.isdir(base):
            continue
        for d in _walk_dirs(base):
            if rest:
                found += _glob(os.path.join(glob.escape(d), rest))
            else:  # `DIR/**`: every directory and file below
                if d:  # as the standard glob names them: the base with a trailing separator
                    found.append(os.path.join(d, "") if d == base else d)
                found += [os.path.join(d, e.name) for e in _entries(d) if not e.name.startswith(".") and not _is_dir(e)]
    return found


def _walk_dirs(base: str) -> list[str]:
    """`base` and the visible directories below it (through links), each real one once."""
    seen, out, todo = set(), [], collections.deque([base])
    while todo:  # breadth first: a directory is named by its shortest path
        d = todo.popleft()
        real = os.path.realpath(d or os.curdir)
        if real in seen:
            continue
        seen.add(real)
        out.append(d)
        todo += [os.path.join(d, e.name) for e in _entries(d) if not e.name.startswith(".") and _is_dir(e)]
    return out


def _entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory or os.curdir) as entries:
            return sorted(entries, key=lambda e: e.name)
    except OSError:  # unreadable: the standard glob skips it too
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a loop of links
        return False


def _directory_files(directory: str, pattern: str = "") -> list[str]:
    """The visible files directly in `directory`, sorted by name; an error naming it when there are
    none, unless it was one match of `pattern` (then the pattern's other matches may have some).
    A broken link among them is skipped (with a warning); a pipe, device or socket is an error."""
    with os.scandir(directory) as entries:
        entries = sorted(entries, key=lambda e: e.name)
    files = [os.path.join(directory, e.name) for e in entries if visible(e.name) and not _is_dir(e)]
    files = _once([f for f in files if _readable(f)])  # as a glob's: a link to one of them read it twice
    for f in files:
        check_regular(f)
    if not files and not pattern:
        subdirs = sum(1 for e in entries if visible(e.name) and _is_dir(e))
        hint = (f" ({subdirs} subdirectories are not read: name them, or use a glob such as "
                f"{os.path.join(directory, '*', '*')})") if subdirs else \
            " (names starting with '.' or '_' are not data)"
        raise NoDataFiles(f"{directory}: the directory holds no data files{hint}")
    return files
