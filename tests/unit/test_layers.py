"""DESIGN.md's layers: the compute core opens no sockets; services never import serving."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IO = {"zmq", "redis", "aiohttp", "msgpack", "asyncio", "socket"}
TOP = {"mariana", "api", "cli"}  # the package's own modules (mariana/): above every layer
RULES = {
    "sparse": IO | TOP | {"trainer", "services", "serving", "featurizer"},
    "featurizer": IO | TOP | {"trainer", "services", "serving"},
    "trainer": IO | TOP | {"services", "serving"},
    "services": TOP | {"serving"},
    "serving": TOP,
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


def full_imports(path: Path) -> set[str]:
    """Every module path `path` imports (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_serving_reaches_services_runtime_only():
    """Serving shares the runtime (config, logs, metrics, model events, the cluster client),
    not the pipeline's services: it must run on a host that runs none of them."""
    bad = {}
    for path in (ROOT / "serving").rglob("*.py"):
        wrong = sorted(m for m in full_imports(path)
                       if m.startswith("mariana.services.") and not m.startswith("mariana.services.runtime."))
        if wrong:
            bad[str(path.relative_to(ROOT))] = wrong
    assert not bad, f"serving imports services beyond services/runtime: {bad}"


def test_the_layer_walk_sees_imports():
    """The rules above would pass vacuously if the walk found nothing."""
    assert {"numpy", "sparse"} <= imports(ROOT / "trainer" / "bundle.py")
    assert "mariana.services.runtime.report.print_record" not in full_imports(ROOT / "serving" / "cli.py")
    assert "mariana.services.runtime.report" in full_imports(ROOT / "serving" / "cli.py")


def test_no_pickle_anywhere():
    for package in ("sparse", "featurizer", "trainer", "services", "serving"):
        for path in (ROOT / package).rglob("*.py"):
            assert not imports(path) & {"pickle", "cloudpickle", "dill"}, path
            text = path.read_text()
            assert "allow_pickle=True" not in text and "recv_pyobj" not in text, path


def torch_after_import(*modules: str) -> str:
    """"True" or "False": whether importing `modules` in a fresh interpreter brings torch with it."""
    import subprocess
    import sys

    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip()


@pytest.mark.parametrize("role", ["loader", "preprocess", "worker", "ps", "coordinator"])
def test_services_start_without_torch(role):
    """A loader reads and sends bytes, a preprocess parses and hashes (its dedupe is
    pyarrow's): without torch each starts in ~0.4 s instead of ~1.6 (each restart too).
    A worker, shard or coordinator imports torch with its first DNN job (an LR job's step,
    shards and export are numpy's; tests/integration/test_pipeline.py checks its workers)."""
    out = torch_after_import(f"mariana.services.{role}")
    assert out == "False", (role, out)


def test_writing_an_image_set_needs_no_torch():
    """`mariana gen images` writes IDX or encoded files: ~2 s of CPU less without torch
    (the suite runs it seven times); reading them to train is featurizer/image.py's, with torch."""
    out = torch_after_import("mariana.featurizer.shapes", "mariana.featurizer.idx")
    assert out == "False", out
