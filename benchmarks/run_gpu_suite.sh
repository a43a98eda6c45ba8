#!/usr/bin/env bash
# Everything that needs the GPU, in one lease: the attention benchmark (every backend side by side,
# plus a triton split-KV sweep), then the tests marked `gpu`. Logs and JSON go to $OUT (default out/).
# FlashInfer is optional: install its wheels first (see README) to get its rows and tests.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_attention.py --segments 16,32,64 \
    --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench_attention.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.txt"
