#!/usr/bin/env bash
# Sets up .venv with phalanx and its dev tools. Idempotent; safe to run again.
# A torch already installed for this Python is reused (--system-site-packages). With none, torch==2.13.0 is
# installed first: an unpinned torch on a machine without one would pull the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q "torch==2.13.0" 2>&1 | grep -v -E "^WARNING: (Location|The directory)" || true
  .venv/bin/python -c "import torch" || { echo "installing torch==2.13.0 failed" >&2; exit 1; }
fi
.venv/bin/pip install -q -e ".[dev]" 2>&1 | grep -v -E "^WARNING: (Location|The directory)" || true
.venv/bin/python -c "import phalanx, torch; print(f'phalanx {phalanx.__version__} with torch {torch.__version__} in .venv')"
