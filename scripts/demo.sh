#!/usr/bin/env bash
# Sets up .venv and runs the demo: a byte-level GPT trained on the Python standard library's source, on
# 2 processes (one per GPU where there are GPUs). Arguments go to `phalanx demo`, e.g. --strategy ddp -- --steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/phalanx demo "$@"
