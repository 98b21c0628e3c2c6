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
  pattern's own last part starts with '_'.

Items keep their order, and each expands in place: a file named twice is
read twice, as a list of files always was. A missing file, a glob that matches nothing, and a directory with no
data files are each an error naming the item, raised before any work starts.
"""
from __future__ import annotations

import glob
import os

from mariana.sparse.errors import MarianaError

HIDDEN = (".", "_")
GLOB_CHARS = "*?["


class NoDataFiles(MarianaError):
    """A data spec's item names no file to read."""


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
    """
    return [path for item in specs for path in _expand_item(item)]


def _expand_item(item: str) -> list[str]:
    if os.path.isdir(item):
        return _directory_files(item)
    if os.path.exists(item):
        return [item]
    if not is_glob(item):
        raise NoDataFiles(f"{item}: no such file or directory")
    matches = [m for m in sorted(glob.glob(item, recursive=True)) if visible(os.path.basename(m), item)]
    if not matches:
        raise NoDataFiles(f"{item}: the pattern matches no files")
    files = [f for m in matches for f in (_directory_files(m, item) if os.path.isdir(m) else [m])]
    if not files:
        raise NoDataFiles(f"{item}: the pattern matches only directories without data files")
    return files


def _directory_files(directory: str, pattern: str = "") -> list[str]:
    """The visible files directly in `directory`, sorted by name; an error naming it when there are
    none, unless it was one match of `pattern` (then the pattern's other matches may have some)."""
    with os.scandir(directory) as entries:
        entries = sorted(entries, key=lambda e: e.name)
    files = [os.path.join(directory, e.name) for e in entries if visible(e.name) and e.is_file()]
    if not files and not pattern:
        subdirs = sum(1 for e in entries if visible(e.name) and e.is_dir())
        hint = (f" ({subdirs} subdirectories are not read: name them, or use a glob such as "
                f"{os.path.join(directory, '*', '*')})") if subdirs else \
            " (names starting with '.' or '_' are not data)"
        raise NoDataFiles(f"{directory}: the directory holds no data files{hint}")
    return files
