#!/usr/bin/env bash
# Create .venv and install mariana into it (idempotent; reinstalls when
# pyproject.toml changes). Usage: scripts/bootstrap.sh [EXTRAS], e.g. "dev".
#
# torch is installed first and pinned to 2.13.0: on this kind of machine that
# is a CPU wheel on local disk; a loose "torch" would pull a multi-GB CUDA
# build from PyPI. pyproject.toml's range (<=2.13.0) then installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"

pip_install() {  # quiet on success; the whole log (less index noise) on failure
  local log
  if ! log=$(.venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$log" | grep -v "^WARNING: Location" >&2
    echo "bootstrap: pip install $* failed" >&2
    exit 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($python --version)" >&2
  "$python" -m venv .venv
fi
stamp=".venv/.installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing mariana${extras:+[$extras]} (torch==2.13.0, CPU)" >&2
  pip_install "torch==2.13.0"
  pip_install -e ".${extras:+[$extras]}"
  .venv/bin/python - <<'PY'
import torch, sys
if torch.version.cuda is not None and not torch.cuda.is_available():
    print(f"bootstrap: warning: torch {torch.__version__} is a CUDA build on a machine without a GPU", file=sys.stderr)
PY
  .venv/bin/mariana --version >/dev/null
  touch "$stamp"
fi
# The package's bytecode, written here: an editable install leaves it to each process,
# and where PYTHONDONTWRITEBYTECODE is set (container images often set it) every process
# then compiles the modules it imports again: ~0.1-0.15 s of CPU a process on a 2-core
# VM, and the suite starts ~500 of them. Only stale files are rewritten (~1 s when all are).
.venv/bin/python -m compileall -q -j 0 services sparse trainer featurizer serving mariana >/dev/null
