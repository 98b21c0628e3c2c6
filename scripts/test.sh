#!/usr/bin/env bash
# The test suite: venv + install with the dev extra, then pytest on every core of a 2-core
# host (pytest-xdist, each test file on one worker: a module's fixtures are built once).
# Extra arguments go to pytest (e.g. scripts/test.sh -k hashing -x; -n 0 for one process).
# MARIANA_TEST_WORKERS sets the worker count (default 2: each cluster test starts several
# processes of its own, so more workers than cores only adds contention).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
exec .venv/bin/python -m pytest -n "${MARIANA_TEST_WORKERS:-2}" --dist loadfile "$@"
