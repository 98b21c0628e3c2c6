"""`mariana train speech` and speech `predict` / `evaluate` on what users get wrong, as real
processes on tiny archives cut from the real FSDD: every mistake is refused before any
training with one line and exit code 2, a lost rank is one line, and --data, --skip-bad and
--format mean for wav files what they mean for rows."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from mariana.trainer import checkpoint
from tests.conftest import _CASES, ROOT, data_dir, run_cli
from tests.integration.rankkill import children, wait_for_rank

FSDD = data_dir() / "fsdd" / "fsdd_recordings.tar.gz"
SPEAKERS = ("jackson", "theo")


def cut(out: Path, keep) -> Path:
    """The real archive's recordings `keep(digit, speaker, index)` picks, as a new .tar.gz."""
    with tarfile.open(FSDD) as src, tarfile.open(out, "w:gz") as dst:
        for member in src:
            name = os.path.basename(member.name)
            if member.isfile() and name.endswith(".wav"):
                digit, speaker, index = name[:-4].split("_")
                if keep(int(digit), speaker, int(index)):
                    dst.addfile(member, src.extractfile(member))
    return out


@pytest.fixture(scope="module")
def fsdd(tmp_path_factory) -> dict[str, Path]:
    """Tiny archives: both parts of the official split (80 recordings), only its test part (0-4),
    only its training part (5+), and one speaker alone; each in a directory of its own, as
    `--data DIR` takes it."""
    if not FSDD.exists():
        pytest.skip(f"FSDD not found at {FSDD} (set MARIANA_DATA to the shared data dir)")
    d = tmp_path_factory.mktemp("fsdd")
    picks = {"both": lambda g, s, i: s in SPEAKERS and i in (0, 1, 5, 6),
             "test_part": lambda g, s, i: s in SPEAKERS and i in (0, 1),
             "train_part": lambda g, s, i: s in SPEAKERS and i in (5, 6),
             "theo": lambda g, s, i: s == "theo" and i in (5, 6)}
    out = {}
    for name, keep in picks.items():
        (d / name).mkdir()
        out[name] = cut(d / name / "fsdd_recordings.tar.gz", keep).parent
    return out


