"""A service near its memory limit logs it (services/runtime/memwatch.py): with
`cluster.memory_max_bytes` below what a service uses, every service of a real cluster
writes one WARNING naming its memory and the limit, and counts it; where the test can
make a memory cgroup (root), a process in it reads the cgroup's limit."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from mariana.services.runtime import memwatch
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_every_service_warns_near_its_configured_limit(tmp_path):
    with Cluster(tmp_path / "c", **{"cluster.memory_max_bytes": 40 << 20}) as c:
        names = ["coordinator-0", "ps-0", "loader-0", "preprocess-0", "worker-0"]

        def warned():
            logs = {n: (c.root / "logs" / f"{n}.log").read_text() for n in names}
            return logs if all("of its limit 40 MiB (cluster.memory_max_bytes)" in t for t in logs.values()) else None

        logs = c.wait_for(warned, 30.0)
        assert all(t.count("of its limit 40 MiB") == 1 for t in logs.values()), logs  # once, not every check
        services = c.wait_for(lambda: (lambda s: s if all(s[n]["status"].get("memory_warnings") == 1
                                                          for n in names[1:]) else None)(c.status()["services"]))
        assert services


def test_a_process_in_a_memory_cgroup_reads_its_limit():
    files = memwatch.cgroup_files()
    if files is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup to make here (needs root and a cgroup filesystem)")
    parent = os.path.dirname(files[0])
    child = os.path.join(parent, f"mariana-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(child)
        limit = "memory.max" if files[0].endswith("memory.max") else "memory.limit_in_bytes"
        with open(os.path.join(child, limit), "w") as f:
            f.write(str(1 << 30))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        code = "from mariana.services.runtime import memwatch; print(memwatch.limit_and_usage()[0])"
        proc = subprocess.run(["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh", sys.executable,
                               "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout.strip()) == 1 << 30
    finally:
        os.rmdir(child)
