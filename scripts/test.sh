#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite. Extra arguments go to pytest (e.g. -k ddp).
# PHALANX_ISOLATED_VENV=1 builds .venv without system packages (see scripts/setup.sh); .ci/run sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check --quiet . || { echo "ruff format --check failed: run .venv/bin/ruff format ." >&2; exit 1; }
.venv/bin/ruff check --quiet .
.venv/bin/python -m mypy src/phalanx
# The suite runs on PHALANX_TEST_WORKERS pytest-xdist workers (2, one per core of a CI machine), then the tests
# marked serial (a hang timeout, a keep-alive) alone. --durations lists the slowest: the suite should stay near 12
# minutes on 2 cores.
workers=${PHALANX_TEST_WORKERS:-2}
set +e
.venv/bin/python -m pytest -q -n "$workers" -m "not serial" --durations=15 "$@"
parallel=$?
.venv/bin/python -m pytest -q -m serial --durations=5 "$@"
serial=$?
set -e
# 5: this part collected no test (a selection such as -k ddp may match only the other part)
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then
  echo "pytest collected no tests: the suite is missing or the selection matched nothing" >&2
  exit 1
fi
for code in "$parallel" "$serial"; do
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then exit "$code"; fi
done
exit 0
