"""The soak's short version (bench/soak.py runs 20 minutes): 2 minutes of open-loop load
on `mariana serve` (2 workers) while a new version is promoted every 20 s and a retrain
runs every minute; no request fails, every worker serves every promoted version and every
retrain asked for starts. (The growth of RSS and fds is judged on the long run: two
minutes are mostly warm-up.) It runs beside the rest of the suite, started when the session
starts (the `background_soak` fixture in tests/conftest.py)."""
from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_two_minutes_of_load_while_versions_come_and_go(background_soak):
    out, log = background_soak
    deadline = time.monotonic() + 400
    while not (out / "exit_code").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"bench/soak.py still running after 400 s:\n{log.read_text()[-3000:]}")
        time.sleep(1.0)
    # (its exit code also counts the RSS and fd growth, judged on the long run only)
    assert (out / "results.json").exists(), ((out / "exit_code").read_text(), log.read_text()[-4000:])
    result = json.loads((out / "results.json").read_text())
    checks = result["checks"]
    failed = [k for k in checks if k.startswith("0 failed")]
    seen = [k for k in checks if k.startswith("every promotion")]
    assert checks[failed[0]], (result["load"]["errors"], result["load"]["status"])
    assert checks[seen[0]], [e for e in result["events"] if e["kind"] == "promotion" and not e["all"]]
    promotions = [e for e in result["events"] if e["kind"] == "promotion"]
    assert len(promotions) >= 5, result["events"]
    retrains = [e for e in result["events"] if e["kind"] == "retrain"]
    assert retrains and all(e["status"] == 202 for e in retrains), retrains  # none refused as "running already"
    assert result["load"]["answered"] >= 100 * 110 and len(result["samples"]) >= 20
    assert len(result["load"]["versions"]) >= 5  # answers came from every version served
    assert (out / "soak.png").stat().st_size > 10_000
