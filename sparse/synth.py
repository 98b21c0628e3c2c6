"""Synthetic Criteo-format click logs with a documented planted click model.

The *world* (vocabularies, effects, bias) comes from `model_seed`; the *rows*
from `seed`. Files drawn with different `seed`s and the same `model_seed` are
independent samples of one click model, so one can be the training set and
another the test set. docs/synthetic-data.md describes the model; in short:

    logit(row) = bias
               + sum_c  main_c[value_c]                 26 categorical fields
               + sum_j  g_j(I_j)                        13 integer fields
               + sum_(c,d) in PAIRS  gain * <u_c[value_c], v_d[value_d]>
    click ~ Bernoulli(sigmoid(logit))

- categorical values are Zipf(s=1.1)-distributed over fixed vocabularies
  (3 to 200,000 values), rendered as 8 hex digits like Criteo's;
- main effects are N(0, sigma_c^2), sigma_c in [0, 0.6]; some fields carry no
  signal at all;
- integers are heavy-tailed (log-normal, some with small negative values), and
  g_j is a smooth non-linear curve of log1p(x) with its own effect for missing;
- PAIRS are 6 pairs of categorical fields whose values interact through rank-4
  latent vectors (an effect no per-value weight can express, so a model with
  field interactions should beat logistic regression);
- missing values (empty fields) at per-field rates from 0 to 75%;
- `bias` is solved on a pilot sample so about 22% of rows are clicks.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from mariana.sparse.errors import MarianaError
from mariana.sparse.files import why
from mariana.sparse.hashing import fmix64
from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC

CARDINALITIES = (1_000, 500, 100_000, 50_000, 200, 20, 10_000, 400, 3, 30_000, 4_000, 80_000,
                 2_000, 25, 9_000, 60_000, 10, 3_000, 1_500, 4, 70_000, 15, 12, 40_000, 100, 200_000)
CAT_MISSING = (0, 0.03, 0.05, 0.05, 0, 0.1, 0, 0, 0, 0.05, 0, 0.05, 0, 0, 0, 0.05,
               0, 0, 0.45, 0.45, 0.05, 0.75, 0, 0.05, 0.45, 0.45)
INT_MISSING = (0.45, 0, 0.2, 0.2, 0.03, 0.22, 0.04, 0, 0.04, 0.45, 0.04, 0.75, 0.2)
# (field a, field b) pairs, 0-based categorical indices, whose values interact.
PAIRS = ((0, 1), (4, 6), (7, 10), (12, 14), (17, 18), (0, 24))
ZIPF_S = 1.1
LATENT_DIM = 4
TARGET_CTR = 0.22


@dataclass
class World:
    """The planted click model drawn from `model_seed`."""

    values: list[np.ndarray]       # per categorical field: (card, 8) uint8 hex digits
    cdfs: list[np.ndarray]         # per categorical field: Zipf CDF over its values
    main: list[np.ndarray]         # per categorical field: (card,) main effect
    latent: dict                   # (pair index, side) -> (card, LATENT_DIM)
    int_params: np.ndarray         # (13, 6): mu, sigma, neg_rate, amp, center, width
    int_missing_effect: np.ndarray  # (13,)
    pair_gain: float
    bias: float = 0.0


def make_world(model_seed: int = 20140621) -> World:
    rng = np.random.default_rng(model_seed)
    values, cdfs, main = [], [], []
    sigmas = rng.choice([0.0, 0.15, 0.3, 0.45, 0.6], size=len(CARDINALITIES), p=[.2, .2, .2, .2, .2])
    for c, card in enumerate(CARDINALITIES):
        values.append(_hex_vocab(model_seed, c, card))
        w = np.arange(1, card + 1, dtype=np.float64) ** -ZIPF_S
        cdfs.append(np.cumsum(w) / w.sum())
        main.append(rng.normal(0.0, sigmas[c], size=card).astype(np.float32))
    latent = {}
    for p, (a, b) in enumerate(PAIRS):
        latent[p, 0] = rng.normal(0, 1, size=(CARDINALITIES[a], LATENT_DIM)).astype(np.float32)
        latent[p, 1] = rng.normal(0, 1, size=(CARDINALITIES[b], LATENT_DIM)).astype(np.float32)
    int_params = np.stack([
        rng.uniform(0.0, 3.0, 13),      # mu of log-normal
        rng.uniform(0.8, 2.2, 13),      # sigma of log-normal (heavy tails)
        np.where(np.arange(13) == 1, 0.05, 0.0),  # I2 takes small negative values
        rng.uniform(-0.5, 0.5, 13),     # amplitude of the curve
        rng.uniform(0.5, 4.0, 13),      # center in log1p space
        rng.uniform(0.5, 2.0, 13),      # width
    ], axis=1)
    world = World(values, cdfs, main, latent, int_params,
                  int_missing_effect=rng.normal(0, 0.2, 13).astype(np.float32),
                  pair_gain=0.35)
    world.bias = _solve_bias(world)
    return world


def _hex_vocab(model_seed: int, field_idx: int, card: int) -> np.ndarray:
    """(card, 8) ASCII hex digits: 32 pseudo-random bits per value, like Criteo's."""
    k = np.arange(card, dtype=np.uint64) | np.uint64(field_idx << 40)
    h = fmix64(k ^ np.uint64(model_seed)) & np.uint64(0xFFFFFFFF)
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    nib = ((h[:, None] >> shifts) & np.uint64(0xF)).astype(np.uint8)
    return np.frombuffer(b"0123456789abcdef", np.uint8)[nib]


