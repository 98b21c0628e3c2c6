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


def layer(module: str) -> str:
    """The top name an import reaches: `mariana.sparse.x` -> `sparse`, `zmq.asyncio` -> `zmq`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "mariana" and len(parts) > 1 else parts[0]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {layer(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(layer(node.module))
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
