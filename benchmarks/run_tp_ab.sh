#!/usr/bin/env bash
# Issue 13's next measurement in one lease of 2 GPUs: TP=1, TP=2 with projection fusion, TP=2
# without it (all at batch 1 with a per-step profile), then the greedy/speed comparisons. Logs and
# JSON go to $OUT (default out/). The weights (Llama-3.1-8B shape, random, 15 GB) are prepared once
# under $WEIGHTS (default /tmp/llama8b). About 8 minutes on 2 H200s; BATCHES=1,64,256 for more;
# SHAPE=tiny (and WEIGHTS elsewhere) for a CPU smoke run with gloo.
set -uo pipefail
OUT=${OUT:-out}
W=${WEIGHTS:-/tmp/llama8b}
B=${BATCHES:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
[ -f "$W/config.json" ] || timeout 200 python3 benchmarks/bench_tp.py --prepare "$W" --shape "${SHAPE:-8b}" 2>&1 | tail -1
run() {  # name, launcher..., then bench_tp arguments
    local name=$1; shift
    timeout "${RUN_TIMEOUT:-200}" "$@" --weights "$W" --shape "${SHAPE:-8b}" --batches "$B" --profile-batches 1 \
        --hang-dump $(( ${RUN_TIMEOUT:-200} - 10 )) --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "$name rc $?"; grep -v -i "warn\|Loading weights\|return model_class" "$OUT/$name.txt" | tail -4
}
run tp1 python3 benchmarks/bench_tp.py
run tp2 torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py
run tp2_unfused torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --llm fuse_projections=False
for other in tp2 tp2_unfused; do
    [ -f "$OUT/tp1.json" ] && [ -f "$OUT/$other.json" ] && \
        python3 benchmarks/bench_tp.py --compare "$OUT/tp1.json" "$OUT/$other.json" | tee -a "$OUT/compare.txt"
done
