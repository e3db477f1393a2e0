#!/usr/bin/env bash
# The device check of issue 36, as one command from the repository root of a fresh GPU machine (one H100/H200, 16
# cores; the whole run fits one 8-minute call: --budget, default 420 s, counts from here, set-up included):
#   bash scripts/gpu_check.sh                       # every section; results also in $OUT/gpu_check.json when $OUT is set
#   bash scripts/gpu_check.sh --sections ledger     # other flags go to scripts/gpu_check.py (see its --help)
#   bash scripts/gpu_check.sh --dry-run             # any machine, no CUDA, no set-up: syntax, imports, configs
# Exit status: 0 every section passed, 1 a section failed (or nothing could run), 2 none failed but some did not run.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
export GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s)}
# The working tree's phalanx, whichever Python runs it (a fallback interpreter has no editable install).
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

dry=0
budget=420
prev=""
for a in "$@"; do
  [ "$a" = --dry-run ] && dry=1
  [ "$prev" = --budget ] && budget=${a%.*}
  case "$a" in --budget=*) budget=${a#--budget=}; budget=${budget%.*} ;; esac
  prev=$a
done

if [ "$dry" = 1 ]; then
  # Parse all of this file before anything runs: bash itself reads a script as it goes.
  if ! bash -n "$self"; then
    echo "FAIL dry-run: $self does not parse (bash -n, above)"
    exit 1
  fi
  echo "dry-run: syntax ok: scripts/gpu_check.sh (bash -n)"
  py=.venv/bin/python
  [ -x "$py" ] || py=${PYTHON:-python3}
  exec "$py" scripts/gpu_check.py "$@"
fi

# A Python with a CUDA torch that imports this tree's phalanx: $PY if given, else .venv (set up when missing), else
# the machine's python3 (a .venv made on a CPU machine holds torch's CPU wheel; a failed set-up leaves none).
usable() { "$1" -c "import torch, phalanx, sys; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1; }
candidates=()
if [ -n "${PY:-}" ]; then
  candidates=("$PY")
else
  if [ ! -x .venv/bin/python ]; then
    # PHALANX_ISOLATED_VENV=0: the venv must see the machine's CUDA torch. An isolated one (what CI=true asks for)
    # would install torch==2.13.0, the CPU wheel, and this machine may have no network to fetch it anyway.
    setup_s=$(( budget / 2 < 200 ? budget / 2 : 200 ))
    echo "== no .venv: bash scripts/setup.sh (PHALANX_ISOLATED_VENV=0, at most ${setup_s} s)"
    if ! timeout "$setup_s" env PHALANX_ISOLATED_VENV=0 PIP_DEFAULT_TIMEOUT=15 bash scripts/setup.sh; then
      echo "set-up failed or timed out (above); trying the interpreters that are here instead"
    fi
  fi
  candidates=(.venv/bin/python python3 python)
fi
PY=""
for c in "${candidates[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && usable "$c"; then
    PY=$c
    break
  fi
  command -v "$c" >/dev/null 2>&1 && echo "not using $c: $("$c" -c "import torch; print('torch', torch.__version__, \
'CUDA available:', torch.cuda.is_available())" 2>&1 | tail -n 1)"
done
if [ -z "$PY" ]; then
  echo "FAIL: no Python here imports torch with CUDA available and phalanx (tried: ${candidates[*]}); install a CUDA" \
    "build of torch for python3, or PY=/path/to/python bash scripts/gpu_check.sh"
  exit 1
fi
echo "== using $PY ($(command -v "$PY")), set-up done at t=$(( $(date +%s) - GPU_CHECK_T0 )) s"
exec "$PY" scripts/gpu_check.py "$@"
