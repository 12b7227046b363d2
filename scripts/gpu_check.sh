#!/usr/bin/env bash
# The GPU check for one H100 or H200, in under 8 minutes: phases each in its own process under its cap, the
# whole within a 470 s budget (--budget), the JSON (default results/gpu/<GPU name>.json) rewritten after every
# phase. The phases, their order and caps are scripts/gpu_check.py's PHASE_TABLE (`--list` prints it); that
# file's docstring says what the JSON holds and what its PASS/FAIL checks compare.
#   bash scripts/gpu_check.sh [OUT.json] [--multi-gpu] [--dry-run] [--list] [--cap PHASE=SECONDS] ...
# It runs $PYTHON, or the python on PATH (the active virtualenv's), and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
if [[ $# -gt 0 && $1 != -* ]]; then
    args=(--out "$1")
    shift
fi
PYTHONUNBUFFERED=1 exec "${PYTHON:-python}" -m scripts.gpu_check ${args[@]+"${args[@]}"} "$@"
