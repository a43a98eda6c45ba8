#!/usr/bin/env bash
# Several soak processes of one backend at once on one GPU: the soak's deliberately tiny KV cache
# keeps each process's batches small, so one process leaves the GPU mostly idle, and a 10,000-
# request soak of one process outlasts a 10-minute device call. Each process soaks its own
# requests (its own --seed) with faults, solo re-runs and memory checks; soak_summary.py adds the
# counts up. Tokens/s of each process is measured beside the others (a lower bound of its own).
#
#   bash benchmarks/soak_parallel.sh BACKEND NPROC REQUESTS_EACH DEADLINE_S OUTDIR [STAGGER_S] [SEED0]
#
# STAGGER_S: the first process starts alone for that long (FlashInfer JIT-builds its modules
# once, into the shared cache, before the others need them). SEED0: process i soaks with seed
# SEED0 + i (default 0), so that runs split over several calls soak different requests.
set -u
backend=$1 n=$2 each=$3 deadline=$4 out=$5 stagger=${6:-0} seed0=${7:-0}
here=$(dirname "$0")
mkdir -p "$out"
pids=()
for i in $(seq 0 $((n - 1))); do
  seed=$((seed0 + i))
  PYTHONUNBUFFERED=1 python3 "$here/soak.py" --backend "$backend" --num-requests "$each" \
    --seed "$seed" --deadline-s "$deadline" --json "$out/soak_${backend}_$seed.json" \
    > "$out/soak_${backend}_$seed.txt" 2>&1 &
  pids+=($!)
  if [ "$i" = 0 ] && [ "$stagger" -gt 0 ]; then sleep "$stagger"; fi
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
python3 "$here/soak_summary.py" "$out"/soak_"${backend}"_*.json || rc=1
exit $rc
