#!/usr/bin/env bash
# Sets up .venv with phalanx and its dev tools. Idempotent; safe to run again.
# A torch already installed for this Python is reused (--system-site-packages). With none, torch==2.13.0 is
# installed first: an unpinned torch on a machine without one would pull the multi-GB CUDA build.
# PHALANX_ISOLATED_VENV=1 (which .ci/run sets; CI=true implies it unless PHALANX_ISOLATED_VENV=0) builds a
# .venv that sees no system packages, so anything pyproject.toml fails to declare fails here, as it would on
# a fresh machine. A .venv that sees system packages is then rebuilt; an isolated one is fine for either mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
isolated=${PHALANX_ISOLATED_VENV:-}
if [ -z "$isolated" ]; then
  if [ "${CI:-}" = true ]; then isolated=1; else isolated=0; fi
fi
sees_system() { grep -q -E "^include-system-site-packages *= *true" .venv/pyvenv.cfg 2>/dev/null; }
pip_install() {  # pip's exit status is kept; only its notes about install locations are dropped
  .venv/bin/pip install -q "$@" 2>&1 | { grep -v -E "^WARNING: (Location|The directory)" || true; }
}
if [ "$isolated" = 1 ]; then
  if [ ! -x .venv/bin/python ] || sees_system; then
    [ -e .venv ] && echo "rebuilding .venv without system packages (PHALANX_ISOLATED_VENV=1 or CI=true)" >&2
    "$PYTHON" -m venv --clear .venv
  fi
elif [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  pip_install "torch==2.13.0" || { echo "installing torch==2.13.0 failed" >&2; exit 1; }
  .venv/bin/python -W ignore -c "import torch" || { echo "installing torch==2.13.0 failed" >&2; exit 1; }
fi
# Every install is constrained to the torch now in .venv, so that no package (transformers, for the tests) can make
# pip swap it for another build.
constraints=.venv/torch-constraint.txt
.venv/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"
pip_install -c "$constraints" -e ".[dev,test]" || {
  echo "installing phalanx and its dependencies (pip install -e '.[dev,test]') failed" >&2; exit 1; }
mode="reusing system packages"
if ! sees_system; then
  mode="isolated"
  broken=$(.venv/bin/pip check) || { echo "$broken" >&2; echo "the packages in .venv do not fit together (pip check)" >&2; exit 1; }
fi
.venv/bin/python -c "
import numpy, torch, phalanx
torch.zeros(1).numpy()  # fails with 'Numpy is not available' where torch cannot use numpy
print(f'phalanx {phalanx.__version__} with torch {torch.__version__} and numpy {numpy.__version__} in .venv ($mode)')
"
