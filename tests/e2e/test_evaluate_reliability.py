"""`mariana evaluate`'s reliability table and `--plot`, as real subprocesses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mariana.services.runtime import reliability
from mariana.sparse.metrics import BinaryMetrics
from tests.conftest import ROOT, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model(gen_files, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rel") / "m"
    run_cli("train", "--data", gen_files["train"], "--model", "lr", "--out", out, "--bits", "16", "-q", check=True)
    return out


def test_evaluate_prints_the_table_and_json_carries_it(model, gen_files):
    proc = run_cli("evaluate", "--model", model, "--data", gen_files["test"], check=True)
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "observed CTR" in line)
    assert "pCTR range" in lines[head] and "95% interval" in lines[head]
    assert len([line for line in lines[head + 1:] if line.strip()]) == 10
    assert any(line.strip().startswith("ece:") for line in lines[:head])

    rec = json.loads(run_cli("evaluate", "--model", model, "--data", gen_files["test"], "--json",
                             check=True).stdout.strip().splitlines()[-1])
    table = rec["reliability"]
    assert len(table) == 10 and sum(b["rows"] for b in table) == rec["rows"] == 8_000
    assert rec["ece"] == pytest.approx(sum(b["rows"] * abs(b["mean_pctr"] - b["ctr"]) for b in table) / 8_000)
    assert "plot" not in rec


def test_plot_writes_a_png(model, gen_files, tmp_path):
    out = tmp_path / "rel.png"
    rec = json.loads(run_cli("evaluate", "--model", model, "--data", gen_files["test"], "--json", "--plot", out,
                             check=True).stdout.strip().splitlines()[-1])
    assert rec["plot"] == str(out) and out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_plot_of_rows_without_a_click(model, gen_files, tmp_path):
    """1,000 rows and no click: 100 rows a bucket, whose Wilson interval's lower end rounded to
    3.5e-18, above the observed 0: matplotlib refused the negative error bar (a traceback)."""
    rows = [line.split("\t", 1) for line in gen_files["test"].read_text().splitlines()[:1000]]
    data = tmp_path / "no-clicks.tsv"
    data.write_text("".join(f"0\t{rest}\n" for _, rest in rows))
    out = tmp_path / "rel.png"
    rec = json.loads(run_cli("evaluate", "--model", model, "--data", data, "--json", "--plot", out,
                             check=True).stdout.strip().splitlines()[-1])
    assert out.read_bytes()[:8] == PNG
    assert all(b["ctr_lo"] == b["ctr"] == 0 for b in rec["reliability"]), rec["reliability"]


def unwritable_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d if not os.access(d, os.W_OK) else Path("/proc")  # root writes anywhere but /proc


@pytest.mark.parametrize("where, says", [
    ("missing/rel.png", "no such directory"),
    ("unwritable", "cannot write in"),
    ("rel.jpg", "name a .png, .svg or .pdf file"),
    (".", "is a directory"),
])
def test_a_bad_plot_path_fails_before_evaluating(tmp_path, where, says):
    path = unwritable_dir(tmp_path) / "rel.png" if where == "unwritable" else tmp_path / where
    # no such model nor data: the plot path is checked first, so its error is the one shown
    proc = run_cli("evaluate", "--model", tmp_path / "nomodel", "--data", tmp_path / "no.tsv", "--plot", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mariana: error: --plot ") and says in last, proc.stderr


def test_evaluate_without_plot_imports_neither_matplotlib_nor_scipy(model, gen_files):
    """Each costs a command ~0.1-0.2 s of start-up (scipy: only a server's few-row sigmoid uses it)."""
    code = ("import sys; from services.cli import main; "
            f"rc = main(['evaluate', '--model', {str(model)!r}, '--data', {str(gen_files['test'])!r}, '-q']); "
            "assert rc == 0; assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
            "assert 'scipy' not in sys.modules, 'scipy imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_plot_of_a_half_percent_ctr_predictor(tmp_path):
    """A 0.5%-CTR log: ten buckets with points spread over the plot, not one in its corner."""
    rng = np.random.default_rng(1)
    p = rng.beta(1, 199, 200_000)
    m = BinaryMetrics()
    m.update((rng.random(p.size) < p).astype(np.int64), p)
    table = m.reliability()
    assert len(table) == 10
    reliability.plot(table, str(tmp_path / "low.png"), "0.5% CTR")
    reliability.plot(table, str(tmp_path / "low.svg"))
    assert (tmp_path / "low.png").read_bytes()[:8] == PNG and b"<svg" in (tmp_path / "low.svg").read_bytes()
