"""The code's shape (issue 16): one package whose list matches the folders, no import
cycles among mariana's modules, no class over ~300 lines."""
import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("sparse", "featurizer", "trainer", "services", "serving")
MAX_CLASS_LINES = 300


def modules() -> dict[str, Path]:
    """Installed module name -> source file, for every module of the package."""
    found = {}
    for folder, prefix in [("mariana", "mariana"), *((layer, f"mariana.{layer}") for layer in LAYERS)]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def test_pyproject_lists_every_package_folder():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert set(tool["packages"]) == folders
    assert tool["package-dir"] == {"mariana": "mariana", **{f"mariana.{layer}": layer for layer in LAYERS}}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The mariana modules `name` imports anywhere in its body (lazy imports too; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = modules()
    graph = {name: imported(name, path, set(mods)) for name, path in mods.items()}
    assert graph["mariana.trainer.job"], "the import walk found nothing: the test would pass vacuously"
    assert not cycles(graph), cycles(graph)


@pytest.mark.parametrize("layer", ("mariana", *LAYERS))
def test_no_class_over_300_lines(layer):
    big = {}
    for path in (ROOT / layer).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big[f"{path.relative_to(ROOT)}::{node.name}"] = node.end_lineno - node.lineno + 1
    assert not big, f"classes over {MAX_CLASS_LINES} lines (split them by role): {big}"
