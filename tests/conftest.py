"""Shared fixtures: real data locations, small generated files, the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """../shared/data beside the checkout, or $MARIANA_DATA."""
    return Path(os.environ.get("MARIANA_DATA") or ROOT.parent / "shared" / "data")


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    path = data_dir() / "criteo" / "criteo_1tb_sample1000.tsv.gz"
    if not path.exists():
        pytest.skip(f"real Criteo sample not found at {path} (set MARIANA_DATA to the shared data dir)")
    return path


@pytest.fixture(scope="session")
def gen_files(tmp_path_factory) -> dict[str, Path]:
    """A small planted-model train/test pair, generated once per session."""
    from mariana.sparse.synth import generate_criteo

    d = tmp_path_factory.mktemp("gen")
    generate_criteo(d / "train.tsv", 30_000, seed=1)
    generate_criteo(d / "test.tsv", 8_000, seed=2)
    return {"train": d / "train.tsv", "test": d / "test.tsv"}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port, for a module's tests."""
    from mariana.services.launcher import RedisServer, free_port

    server = RedisServer("127.0.0.1", free_port(), str(tmp_path_factory.mktemp("redis"))).start()
    try:
        server.wait_ready(10.0)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    d = data_dir() / "mnist"
    from mariana.featurizer.image import MNIST_IMAGES

    if not (d / MNIST_IMAGES).exists():
        pytest.skip(f"MNIST not found at {d} (set MARIANA_DATA to the shared data dir)")
    return d


@pytest.fixture(scope="session")
def small_featurizer(mnist_dir, tmp_path_factory) -> Path:
    """A featurizer trained in ~2 s (1 epoch on 2,000 images): tests need determinism, not accuracy."""
    from mariana.featurizer.image import load_mnist
    from mariana.trainer.featurizer_train import FeaturizerTrainConfig, train_and_export

    out = tmp_path_factory.mktemp("featurizer") / "f"
    report = train_and_export(load_mnist(mnist_dir), out, FeaturizerTrainConfig(epochs=1, train_limit=2000,
                                                                                batch_size=128))
    assert report["test_accuracy"] > 0.5
    return out


def reseal(vdir: Path) -> None:
    """Record a version's manifest and files as they are now (`sparse.files.digests`): a test
    that damages a version on purpose to reach a check behind the digests (shapes, values)
    makes it look written so, as a writer with a bug would leave it."""
    from mariana.sparse.files import DIGESTS, file_digests, manifest_sha256

    path = Path(vdir) / "manifest.json"
    manifest = json.loads(path.read_text())
    if isinstance(manifest, dict):
        files = tuple(f for f in ("weights.safetensors", "optimizer.safetensors") if (Path(vdir) / f).is_file())
        manifest[DIGESTS] = {**file_digests(vdir, files), "manifest": manifest_sha256(manifest)}
        path.write_text(json.dumps(manifest))


def run_cli(*args: str, check: bool = False, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`mariana ARGS` in a real subprocess (`python -m mariana`: the whole CLI, as the installed script),
    in `cwd` (default: the checkout)."""
    proc = subprocess.run([sys.executable, "-m", "mariana", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT, env={**os.environ, **(env or {})},
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"mariana {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


_CASES = r"""
import contextlib, io, json, sys, traceback
from mariana.cli import main
out = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def run_cli_cases(cases: list[list], env: dict | None = None) -> list[tuple[int, str]]:
    """Several `mariana ARGS` in one real subprocess, one after another, as `main(ARGS)`:
    each one's (exit code, stderr). For bad input, which stops before any work: torch and the
    CLI are imported once rather than once a case (2-3 s each on a 2-core VM)."""
    proc = subprocess.run([sys.executable, "-c", _CASES], input=json.dumps([[str(a) for a in c] for c in cases]),
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [(code, err) for code, err in json.loads(proc.stdout)]


SOAK_ARGS = ("--minutes", "2", "--rate", "100", "--promote-every", "20", "--retrain-every", "60")


@pytest.fixture(scope="session", autouse=True)
def background_soak(request, tmp_path_factory):
    """bench/soak.py's 2-minute version (tests/integration/test_soak.py), started when the
    session starts and run beside the other tests: it waits on the wall clock, not on the
    CPU, and two minutes of the suite's 15 are too many to spend waiting. (None when
    test_soak.py is not selected.) Yields (its output dir, its log); the soak writes
    `exit_code` there when it ends.

    Under pytest-xdist every worker runs this fixture and none knows which of them will get
    test_soak.py: the first to claim the run's shared temp dir starts the one soak, and waits
    for it at its own end (another worker's test may still read it)."""
    if not any(item.nodeid.startswith("tests/integration/test_soak.py") for item in request.session.items):
        yield None
        return
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by this run's workers
    out = root / "soak"
    try:
        os.close(os.open(root / "soak.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        yield out, out / "soak.log"  # another worker started it
        return
    out.mkdir()
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), *SOAK_ARGS, "--out", str(out)]
    started = time.monotonic()
    with open(out / "soak.log", "wb") as log:
        proc = subprocess.Popen(["sh", "-c", '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', str(out / "exit_code"),
                                 *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield out, out / "soak.log"
    finally:
        try:  # as long as test_soak.py waits for it, counted from its start
            proc.wait(timeout=max(0.0, started + 400 - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
