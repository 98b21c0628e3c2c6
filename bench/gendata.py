"""Generated data files shared by the benchmarks: made once with
`mariana gen criteo`, reused while they have the asked-for number of rows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
    return n


def synthetic_file(out_dir: Path, kind: str, rows: int, seed: int, note=lambda message: None) -> Path:
    """`<kind>_<rows>.tsv` from `mariana gen criteo`, reused if it has `rows` lines."""
    path = out_dir / f"{kind}_{rows}.tsv"
    if path.exists() and count_lines(path) == rows:
        return path
    note(f"generating {path.name} ({rows:,} rows, seed {seed})")
    partial = path.with_suffix(".partial.tsv")
    subprocess.run([sys.executable, "-m", "mariana.services.cli", "-q", "gen", "criteo", "--rows", str(rows),
                    "--seed", str(seed), "--out", str(partial)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    partial.replace(path)
    return path
