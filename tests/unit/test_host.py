"""sparse/host.py: the CPUs a process may use -- its affinity mask, capped by its cgroup's CPU
quota -- which every thread and worker count defaults to, instead of the host's core count."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mariana.sparse.host import cgroup_dirs, cpu_quota, memory_limit

CODE = "from mariana.sparse.host import available_cpus, cpu_quota; print(available_cpus(), cpu_quota())"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_lowest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "kubepods" / "cgroup.controllers", "cpu\n")
    write(root / "kubepods" / "cpu.max", "400000 100000\n")   # 4 CPUs for the pod
    write(root / "kubepods" / "c1" / "cgroup.controllers", "cpu\n")
    write(root / "kubepods" / "c1" / "cpu.max", "150000 100000\n")  # 1.5 for the container
    write(tmp_path / "cgroup", "0::/kubepods/c1\n")
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) == 1.5
    write(root / "kubepods" / "c1" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) == 4.0
    write(root / "kubepods" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) is None
    # a container without its own cgroup namespace sees the host's path, its cgroup as the root
    write(tmp_path / "cgroup", "0::/docker/0123abcd\n")
    write(root / "cpu.max", "200000 100000\n")
    assert cgroup_dirs("cpu", "cpu.cfs_quota_us", str(root), str(tmp_path / "cgroup")) == (2, [str(root)])
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) == 2.0


def test_v1_quota_and_no_cgroups(tmp_path):
    root = tmp_path / "cg"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cgroup", "4:memory:/x\n3:cpu,cpuacct:/job\n")
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) == 0.5
    write(tmp_path / "cgroup", "3:cpu,cpuacct:/\n")
    assert cpu_quota(str(root), str(tmp_path / "cgroup")) is None
    assert cpu_quota(str(root), str(tmp_path / "absent")) is None
    assert cpu_quota(str(tmp_path / "none"), str(tmp_path / "cgroup")) is None


def test_memory_limit_is_the_lowest_of_the_cgroup_and_its_ancestors_v2_and_v1(tmp_path):
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "system.slice" / "cgroup.controllers", "memory\n")
    write(root / "system.slice" / "memory.max", "max\n")
    write(root / "system.slice" / "mariana.service" / "cgroup.controllers", "memory\n")
    write(root / "system.slice" / "mariana.service" / "memory.max", "8589934592\n")  # MemoryMax=8G
    write(tmp_path / "cgroup", "0::/system.slice/mariana.service\n")
    assert memory_limit(str(root), str(tmp_path / "cgroup")) == 8 << 30  # the unit's, not the (absent) root's
    write(root / "system.slice" / "mariana.service" / "memory.max", "max\n")
    assert memory_limit(str(root), str(tmp_path / "cgroup")) is None
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    write(v1 / "memory" / "job" / "memory.limit_in_bytes", "1073741824\n")
    write(tmp_path / "cgroup1", "4:memory:/job\n3:cpu,cpuacct:/\n")
    assert memory_limit(str(v1), str(tmp_path / "cgroup1")) == 1 << 30
    assert memory_limit(str(tmp_path / "none"), str(tmp_path / "cgroup")) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2+ CPUs")
def test_a_process_on_one_cpu_counts_one():
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "1"
    here = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert here.stdout.split()[0] == str(len(os.sched_getaffinity(0)))  # the control: all of them


def test_a_process_in_a_cpu_cgroup_with_half_a_cpu_counts_one():
    """A real cgroup (root and a cgroup filesystem): 50 ms of CPU per 100 ms."""
    found = cgroup_dirs("cpu", "cpu.cfs_quota_us")
    if found is None or os.geteuid() != 0:
        pytest.skip("no cpu cgroup to make here (needs root and a cgroup filesystem)")
    version, dirs = found
    child = os.path.join(dirs[0], f"mariana-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(child)
        if version == 2:
            Path(child, "cpu.max").write_text("50000 100000")
        else:
            Path(child, "cpu.cfs_period_us").write_text("100000")
            Path(child, "cpu.cfs_quota_us").write_text("50000")
    except OSError as e:
        pytest.skip(f"cannot make a cpu cgroup here: {e}")
    try:
        proc = subprocess.run(["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh", sys.executable,
                               "-c", CODE], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["1", "0.5"]
    finally:
        os.rmdir(child)
