"""How `mariana evaluate` shows a reliability table (sparse.metrics.BinaryMetrics.reliability):
as aligned text, and as a plot (`--plot FILE.png`: predicted vs observed CTR per bucket with
their 95% intervals and the diagonal, rows per bucket beneath). matplotlib is imported only
to draw, with the Agg canvas (no display, no pyplot state).
"""
from __future__ import annotations

import math
import os
import tempfile

from mariana.sparse.errors import MarianaError
from mariana.sparse.files import write_atomically

PLOT_FORMATS = (".png", ".svg", ".pdf")


def table_lines(table: list[dict]) -> list[str]:
    """The table as aligned text lines, a header first.

    >>> t = [{"score_min": .001, "score_max": .0123, "rows": 2000, "clicks": 9, "mean_pctr": .00612,
    ...       "ctr": .0045, "ctr_lo": .00237, "ctr_hi": .00853}]
    >>> print("\\n".join(table_lines(t)))
    pCTR range     rows  clicks  mean pCTR  observed CTR  95% interval
    0.001-0.0123  2,000       9   0.006120      0.004500  0.002370-0.008530
    """
    head = ("pCTR range", "rows", "clicks", "mean pCTR", "observed CTR", "95% interval")
    rows = [(f"{_g(b['score_min'])}-{_g(b['score_max'])}", f"{b['rows']:,}", f"{b['clicks']:,}",
             _f(b["mean_pctr"]), _f(b["ctr"]), f"{_f(b['ctr_lo'])}-{_f(b['ctr_hi'])}") for b in table]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = (True, False, False, False, False, True)  # text left, numbers right
    return ["  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(r, widths, left)).rstrip()
            for r in [head, *rows]]


def _g(x: float) -> str:
    return f"{x:.3g}"


def _f(x: float) -> str:
    """Six decimals: a 0.5% CTR keeps three significant digits, a 36% one six."""
    return f"{x:.6f}"


def check_plot_path(path: str) -> None:
    """Fail before any work when the plot could not be written (MarianaError naming why)."""
    if os.path.isdir(path):
        raise MarianaError(f"--plot {path}: is a directory")
    if os.path.splitext(path)[1].lower() not in PLOT_FORMATS:
        raise MarianaError(f"--plot {path}: name a .png, .svg or .pdf file (the format follows the name)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise MarianaError(f"--plot {path}: no such directory {folder}")
    try:  # what the plot will do: create a file there (os.access says yes to root on a read-only disk)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mariana-plot-"):
            pass
    except OSError as e:
        raise MarianaError(f"--plot {path}: cannot write in {folder} ({(e.strerror or str(e)).lower()})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise MarianaError(f"--plot {path}: not writable")


def plot(table: list[dict], path: str, title: str = "") -> None:
    """Write the reliability plot of `table` to `path` (its format by its name)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 6.4), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    pred = [b["mean_pctr"] for b in table]
    obs = [b["ctr"] for b in table]
    # the points and their intervals set the scale: a last bucket reaching pCTR 0.9 must
    # not squeeze a 0.5%-CTR model's points into the corner
    lim = 1.08 * max([*pred, *(b["ctr_hi"] for b in table), 1e-6])
    top.plot([0, lim], [0, lim], ls="--", lw=1, color="0.55", label="perfectly calibrated")
    top.errorbar(pred, obs, yerr=[[o - b["ctr_lo"] for o, b in zip(obs, table)],
                                  [b["ctr_hi"] - o for o, b in zip(obs, table)]],
                 fmt="o-", ms=4, lw=1.2, capsize=3, color="#2563eb", label="observed CTR, 95% interval")
    top.set(xlim=(0, lim), ylim=(0, lim), ylabel="observed CTR", title=title)
    top.legend(loc="upper left", frameon=False, fontsize=9)
    top.grid(alpha=0.3)
    # a histogram of the buckets' rows: each bar spans its bucket's pCTR range and its area
    # is its rows (equal-count buckets: narrow bars are tall where the scores crowd)
    unit = 10.0 ** (math.floor(math.log10(lim)) - 1)
    widths = [max(b["score_max"] - b["score_min"], lim / 250) for b in table]
    bottom.bar([b["score_min"] for b in table], [b["rows"] * unit / w for b, w in zip(table, widths)],
               width=widths, align="edge", color="#93c5fd", edgecolor="#2563eb", lw=0.6)
    bottom.set(xlabel="predicted CTR (pCTR)", ylabel=f"rows per {unit:g}")
    bottom.grid(alpha=0.3, axis="y")
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    write_atomically(path, lambda f: fig.savefig(f, format=fmt, dpi=120), binary=True)  # no 0-byte file on a full disk
