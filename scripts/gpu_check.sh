#!/usr/bin/env bash
# The GPU check for one H100 or H200, in under 8 minutes (scripts/gpu_check.py says more). Phases, each in
# its own process under its cap (seconds), the whole within a 470 s budget (--budget):
#   environment 30 | traffic predictions (depth_kernels.tools.traffic, CPU) 45 | CUDA tests (test_kernels, test_memory)
#   150 | routing bandwidth vs a measured copy 60 | per-kernel bandwidth of a 1044M step 90 | host time 30 |
#   1044M training, baseline / delta_block / delta, tokens/s and memory at steps 5 and 20: 100 each;
#   with --multi-gpu and 2+ GPUs, train.py under torchrun, ddp and fsdp: 300 each (outside the budget).
# A phase over its cap is killed and recorded as "timed out"; a crash as "failed"; the rest still run.
# The JSON (default results/gpu/<GPU name>.json) is rewritten after every phase: GPU name and versions, then
# "phases": {name: {"status": "ok" | "failed" | "timed out" | "skipped", "seconds", ...}}, then "checks":
# PASS/FAIL against what depth_kernels.tools.traffic predicts for this GPU (- 0.05) and flat memory; goals beside them.
#   bash scripts/gpu_check.sh [OUT.json] [--multi-gpu] [--dry-run] [--cap PHASE=SECONDS] ...
# It runs $PYTHON, or the python on PATH (the active virtualenv's), and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
if [[ $# -gt 0 && $1 != -* ]]; then
    args=(--out "$1")
    shift
fi
PYTHONUNBUFFERED=1 exec "${PYTHON:-python}" -m scripts.gpu_check ${args[@]+"${args[@]}"} "$@"
