"""The wheel installs one top-level package, `mariana`, and lives beside pydata's `sparse` (issue 16).

Built and installed for real: `pip wheel` from this checkout, a fresh venv, `pip install`. The
fresh venv borrows the project venv's site-packages (numpy, pyarrow, torch, ...) through a
.pth line instead of downloading them again; a .pth line is a plain path, so the project's
editable install (its own .pth finder) does not come with it.
"""
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: setuptools' build/ keeps modules deleted since the last build and would ship them
    source = out / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "bench-out", "demo-out", "test-artifacts",
        ".pytest_cache", ".hypothesis"))
    done = pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source),
               cwd=out)
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("mariana-*.whl")
    return path


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, wheel) -> tuple[Path, Path, set[str]]:
    """(python, site-packages, names there before mariana) of a new venv with the wheel installed."""
    root = tmp_path_factory.mktemp("venv")
    venv.create(root / "v", with_pip=True)
    python = root / "v" / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    (site / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    before = {p.name for p in site.iterdir()}
    done = pip(python, "install", "--no-deps", "-q", str(wheel), cwd=root)
    assert done.returncode == 0, done.stderr
    return python, site, before


def test_the_wheel_holds_one_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith((".dist-info", ".data"))} == {"mariana"}, sorted(top)
    for module in ("mariana/__init__.py", "mariana/sparse/hashing.py", "mariana/trainer/models/lr.py",
                   "mariana/services/coordinator.py", "mariana/services/runtime/config.py",
                   "mariana/serving/app.py", "mariana/featurizer/image.py", "mariana/services/ui/index.html"):
        assert module in names, module


def test_install_adds_mariana_and_its_dist_info_only(fresh):
    python, site, before = fresh
    added = {p.name for p in site.iterdir()} - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"mariana"}, sorted(added)
    where = subprocess.check_output([str(python), "-c", "import mariana.sparse.hashing as h; print(h.__file__)"],
                                    text=True, cwd=site.parent).strip()
    assert where == str(site / "mariana" / "sparse" / "hashing.py")


def test_pydata_sparse_installs_beside_it(fresh):
    python, site, _ = fresh
    done = pip(python, "install", "-q", "sparse", cwd=site.parent)
    if done.returncode != 0 and "No matching distribution" in done.stderr + done.stdout:
        pytest.skip(f"pydata's sparse is not on this machine's package index: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    code = ("import numpy, sparse, mariana.sparse.hashing as h\n"
            "x = sparse.COO.from_numpy(numpy.eye(3))\n"
            "print(x.nnz, sparse.__file__, h.__file__)")
    nnz, theirs, ours = subprocess.check_output([str(python), "-c", code], text=True, cwd=site.parent).split()
    assert nnz == "3"
    assert theirs == str(site / "sparse" / "__init__.py") and ours == str(site / "mariana" / "sparse" / "hashing.py")
