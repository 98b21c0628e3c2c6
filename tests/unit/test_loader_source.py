"""The loader's check that a source file stayed the file it began reading (services/loader.py):
a file truncated during epoch 1 gave a job reported done on 282,711 rows, of neither the
500,000 rows submitted nor the 168,509 left (an exploratory chaos run)."""
from __future__ import annotations

import os

import pytest

from mariana.services.loader import _check_unchanged
from mariana.sparse.errors import MarianaError


def test_a_source_truncated_replaced_or_removed_while_read_fails_the_read(tmp_path, caplog):
    path = tmp_path / "day.tsv"
    path.write_text("0\ta\n" * 1000)
    before = os.stat(path)
    _check_unchanged(str(path), before)  # as it was
    with open(path, "a") as f:  # appended to (a log being written): said, not an error
        f.write("1\tb\n")
    _check_unchanged(str(path), before)
    assert "grew from 4,000 to 4,004 bytes" in caplog.text
    os.truncate(path, 1234)
    with pytest.raises(MarianaError, match="was truncated from 4,000 to 1,234 bytes while the job read it"):
        _check_unchanged(str(path), before)
    other = tmp_path / "new.tsv"
    other.write_text("0\ta\n" * 2000)
    os.replace(other, path)
    with pytest.raises(MarianaError, match="was replaced while the job read it"):
        _check_unchanged(str(path), before)
    path.unlink()
    with pytest.raises(MarianaError, match="was removed while the job read it"):
        _check_unchanged(str(path), before)
