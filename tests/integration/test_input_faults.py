"""The input faults of tests/unit/test_input_faults.py through the CLI: a pipe is one
line of error before any read, and a run's record counts the malformed rows of its
training part only."""
from __future__ import annotations

import json

from tests.conftest import run_cli, run_cli_cases


def criteo_rows(n: int) -> list[str]:
    """`n` well-formed Criteo rows: label, I1..I13, C1..C26."""
    return ["\t".join([str(int(i % 3 == 0)), *[str(i + k) for k in range(13)],
                       *[f"{i * 31 + k:08x}" for k in range(26)]]) for i in range(n)]


def test_a_pipe_is_a_one_line_error_for_every_command_that_reads_data(tmp_path):
    # run_cli_cases feeds its cases on stdin: /dev/stdin is a pipe there, as in `cat f | mariana ...`.
    out = str(tmp_path / "m")
    cases = [["train", "--data", "/dev/stdin", "--out", out],
             ["tune", "--data", "/dev/stdin", "--out", out, "--budget", "1"],
             ["evaluate", "--model", out, "--data", "/dev/stdin"], ["predict", "--model", out, "--data", "/dev/stdin"]]
    for case, (code, err) in zip(cases, run_cli_cases(cases)):
        assert code == 2 and "Traceback" not in err, (case, err)
        assert err.strip().splitlines()[-1] == (
            "mariana: error: /dev/stdin is a pipe, not a file: Mariana reads its data more than once "
            "(a probe, then the pass); write it to a file first"), (case, err)


def test_malformed_rows_of_the_validation_tail_are_not_the_training_parts(tmp_path):
    path = tmp_path / "endbad.tsv"
    path.write_text("".join(f"{line}\n" for line in criteo_rows(195) + ["garbage"] * 5))
    proc = run_cli("train", "--data", path, "--valid-fraction", "0.1", "--out", tmp_path / "m", "--bits", "16",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["bad_rows"] == 0 and record["train_rows"] == 180 and record["valid"]["rows"] == 15
    assert "malformed training rows" not in proc.stderr
    assert "skipped 5 malformed validation rows" in proc.stderr
