#!/usr/bin/env bash
# The one-shot GPU checks in one go, within 9 minutes on one H200 (later stages are cut off at
# whatever is left of the 9 minutes):
#   1. bench/gpu_step.sh    - a full GRPO step, qwen2.5-0.5b bf16, 8 x 8 x 256, beta 0.04 (~1.5-3 min);
#   2. bench/gpu_step.sh    - the same step on qwen3-0.6b (the fast engine's Qwen3 path), 6 steps;
#   3. bench/gpu_rollout.sh - engine speed, log-prob / greedy agreement, tests marked gpu (~5 min);
#   4. bench/gpu_rollout.sh on qwen3-0.6b, if time is left.
# All write under $OUT (a temporary folder when unset; Qwen3 under $OUT/qwen3); the step tables
# are printed again at the end.
# Usage: bash bench/gpu_all.sh   (PYTHON=python3 by default; TOTAL=540 seconds)
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" "$OUT/qwen3"
TOTAL=${TOTAL:-540}
# overridable for a dry run elsewhere (with gpu_step.sh / gpu_rollout.sh's own overrides for stages 1, 3)
Q3_STEP=${Q3_STEP:-"--shape qwen3-0.6b --dtype bf16"}
Q3_ROLLOUT=${Q3_ROLLOUT:-"--shape qwen3-0.6b --prompt-len 128 --dtype bf16"}
start=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - start))); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
echo "######## GRPO step, qwen2.5-0.5b"
GPU_ALL=1 STEP_TIMEOUT=${STEP_TIMEOUT:-200} bash bench/gpu_step.sh 2>&1 | tee "$OUT/gpu_step.log"
echo "######## GRPO step, qwen3-0.6b ($(left)s left)"
if [ "$(left)" -gt 120 ]; then
  QT=$(( $(left) - 60 )); [ "$QT" -gt 170 ] && QT=170
  OUT="$OUT/qwen3" GPU_ALL=1 SHAPE="$Q3_STEP" STEPS=6 STEP_TIMEOUT=$QT \
    bash bench/gpu_step.sh 2>&1 | tee "$OUT/qwen3/gpu_step.log"
else
  echo "skipped: not enough time left"
fi
echo "######## rollout engines, qwen2.5-0.5b ($(left)s left)"
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" bash bench/gpu_rollout.sh 2>&1 | tee "$OUT/gpu_rollout.log"
  [ "${PIPESTATUS[0]}" = 124 ] && echo "gpu_rollout.sh cut off at the time limit: see $OUT/*.jsonl, $OUT/*.log"
else
  echo "skipped: not enough time left"
fi
echo "######## rollout engines, qwen3-0.6b ($(left)s left)"
if [ "$(left)" -gt 60 ]; then
  OUT="$OUT/qwen3" SHAPE="$Q3_ROLLOUT" timeout "$(left)" \
    bash bench/gpu_rollout.sh 2>&1 | tee "$OUT/qwen3/gpu_rollout.log"
else
  echo "skipped: not enough time left"
fi
echo "######## GRPO steps (again)"
sed -n '/^system /,$p' "$OUT/gpu_step.log"
[ -f "$OUT/qwen3/gpu_step.log" ] && { echo "-- qwen3-0.6b"; sed -n '/^system /,$p' "$OUT/qwen3/gpu_step.log"; }
echo "total $(( $(date +%s) - start ))s"
