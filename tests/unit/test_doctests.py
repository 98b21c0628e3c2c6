"""Every module's doctests, run under the module's installed name (`mariana.<layer>...`).

pytest's --doctest-modules would import `sparse/x.py` a second time as `sparse.x`, beside
the `mariana.sparse.x` that the code imports, so a doctest would see a second copy of every
class and registry. Here each module is imported once, by its real name.
"""
import doctest
import importlib
import pkgutil

import pytest

import mariana

LAYERS = ("sparse", "featurizer", "trainer", "services", "serving")


def module_names() -> list[str]:
    names = ["mariana"] + [f"mariana.{m.name}" for m in pkgutil.iter_modules(mariana.__path__)
                           if m.name not in LAYERS and m.name != "__main__"]  # the API and the CLI
    for layer in LAYERS:
        package = importlib.import_module(f"mariana.{layer}")
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}.")]
    return sorted(names)


def collect() -> list:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for name in module_names():
        module = importlib.import_module(name)
        found += [pytest.param(t, id=t.name) for t in finder.find(module, name) if t.examples]
    return sorted(found, key=lambda p: p.id)


def test_every_module_is_found_and_imports():
    names = module_names()
    assert {"mariana.api", "mariana.sparse.hashing", "mariana.services.coordinator", "mariana.serving.app"} <= set(names)
    for name in names:
        importlib.import_module(name)


@pytest.mark.parametrize("test", collect())
def test_doctest(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
