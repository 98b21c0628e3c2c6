"""Process settings: pinning a serve worker to one CPU, and giving its children every CPU back;
a command run as the process's own skips the collector's walk at exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
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


@needs_affinity
@pytest.mark.parametrize("index", [0, 1, 5])
def test_a_pinned_process_runs_on_one_cpu_and_its_children_get_all_back(index):
    out = subprocess.run([sys.executable, "-c", PROBE, str(index)], capture_output=True, text=True, check=True)
    before, cpu, pinned, inherited, unpinned = json.loads(out.stdout)
    assert cpu == before[index % len(before)]
    assert pinned == inherited == [cpu]  # a child inherits the pin ...
    assert unpinned == before            # ... until unpin gives it every CPU the parent had


EXIT_PROBE = """
import gc, sys
from mariana.cli import main
args = ["gen", "criteo", "--rows", "5", "--out", sys.argv[2], "-q"]
before = gc.get_freeze_count()  # (an interpreter or site may have frozen some already)
if sys.argv[1] == "own":
    sys.argv = ["mariana", *args]
    code = main()
else:
    code = main(args)
print(code, gc.get_freeze_count() - before, file=sys.stderr)
"""


@pytest.mark.parametrize("how", ["own", "in-process"])
def test_only_a_command_run_as_the_process_freezes_its_objects_for_exit(how, tmp_path):
    """`mariana ...` freezes what is left when its command returns (the interpreter's last
    collections then skip it: ~0.4 s with torch loaded); main(argv) called from other code
    leaves the collector alone."""
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, how, str(tmp_path / "rows.tsv")],
                         capture_output=True, text=True, check=True)
    code, frozen = map(int, out.stderr.split())
    assert code == 0 and (tmp_path / "rows.tsv").stat().st_size > 0
    assert (frozen > 1000) if how == "own" else (frozen == 0), frozen
