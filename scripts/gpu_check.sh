#!/usr/bin/env bash
# One-shot GPU check for a session that draws a CUDA device (issue 14; a few minutes):
#   1. the CUDA-only unit tests (graph replay vs --enforce-eager) and the host-sync guard tests;
#   2. scripts/gpu_check.py: greedy parity with HF on the GPU, decode tok/s vs HF (batch 1, 32).
# Usage, from the repo root: scripts/gpu_check.sh [OUT_DIR]   (results in OUT_DIR, default $OUT or .)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
OUT_DIR=${1:-${OUT:-.}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/model/test_no_host_sync.py \
    2>&1 | tee "$OUT_DIR/gpu_check_pytest.txt" | tail -5
timeout 240 "$PY" scripts/gpu_check.py --result-json "$OUT_DIR/gpu_check.json" "${@:2}" 2>&1 | tee "$OUT_DIR/gpu_check.txt"