def cases_in(cwd: Path, cases: list[list], env: dict) -> list[tuple[int, str]]:
    """tests/conftest.run_cli_cases in `cwd`: each case's (exit code, stderr), one process for all."""
    proc = subprocess.run([sys.executable, "-c", _CASES], input=json.dumps([[str(a) for a in c] for c in cases]),
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return [(code, err) for code, err in json.loads(proc.stdout)]


def assert_one_line(code: int, stderr: str, *needles: str) -> None:
    """Exit 2 and one `mariana: error:` line (nothing trained first), naming what was wrong."""
    assert code == 2, (code, stderr)
    assert "Traceback" not in stderr and "speech epoch" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mariana: error: ")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr
    for n in needles:
        assert n in errors[0], stderr


@pytest.fixture(scope="module")
def model(fsdd, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "m"
    run_cli("train", "speech", "--data", fsdd["both"], "--epochs", "1", "--out", out,
            env={"MARIANA_CACHE": str(out.parent / "cache")}, check=True)
    return out


def test_train_refuses_a_bad_out_before_training(fsdd, tmp_path):
    """--out is checked as `mariana train` checks it, before any epoch: the job trained every
    epoch, then failed to publish into a file ("cannot write a new version: File exists"), and
    `--out ''` wrote its version into the working directory."""
    (tmp_path / "afile").write_text("hi\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "day1.tsv").write_text("1\t2\n")
    both = ["train", "speech", "--data", fsdd["both"], "--epochs", "1"]
    runs = cases_in(tmp_path, [[*both, "--out", "afile"], [*both, "--nproc", "2", "--out", "afile"],
                               [*both, "--out", ""], [*both, "--out", "data"], [*both, "--out", "/proc/m"]],
                    {"MARIANA_CACHE": str(tmp_path / "cache")})
    for run in runs[:2]:
        assert_one_line(*run, "afile: exists and is not a directory")
    assert "rank" not in runs[1][1]  # found before any rank started
    assert runs[2][0] == 2 and runs[2][1].strip().startswith(
        "mariana train speech: error: --out is empty: give it a value, or leave the option out"), runs[2]
    assert_one_line(*runs[3], "data: holds 1 other files (day1.tsv) and no model")
    assert_one_line(*runs[4], "(--out) /proc/m: cannot create a directory in /proc (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "data"], list(tmp_path.iterdir())


def test_train_refuses_a_split_with_an_empty_part_before_training(fsdd, tmp_path):
    """No training recordings was a std() warning and a ZeroDivisionError traceback (exit 1;
    with --nproc 2 one per rank); no test recordings published a version of accuracy 0.0
    measured on nothing."""
    train = ["train", "speech", "--epochs", "1"]
    runs = cases_in(tmp_path, [[*train, "--data", fsdd["test_part"], "--out", "m0"],
                               [*train, "--data", fsdd["test_part"], "--nproc", "2", "--out", "m1"],
                               [*train, "--data", fsdd["theo"], "--split", "speaker:theo", "--out", "m2"],
                               [*train, "--data", fsdd["train_part"], "--out", "m3"]],
                    {"MARIANA_CACHE": str(tmp_path / "cache")})
    for run in runs[:2]:
        assert_one_line(*run, "--split official leaves no recordings to train on in ",
                        "all 40 are held out (each has recording index 0-4")
    assert "rank" not in runs[1][1]  # found before any rank started
    assert_one_line(*runs[2], "--split speaker:theo leaves no recordings to train on",
                    "the archive holds only theo's recordings")
    assert_one_line(*runs[3], "--split official leaves no recordings to test on",
                    "none has recording index 0-4")
    assert not [p for p in tmp_path.iterdir() if p.name != "cache"]


def test_train_names_the_flag_of_a_bad_timeout_or_thread_count(fsdd, tmp_path):
    train = ["train", "speech", "--data", fsdd["both"], "--out", "m"]
    runs = cases_in(tmp_path, [[*train, "--timeout", "0"], [*train, "--threads", "-1"], [*train, "--lr", "-1"]], {})
    # the wording of every multi-rank mode (train image's too: dp.check_rank_flags)
    assert_one_line(*runs[0], "speech: --timeout 0: must be a number of seconds > 0")
    assert_one_line(*runs[1], "speech: --threads -1: must be >= 0")
    assert_one_line(*runs[2], "speech: --lr must be a positive number, got -1.0")  # said "dense.lr"
    assert "timeout_s" not in runs[0][1]


def test_a_killed_rank_is_one_line_naming_it(fsdd, tmp_path):
    """Rank 0's failed collective was a long `rank 0 of 2: RuntimeError: ... gloo ... GLHF!` line
    (and C++'s "terminate called ...") before the launcher's line: now only that line."""
    parent = subprocess.Popen([sys.executable, "-m", "mariana", "train", "speech", "--data", str(fsdd["both"]),
                               "--nproc", "2", "--epochs", "100000", "--batch-size", "64", "--timeout", "30",
                               "--out", str(tmp_path / "k")], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MARIANA_CACHE": str(tmp_path / "cache")})
    try:
        seen = []
        for line in parent.stderr:  # until rank 0 reports an epoch: both ranks are in their steps
            seen.append(line)
            if "speech epoch 1/" in line:
                break
        os.kill(wait_for_rank(parent.pid, 1), signal.SIGKILL)
        t0 = time.monotonic()
        rest = parent.stderr.read()
        parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stderr.close()
    stderr = "".join(seen) + rest
    assert parent.returncode == 2 and time.monotonic() - t0 < 40, stderr
    assert rest.strip().splitlines()[-1] == ("mariana: error: rank 1 of 2 was killed by SIGKILL; the job failed "
                                             "(the other ranks were stopped)"), stderr
    assert "mariana: error:" not in "".join(rest.strip().splitlines(True)[:-1]), stderr
    assert "RuntimeError" not in stderr and "GLHF" not in stderr and "terminate called" not in stderr, stderr
    assert not children(parent.pid) and not (tmp_path / "k" / "CURRENT").exists()


def wavs(tmp_path: Path) -> tuple[list[Path], Path]:
    """Two real recordings of 7 (wavs/7_theo_*.wav), one of 3, and bad/trunc.wav cut short."""
    (tmp_path / "wavs").mkdir()
    (tmp_path / "bad").mkdir()
    good = []
    with tarfile.open(FSDD) as tar:
        for name in ("7_theo_10", "7_theo_11", "3_jackson_10"):
            good.append(tmp_path / "wavs" / f"{name}.wav")
            good[-1].write_bytes(tar.extractfile(f"recordings/{name}.wav").read())
    trunc = tmp_path / "bad" / "trunc.wav"
    trunc.write_bytes(good[0].read_bytes()[:2000])
    return good, trunc


def test_predict_expands_globs_and_directories_and_skip_bad_skips(model, tmp_path):
    """A glob or a directory was "no such file"; --skip-bad still printed `FILE<TAB>nan`; the
    error named the file twice ("bad/trunc.wav: bad/trunc.wav: truncated ...")."""
    good, trunc = wavs(tmp_path)
    text = run_cli("predict", "--model", model, "--data", "wavs/7_*.wav,bad", "--skip-bad", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert [line.split("\t")[0] for line in text.stdout.splitlines()] == ["wavs/7_theo_10.wav", "wavs/7_theo_11.wav"]
    assert all(len(line.split("\t")) == 3 for line in text.stdout.splitlines()), text.stdout
    assert "mariana: 1 file(s) skipped (bad/trunc.wav: truncated (" in text.stderr, text.stderr
    js = run_cli("predict", "--model", model, "--data", "wavs,bad", "--json", cwd=tmp_path)
    lines = [json.loads(line) for line in js.stdout.splitlines()]
    assert js.returncode == 2 and [x["file"] for x in lines] == [f"wavs/{p.name}" for p in sorted(good)] + \
        ["bad/trunc.wav"], js.stdout
    assert lines[-1]["error"].startswith("bad/trunc.wav: truncated (") and lines[-1]["error"].count("trunc.wav") == 1
    assert "mariana: 1 file(s) could not be read (bad/trunc.wav: truncated (" in js.stderr, js.stderr


def test_predict_and_evaluate_refuse_empty_data_and_row_flags(model, fsdd, tmp_path):
    """`--data ''` printed nothing with exit 0, and --format (rows' format) was taken silently."""
    runs = cases_in(tmp_path, [["predict", "--model", model, "--data", ""],
                               ["predict", "--model", model, "--data", "none/*.wav"],
                               ["predict", "--model", model, "--data", fsdd["both"], "--format", "csv"],
                               ["evaluate", "--model", model, "--data", fsdd["both"], "--format", "csv"]], {})
    assert runs[0][0] == 2 and runs[0][1].strip().startswith(
        "mariana predict: error: --data is empty: give it a value, or leave the option out"), runs[0]
    assert_one_line(*runs[1], "none/*.wav: the pattern matches no files")
    for run in runs[2:]:
        assert_one_line(*run, "--format is for a click model's rows", "holds a speech model, which reads wav files")


def test_a_diverged_run_publishes_nothing_and_current_stays(model, fsdd, tmp_path):
    """--lr 1e8: the weights went NaN, and the version was published and made CURRENT, exit 0
    (evaluate and predict then refused it as corrupt)."""
    m = tmp_path / "m"
    shutil.copytree(model, m)
    code, err = cases_in(tmp_path, [["train", "speech", "--data", fsdd["both"], "--epochs", "1", "--batch-size", "64",
                                     "--lr", "1e8", "--out", m]], {"MARIANA_CACHE": str(model.parent / "cache")})[0]
    assert code == 2 and "nothing was published: the trained weights hold NaN or infinite values" in err, err
    assert "CURRENT still names v000001" in err and (m / "CURRENT").read_text().strip() == "v000001"
    assert checkpoint.list_versions(m) == ["v000001"]


def test_evaluate_refuses_a_split_that_holds_out_what_the_model_learned(model, fsdd, tmp_path):
    """Trained with --split official, evaluated with --split speaker:theo: theo's recordings
    5+ were learned, and were scored as held out (0.986 against a held-out 0.963), silently."""
    env = {"MARIANA_CACHE": str(model.parent / "cache")}
    runs = cases_in(tmp_path, [["evaluate", "--model", model, "--data", fsdd["both"], "--split", "speaker:theo"],
                               ["evaluate", "--model", model, "--data", fsdd["both"], "--split", "official", "--json"],
                               ["evaluate", "--model", model, "--data", fsdd["theo"], "--split", "speaker:theo"]],
                    env)
    assert_one_line(*runs[0], "--split speaker:theo: 20 of its 40 held-out recordings are ones this model was "
                              "trained on (it was trained with --split official)")
    assert runs[1][0] == 0, runs[1]
    # the same recordings in another archive (a subset of it): they passed, the archives' sha256 differing
    assert_one_line(*runs[2], "--split speaker:theo: 20 of its 20 held-out recordings are ones this model was")
    # and packed again with other paths (`tar czf x.tgz .` writes ./recordings/..., or the files at the top)
    repacked = []
    for prefix in ("./recordings/", ""):
        out = tmp_path / f"theo-{len(repacked)}" / "fsdd_recordings.tar.gz"
        out.parent.mkdir()
        with tarfile.open(fsdd["theo"] / "fsdd_recordings.tar.gz") as src, tarfile.open(out, "w:gz") as dst:
            for member in src.getmembers():
                if member.isfile():
                    raw = src.extractfile(member).read()
                    member.name = prefix + member.name.rsplit("/", 1)[-1]
                    dst.addfile(member, __import__("io").BytesIO(raw))
        repacked.append(["evaluate", "--model", model, "--data", out.parent, "--split", "speaker:theo"])
    for run in cases_in(tmp_path, repacked, env):
        assert_one_line(*run, "--split speaker:theo: 20 of its 20 held-out recordings are ones this model was")
