#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite. Extra arguments go to pytest (e.g. -k ddp).
# PHALANX_ISOLATED_VENV=1 builds .venv without system packages (see scripts/setup.sh); .ci/run sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check --quiet . || { echo "ruff format --check failed: run .venv/bin/ruff format ." >&2; exit 1; }
.venv/bin/ruff check --quiet .
.venv/bin/python -m mypy src/phalanx
set +e
.venv/bin/python -m pytest -q --durations=15 "$@"  # the slowest tests, to keep the suite well under CI's 30 minutes
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: the suite is missing or the selection matched nothing" >&2
  exit 1
fi
exit "$code"
