"""Which of a model's arrays hold NaN or infinite values: checked wherever a version's
weights are loaded, so a corrupt or diverged one is refused at load, never served."""
from __future__ import annotations

import numpy as np


def nonfinite(arrays: dict) -> list[str]:
    """The names of the float arrays (numpy, or torch on the CPU) holding a NaN or an
    infinity. min and max carry either through (NaN propagates), in two passes that
    allocate nothing: a table of millions of rows is checked at every load.

    >>> nonfinite({"w": np.array([1., np.nan], np.float32), "b": np.ones(2), "ids": np.arange(3)})
    ['w']
    >>> nonfinite({"w": np.array([-np.inf, 0.], np.float32), "e": np.zeros((0, 4), np.float32)})
    ['w']
    """
    bad = []
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind == "f" and a.size and not (np.isfinite(a.max()) and np.isfinite(a.min())):
            bad.append(name)
    return bad


def describe(bad: list[str]) -> str:
    """`nonfinite`'s names for an error message.

    >>> describe(["a", "b", "c", "d", "e"])
    'NaN or infinite values (in a, b, c, d, ...)'
    """
    return f"NaN or infinite values (in {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})"