def _draw(world: World, n: int, rng: np.random.Generator):
    """(labels, int columns with NaN missing, cat indices with -1 missing)."""
    cats = np.empty((n, len(CARDINALITIES)), dtype=np.int64)
    logit = np.full(n, world.bias, dtype=np.float64)
    for c, cdf in enumerate(world.cdfs):
        k = np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)
        miss = rng.random(n) < CAT_MISSING[c]
        logit += np.where(miss, 0.0, world.main[c][k])
        cats[:, c] = np.where(miss, -1, k)
    for p, (a, b) in enumerate(PAIRS):
        ka, kb = cats[:, a], cats[:, b]
        ok = (ka >= 0) & (kb >= 0)
        dot = np.einsum("ij,ij->i", world.latent[p, 0][np.maximum(ka, 0)],
                        world.latent[p, 1][np.maximum(kb, 0)])
        logit += np.where(ok, world.pair_gain * dot, 0.0)
    ints = np.empty((n, 13), dtype=np.float64)
    for j, (mu, sigma, neg, amp, center, width) in enumerate(world.int_params):
        x = np.floor(rng.lognormal(mu, sigma, n))
        x = np.where(rng.random(n) < neg, -rng.integers(1, 4, n), x)
        miss = rng.random(n) < INT_MISSING[j]
        curve = amp * np.tanh((np.log1p(np.maximum(x, 0)) - center) / width)
        logit += np.where(miss, world.int_missing_effect[j], curve)
        ints[:, j] = np.where(miss, np.nan, x)
    return logit, ints, cats


def _solve_bias(world: World) -> float:
    world.bias = 0.0
    logit, _, _ = _draw(world, 200_000, np.random.default_rng(12345))
    return ctr_shift(logit)


def ctr_shift(logit: np.ndarray, target: float = TARGET_CTR) -> float:
    """The constant that, added to every logit, makes the mean click probability `target` (bisection)."""
    lo, hi = -10.0, 10.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if (1 / (1 + np.exp(-(logit + mid)))).mean() > target:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def _table(world: World, labels, ints, cats) -> pa.Table:
    cols = {"label": pa.array(labels.astype(np.int8))}
    for j, name in enumerate(CRITEO_NUMERIC):
        x = ints[:, j]
        miss = np.isnan(x)
        cols[name] = pa.array(np.where(miss, 0, x).astype(np.int64), mask=miss)
    for c, name in enumerate(CRITEO_CATEGORICAL):
        k = cats[:, c]
        miss = k < 0
        raw = world.values[c][np.maximum(k, 0)].reshape(-1)
        offsets = np.arange(0, 8 * len(k) + 1, 8, dtype=np.int32)
        arr = pa.Array.from_buffers(pa.binary(), len(k), [None, pa.py_buffer(offsets), pa.py_buffer(raw)])
        cols[name] = pa.compute.if_else(pa.array(miss), pa.scalar(None, pa.binary()), arr)
    return pa.table(cols)


