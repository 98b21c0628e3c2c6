"""Process settings: pinning a serve worker to one CPU, and giving its children every CPU back."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs CPU affinity and 2+ CPUs")

PROBE = """
import json, os, subprocess, sys
from mariana.services.runtime.tuning import pin_to_cpu, unpin
before = sorted(os.sched_getaffinity(0))
cpu = pin_to_cpu(int(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
inherited = sorted(os.sched_getaffinity(child.pid))
unpin(child.pid)
print(json.dumps([before, cpu, sorted(os.sched_getaffinity(0)), inherited, sorted(os.sched_getaffinity(child.pid))]))
child.kill()
"""


@pytest.mark.parametrize("index", [0, 1, 5])
def test_a_pinned_process_runs_on_one_cpu_and_its_children_get_all_back(index):
    out = subprocess.run([sys.executable, "-c", PROBE, str(index)], capture_output=True, text=True, check=True)
    before, cpu, pinned, inherited, unpinned = json.loads(out.stdout)
    assert cpu == before[index % len(before)]
    assert pinned == inherited == [cpu]  # a child inherits the pin ...
    assert unpinned == before            # ... until unpin gives it every CPU the parent had
