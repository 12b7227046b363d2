#!/usr/bin/env bash
# The GPU check, for the day a CUDA GPU is at hand (an H100 or H200; under 10 minutes on one H200):
#   1. the CUDA tests: kernels against the reference on the real compiler, memory targets, sm_90 build checks;
#   2. the routing benchmark: forward and forward+backward time, bandwidth against a measured device copy and
#      the nominal peak, host time per call;
#   3. a short whole-model run of configs/1044m_{baseline,delta_block,delta}.py on one GPU: tokens/s, peak memory.
# Everything goes into one JSON file with the GPU's name, torch and Triton versions and the commit:
#   bash scripts/gpu_check.sh [OUT.json]        (default: results/gpu/<gpu name>.json)
# It uses the python3 it finds (with torch and triton) and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
out=${1:-results/gpu/${name}.json}
mkdir -p "$(dirname "$out")"
PYTHONUNBUFFERED=1 python3 -m kernels.bench --tests --out "$out"
