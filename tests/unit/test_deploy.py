"""The systemd units in deploy/ pass `systemd-analyze verify` (with ExecStart
pointed at this checkout's `mariana`, since /opt/mariana is where they install)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service")) + sorted((ROOT / "deploy" / "systemd").glob("*.timer"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (Debian package 'systemd')")
def test_units_verify(tmp_path):
    assert UNITS, "no units in deploy/systemd"
    mariana = Path(sys.executable).parent / "mariana"
    for unit in UNITS:
        text = unit.read_text().replace("/opt/mariana/.venv/bin/mariana", str(mariana))
        text = text.replace("User=mariana", "User=root").replace("Group=mariana", "Group=root")
        (tmp_path / unit.name).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / u.name) for u in UNITS)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
