"""How the CLIs print a record, a table and a model dir's versions: shared by the pipeline's
commands (services/cli.py) and serving's (serving/cli.py)."""
from __future__ import annotations

import json
import math


def json_safe(value):
    """`value` with every NaN or infinity, at any depth, as None: they are not JSON, and a
    browser's JSON.parse refuses the whole document for one (a diverged job's loss).

    >>> json_safe({"loss": float("nan"), "points": [[1.0, float("inf")]], "n": 3})
    {'loss': None, 'points': [[1.0, None]], 'n': 3}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value) -> str:
    """JSON text of `value`, non-finite numbers as null (see `json_safe`)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere: the rare case walks the whole value
        return json.dumps(json_safe(value), allow_nan=False)


def print_record(record: dict, as_json: bool) -> None:
    if as_json:  # NaN is not JSON: report it as null
        print(dumps(record))
        return
    table = record.get("reliability")
    lines = list(human_lines({k: v for k, v in record.items() if k != "reliability"}))
    width = max((len(k) for k, _ in lines), default=0)
    for key, text in lines:
        print(f"{key:>{width}}: {text}")
    if table:
        from mariana.services.runtime import reliability

        what = "1 bucket" if len(table) == 1 else f"{len(table)} buckets of about equal rows"
        print(f"\nreliability ({what}, by pCTR):")
        for line in reliability.table_lines(table):
            print(f"  {line}")


def human_lines(record: dict, prefix: str = ""):
    """(key, text) per line: a nested table gets dotted keys, a table of plain values one
    line ("read 0.484, parse 1.21"), a list its items, a list of tables one line per table
    ("valid.epochs[2]: ..."), nothing a Python repr."""
    for key, value in record.items():
        if isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
            yield from human_lines(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value, 1):
                yield f"{prefix}{key}[{i}]", human(item)
        else:
            yield f"{prefix}{key}", human(value)


def human(value) -> str:
    """
    >>> human({"read": 0.4841, "parse": 1.2}), human([0.5, 2]), human(None), human(True)
    ('read 0.4841, parse 1.2', '0.5, 2', 'n/a', 'yes')
    >>> human([["conv1", "pool1"], ["conv2", "head"]]), human(3024940.0)  # a list of lists: its parts apart
    ('conv1, pool1 | conv2, head', '3,024,940')
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:,.0f}" if 1e6 <= abs(value) < 1e18 else f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {human(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return (" | " if any(isinstance(v, (list, tuple)) for v in value) else ", ").join(map(human, value)) or "none"
    return str(value)


def print_versions(model_dir: str, current: str | None, versions: list[dict], most: int | None = None,
                   total: int | None = None) -> None:
    """The versions of a model dir, newest first, as `status` and `model list` show them;
    `versions`: dicts of version, current, model, created, auc, logloss, rows, job; `total`:
    how many the dir holds, when `versions` are only the newest of them."""
    print(f"models in {model_dir} (serving {current or 'nothing'})")
    newest = sorted(versions, key=lambda v: int(v["version"][1:]), reverse=True)  # names match v\d{6,}
    print_table(("", "VERSION", "MODEL", "CREATED", "AUC", "LOGLOSS", "ROWS", "JOB"),
                [("*" if v.get("current") else "", v["version"], v.get("model"), v.get("created"),
                  num(v.get("auc")), num(v.get("logloss")), count(v.get("rows")), v.get("job") or v.get("error"))
                 for v in newest[:most]])
    shown, older = len(newest[:most]), max(total or 0, len(newest))
    if older > shown:  # (it counted only the 50 versions /v1/models lists: "and 40 older" of 210)
        print(f"  ... and {older - shown} older (mariana model list --model-dir {model_dir})")


def print_table(header: tuple, rows: list[tuple]) -> None:
    cells = [tuple("-" if c is None else str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def num(x) -> str | None:
    return f"{x:.4f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def count(n) -> str | None:
    """12345.6 -> '12,346'; None stays None (shown as '-')."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return f"{n:,.0f}"
    return None if n is None else str(n)
