"""Mariana: CTR training and serving (sparse LR/DNN click models, parameter servers, online pCTR).

The Python API trains, loads and scores from a notebook through the code that
`mariana train`, `mariana predict` and `mariana evaluate` run (docs/python-api.md):

>>> import tempfile, mariana
>>> from mariana.sparse.synth import generate_criteo
>>> tmp = tempfile.TemporaryDirectory(); d = tmp.name
>>> _ = generate_criteo(f"{d}/train.tsv", 3000, seed=1), generate_criteo(f"{d}/test.tsv", 1000, seed=2)
>>> result = mariana.train(f"{d}/train.tsv", model="lr", out=f"{d}/m", test_data=f"{d}/test.tsv", bits=18)
>>> result.version, result.kind, result.rows, result.test_rows, result.auc > 0.6
('v000001', 'lr', 3000, 1000, True)
>>> model = mariana.load(f"{d}/m")
>>> model.predict([{"I1": 3, "C1": "68fd1e64"}, {}]).shape
(2,)
>>> model.predict(f"{d}/test.tsv").shape
(1000,)
>>> model.evaluate(f"{d}/test.tsv")["rows"] == 1000
True
>>> tmp.cleanup()

`import mariana` stays cheap (no torch, numpy or typing): the names below load on first use.
"""
from __future__ import annotations

import importlib
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (2 ms); checkers read it as True
if TYPE_CHECKING:
    from typing import Any

    from mariana.api import Model, Result, load, load_config, train
    from mariana.sparse.errors import ConfigError, DataFormatError, MarianaError, ModelDirError
    from mariana.trainer.config import JobConfig as Config

__all__ = ["train", "load", "load_config", "Config", "Result", "Model",
           "MarianaError", "ConfigError", "DataFormatError", "ModelDirError", "NoDataFiles", "__version__"]

# name -> (module, attribute): imported when first asked for (module-level __getattr__, PEP 562)
_LAZY = {
    "train": ("mariana.api", "train"),
    "load": ("mariana.api", "load"),
    "load_config": ("mariana.api", "load_config"),
    "Result": ("mariana.api", "Result"),
    "Model": ("mariana.api", "Model"),
    "Config": ("mariana.trainer.config", "JobConfig"),
    "MarianaError": ("mariana.sparse.errors", "MarianaError"),
    "ConfigError": ("mariana.sparse.errors", "ConfigError"),
    "DataFormatError": ("mariana.sparse.errors", "DataFormatError"),
    "ModelDirError": ("mariana.sparse.errors", "ModelDirError"),
    "NoDataFiles": ("mariana.sparse.inputs", "NoDataFiles"),  # a MarianaError: data that names no file
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        raise AttributeError(f"module 'mariana' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_forked_after_torch = False  # this process is a fork of one where torch was imported (`_one_torch_thread`)


def _one_torch_thread() -> None:
    """After a fork, with torch imported before it: one torch thread here. The parent's OpenMP
    pool does not survive fork (multiprocessing's default start method on Linux), and a child's
    DNN predict or training on more threads waited for it forever: after a DNN of the parent's,
    and after the parent's own torch work too (the hook was set by mariana's load or train only)."""
    global _forked_after_torch
    torch = sys.modules.get("torch")
    if torch is not None:
        _forked_after_torch = True
        torch.set_num_threads(1)


os.register_at_fork(after_in_child=_one_torch_thread)


def _version() -> str:
    """The installed distribution's version; "0+unknown" when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mariana")
    except PackageNotFoundError:
        return "0+unknown"
