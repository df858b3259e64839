#!/usr/bin/env bash
# Both one-shot GPU checks in one go, within 9 minutes on one H200:
#   1. bench/gpu_step.sh    - a full GRPO step, qwen2.5-0.5b bf16, 8 x 8 x 256, beta 0.04 (~1.5-3 min);
#   2. bench/gpu_rollout.sh - engine speed, log-prob / greedy agreement, tests marked gpu (~5 min),
#      cut off at whatever is left of the 9 minutes.
# Both write under $OUT (a temporary folder when unset); the step table is printed again at the end.
# Usage: bash bench/gpu_all.sh   (PYTHON=python3 by default; TOTAL=540 seconds)
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
TOTAL=${TOTAL:-540}
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
echo "######## GRPO step"
GPU_ALL=1 STEP_TIMEOUT=${STEP_TIMEOUT:-200} bash bench/gpu_step.sh 2>&1 | tee "$OUT/gpu_step.log"
left=$((TOTAL - ($(date +%s) - start)))
echo "######## rollout engines (${left}s left)"
if [ "$left" -gt 60 ]; then
  timeout "$left" bash bench/gpu_rollout.sh 2>&1 | tee "$OUT/gpu_rollout.log"
  [ "${PIPESTATUS[0]}" = 124 ] && echo "gpu_rollout.sh cut off at the time limit: see $OUT/*.jsonl, $OUT/*.log"
else
  echo "skipped: not enough time left"
fi
echo "######## GRPO step (again)"
sed -n '/^system /,$p' "$OUT/gpu_step.log"
echo "total $(( $(date +%s) - start ))s"
