#!/usr/bin/env bash
# The test suite: venv + install with the dev extra, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k hashing -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
exec .venv/bin/python -m pytest "$@"
