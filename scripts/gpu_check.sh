#!/usr/bin/env bash
# The GPU check: scripts/gpu_check.py's docstring says what it runs and records; its phases are PHASE_TABLE there.
#   bash scripts/gpu_check.sh [OUT.json] [--multi-gpu] [--dry-run] [--list] [--cap PHASE=SECONDS] ...
# OUT.json becomes --out. It runs $PYTHON, or the python on PATH (the active virtualenv's), and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
if [[ $# -gt 0 && $1 != -* ]]; then
    args=(--out "$1")
    shift
fi
PYTHONUNBUFFERED=1 exec "${PYTHON:-python}" -m scripts.gpu_check ${args[@]+"${args[@]}"} "$@"
