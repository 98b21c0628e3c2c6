"""Tools from Debian packages that tests check our output with (systemd-analyze, promtool,
chromium, hey): found on PATH, or installed with apt-get when the tests run as root; else
the test skips, naming the package to install."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

_lock = threading.Lock()
_updated = False


def debian_tool(program: str, package: str, timeout: float = 300.0) -> str:
    """The path of `program`, installing Debian's `package` with apt-get when it is missing."""
    found = _find(program)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{program} is missing and cannot be installed here (needs root and apt-get): "
                    f"apt-get install {package}")
    global _updated
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _lock:
        steps = ([] if _updated else [["apt-get", "update", "-qq"]]) + [
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]]
        for cmd in steps:
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.skip(f"{' '.join(cmd)} took more than {timeout:.0f} s")
            if proc.returncode != 0:
                pytest.skip(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
            _updated = _updated or cmd[1] == "update"
    found = _find(program)
    if not found:
        pytest.skip(f"apt-get installed {package} but {program} is not there")
    return found


def _find(program: str) -> str | None:
    return shutil.which(program) or (program if os.path.isabs(program) and os.path.exists(program) else None)


def can_unshare_mounts() -> bool:
    """`unshare -m` works here (root or CAP_SYS_ADMIN): a test can mount what it needs in a
    mount namespace of its own (util-linux's unshare, from Debian's util-linux)."""
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


def promtool_check(promtool: str, text: str) -> None:
    """`promtool check metrics` on a /metrics page: fails the test with what promtool said."""
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        f"promtool check metrics: rc {proc.returncode}\n{proc.stdout}{proc.stderr}")
