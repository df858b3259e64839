#!/usr/bin/env bash
# One-shot GPU check of a full GRPO step (fits 8 minutes on one H200):
#   nanogrpo bench step, qwen2.5-0.5b shape (random init), bf16, 8 prompts x 8 samples x 256 new
#   tokens (forced), beta 0.04, random rewards; median of the steps after the first.
#   Target (issue 6): <= 0.9 s median, against TRL 1.16's 9.09 s measured on one H200
#   (../shared/anchors/results-h200.jsonl).
# TRL runs beside it in the same process (--trl) only when it is importable. It is not on the GPU
# image: bench/fetch_wheels.sh puts it (and what nanogrpo needs) in .whl/, which the device call
# carries; bench/gpu_setup.sh (sourced here) installs them.
# Logs go to $OUT (a temporary folder when unset); a short table ends the output.
# Usage: bash bench/gpu_step.sh   (PYTHON=python3 by default)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# overridable for a dry run elsewhere, e.g. SHAPE="--shape tiny --dtype fp32" PROMPTS=2 GENS=4 NEW=16
SHAPE=${SHAPE:-"--shape qwen2.5-0.5b --dtype bf16"}
PROMPTS=${PROMPTS:-8}
GENS=${GENS:-8}
NEW=${NEW:-256}
STEPS=${STEPS:-8}
STEP_TIMEOUT=${STEP_TIMEOUT:-420}
source bench/gpu_setup.sh || exit 1

if [ -z "${GPU_ALL:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
fi
TRL_FLAG=""
if $PY -c "import trl, datasets, accelerate" >/dev/null 2>&1; then
  TRL_FLAG="--trl"
  echo "TRL found: running it beside nanogrpo"
else
  echo "TRL not importable: nanogrpo only (anchor: TRL 9.09 s/step on one H200)"
fi

echo "== GRPO step: nanogrpo${TRL_FLAG:+ and TRL}"
timeout "$STEP_TIMEOUT" $PY -m nanogrpo.bench.step $SHAPE --prompts "$PROMPTS" --gens "$GENS" \
  --max-new "$NEW" --beta 0.04 --steps "$STEPS" $TRL_FLAG 2>"$OUT/step.err" | tee "$OUT/step.jsonl"
echo "exit ${PIPESTATUS[0]} (124 = timed out)" >>"$OUT/step.err"

$PY - "$OUT" "$SHAPE" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
anchored = "qwen2.5-0.5b" in sys.argv[2]  # TRL's H200 anchor is that shape's
p = out / "step.jsonl"
rows = [json.loads(l) for l in p.read_text().splitlines() if l.startswith("{")] if p.exists() else []
print(f"\n{'system':<12}{'step_s':>9}{'gen_s':>9}{'gen %':>7}{'compl tok/s':>13}{'peak GiB':>10}  steps")
for r in rows:
    if "ratio" in r:
        print(f"TRL / nanogrpo step: {r['value']}x (generation {r['gen_ratio']}x)")
    elif "error" in r:
        print(f"{r['system']:<12} ERROR {r['error'][:100]}")
    else:
        print(f"{r['system']:<12}{r['step_s_median']:>9}{r['gen_s_median']:>9}{100 * r['gen_share']:>7.0f}"
              f"{r['completion_tok_per_s']:>13}{str(r.get('peak_gpu_gib')):>10}  {r['step_times']}")
ours = [r for r in rows if r.get("system") == "nanogrpo" and "step_s_median" in r]
if ours and anchored:
    s = ours[0]["step_s_median"]
    print(f"nanogrpo step median {s} s: target <= 0.9 s {'MET' if s <= 0.9 else 'NOT met'}; "
          f"TRL anchor 9.09 s -> {9.09 / s:.1f}x")
elif not ours:
    print("nanogrpo: no result (see step.err)")
PYEOF
