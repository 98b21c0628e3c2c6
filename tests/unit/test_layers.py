"""DESIGN.md's layers: the compute core opens no sockets; services never import serving."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IO = {"zmq", "redis", "aiohttp", "msgpack", "asyncio", "socket"}
RULES = {
    "sparse": IO | {"trainer", "services", "serving", "featurizer"},
    "featurizer": IO | {"trainer", "services", "serving"},
    "trainer": IO | {"services", "serving"},
    "services": {"serving"},
}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(RULES))
def test_imports_point_down(package):
    bad = {}
    for path in (ROOT / package).rglob("*.py"):
        wrong = imports(path) & RULES[package]
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"layer rule broken (DESIGN.md): {bad}"


def test_no_pickle_anywhere():
    for package in ("sparse", "featurizer", "trainer", "services", "serving"):
        for path in (ROOT / package).rglob("*.py"):
            assert not imports(path) & {"pickle", "cloudpickle", "dill"}, path
            text = path.read_text()
            assert "allow_pickle=True" not in text and "recv_pyobj" not in text, path