def output_file(path: str | os.PathLike) -> tuple[str, bool]:
    """(the path a generator writes, whether straight to it rather than through a temp file
    renamed over it). A symbolic link's target is written (the link stays); os.devnull is
    written straight. Anything else that is not a regular file (a device, a FIFO or a shell's
    `>(...)`, a socket, a directory) is refused: the rename made /dev/stdout, /dev/full or a
    device node a regular file, and left a named pipe's reader with nothing.

    >>> try:
    ...     output_file("/dev/zero")
    ... except MarianaError as e:
    ...     print(str(e)[:45])
    /dev/zero: is a device, not a regular file: a
    """
    import stat

    out = os.fspath(path)
    if not out:
        raise MarianaError("the output file name is empty: name the file to write")
    other = next((x for x in (".parquet", ".pq", ".bz2", ".xz", ".zst", ".zip") if out.lower().endswith(x)), None)
    if other or (out.lower().endswith(".gz") and not out.endswith(".gz")):
        raise MarianaError(f"{out}: a name ending in {other or out[-3:]}, but the generators write text (gzip for a "
                           "name ending in .gz): name the file .tsv or .tsv.gz")
    if out == os.devnull:
        return out, True
    try:
        mode = os.stat(out).st_mode  # through links: /dev/stdout, /dev/fd/63
    except FileNotFoundError:
        if os.path.islink(out):
            raise MarianaError(f"{out}: is a symbolic link to {os.readlink(out)!r}, which does not exist") from None
        return _in_writable_dir(out, path), False
    if stat.S_ISREG(mode):
        return _in_writable_dir(os.path.realpath(out), path), False
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (a named pipe, or a shell's >(...))"
            if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
    raise MarianaError(f"{out}: is {kind}, not a regular file: a generator writes a file (a temporary one renamed "
                       "over it); name a file")


def _in_writable_dir(out: str, named: str | os.PathLike) -> str:
    """`out`, when its directory exists and takes the temp file written beside it."""
    where = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(where):
        raise MarianaError(f"{os.fspath(named)}: directory {where} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise MarianaError(f"{os.fspath(named)}: directory {where} is not writable")
    return out


# Bytes a generated Criteo-format row takes at least, as text and gzipped (both generators
# write ~235 and ~80): what `output_stream` checks the free space against
ROW_BYTES, GZIP_ROW_BYTES = 200, 70


@contextmanager
def output_stream(path: str | os.PathLike, rows: int = 0) -> Iterator[tuple[pa.NativeFile, str]]:
    """(a stream to write a generator's rows to, the path they end up at), for the file
    `output_file` allows: gzip when the name ends in .gz; written to a temp file beside it that
    is renamed over it once the block ends without an exception, and removed if it does not.
    `rows` that cannot fit in the free space are refused first (`--rows 10000000000` wrote
    for hours before the disk was full)."""
    out, straight = output_file(path)
    check_room(out, rows, GZIP_ROW_BYTES if out.endswith(".gz") else ROW_BYTES)
    tmp = out if straight else f"{out}.tmp-{os.getpid()}"
    try:
        with (pa.CompressedOutputStream(tmp, "gzip") if out.endswith(".gz") else pa.OSFile(tmp, "wb")) as sink:
            yield sink, out
        if not straight:
            os.replace(tmp, out)
    except OSError as e:  # pyarrow's: "error writing bytes to file. detail: [errno 28] ..."
        raise MarianaError(f"{out}: cannot write it: {why(e)}") from None
    finally:
        if not straight and os.path.exists(tmp):
            os.unlink(tmp)


def check_room(out: str, rows: int, row_bytes: int) -> None:
    """MarianaError when `out`'s file system has less free space than `rows` of `row_bytes`."""
    least_bytes = rows * row_bytes
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))).free
    except OSError:
        return  # what cannot be asked is found by the write
    if least_bytes > free:
        raise MarianaError(f"{out}: {rows:,} rows take at least {_size(least_bytes)}, and its file system has "
                           f"{_size(free)} free: ask for fewer rows, or write elsewhere")


def _size(n: int) -> str:
    """Bytes as a person reads them.

    >>> _size(70 * 10**15), _size(4_000_000), _size(61_440)
    ('70,000,000.0 GB', '4.0 MB', '61 kB')
    """
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def check_rows(rows) -> None:
    """ValueError unless `rows` is an integer >= 0 (1.5 or True wrote what they were taken for)."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"rows must be an integer >= 0, got {rows!r}")


def generate_criteo(out: str | os.PathLike, rows: int, seed: int = 0, model_seed: int = 20140621,
                    chunk_rows: int = 200_000,
                    progress: Callable[[int, float], None] | None = None) -> dict:
    """Write `rows` rows of synthetic Criteo TSV to `out` (gzip if it ends in .gz).

    Returns {rows, positives, ctr, seconds, path}.
    """
    import pyarrow.compute  # noqa: F401  (binds pa.compute)

    check_rows(rows)
    world = make_world(model_seed)
    rng = np.random.default_rng([seed, model_seed])
    opts = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    t0, done, positives = time.perf_counter(), 0, 0
    with output_stream(out, rows) as (sink, out):
        while done < rows:
            n = min(chunk_rows, rows - done)
            logit, ints, cats = _draw(world, n, rng)
            labels = rng.random(n) < 1 / (1 + np.exp(-logit))
            pa_csv.write_csv(_table(world, labels, ints, cats), sink, opts)
            done += n
            positives += int(labels.sum())
            if progress:
                progress(done, time.perf_counter() - t0)
    return {"rows": done, "positives": positives, "ctr": positives / max(done, 1),
            "seconds": round(time.perf_counter() - t0, 3), "path": out}
