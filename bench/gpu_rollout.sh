#!/usr/bin/env bash
# One-shot GPU check of the rollout engines (fits a 10-minute limit on one H200).
#   1. generation speed, qwen2.5-0.5b shape, bf16, 64 sequences x (128 prompt + 256 new tokens):
#      fast (+ ablations: no compile, no fusion), our hf reference, and generate as TRL calls it;
#   2. bf16 log-prob agreement with a forward pass, greedy agreement with model.generate;
#   3. the tests marked gpu (CUDA graphs, compile, seeds, weight updates).
# Logs go to $OUT (a temporary folder when unset); a short table ends the output.
# Usage: bash bench/gpu_rollout.sh   (PYTHON=python3 by default)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/gpu_setup.sh || exit 1
# overridable for a dry run elsewhere, e.g. SHAPE="--shape tiny --prompt-len 16 --dtype fp32" BATCH=8 NEW=16
SHAPE=${SHAPE:-"--shape qwen2.5-0.5b --prompt-len 128 --dtype bf16"}
BATCH=${BATCH:-64}
NEW=${NEW:-256}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"

echo "== speed (fast variants)"
timeout 240 $PY -m nanogrpo.bench.rollout $SHAPE --batch $BATCH --new-tokens $NEW --repeats 3 \
  --engines fast,fast-nocompile,fast-nofuse 2>"$OUT/bench_fast.err" | tee "$OUT/bench.jsonl"
echo "== speed (hf, trl-style generate)"
timeout 150 $PY -m nanogrpo.bench.rollout $SHAPE --batch $BATCH --new-tokens $NEW --repeats 2 \
  --engines hf,trl 2>"$OUT/bench_hf.err" | tee -a "$OUT/bench.jsonl"
echo "== bf16 log-prob / greedy agreement"
timeout 90 $PY -m nanogrpo.bench.rollout $SHAPE --batch 16 --new-tokens $((NEW / 2)) --check \
  --engines fast,hf 2>"$OUT/check.err" | tee "$OUT/check.jsonl"
echo "== tests marked gpu"
timeout 150 $PY -m pytest -m gpu tests/test_engines.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"

$PY - "$OUT" <<'EOF'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def rows(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.startswith("{")] if p.exists() else []
print(f"\n{'engine':<16}{'tok/s':>10}{'ms/step':>10}{'median_s':>10}{'first_s':>9}{'peak GiB':>10}")
speed = rows("bench.jsonl")
for r in speed:
    if "error" in r:
        print(f"{r['engine']:<16} ERROR {r['error'][:90]}")
    else:
        print(f"{r['engine']:<16}{r['tok_per_s']:>10}{r['ms_per_decode_step']:>10}{r['median_s']:>10}"
              f"{r['first_s']:>9}{str(r['peak_mem_gib']):>10}")
tps = {r["engine"]: r["tok_per_s"] for r in speed if "tok_per_s" in r}
for peer in ("trl", "hf"):
    if "fast" in tps and peer in tps:
        print(f"fast / {peer}: {tps['fast'] / tps[peer]:.1f}x")
print(f"\n{'engine':<8}{'lp max|d|':>11}{'lp mean|d|':>12}{'greedy prefix':>15}   (bf16 vs forward / generate)")
for r in rows("check.jsonl"):
    if "error" in r:
        print(f"{r['engine']:<8} ERROR {r['error'][:90]}")
    else:
        print(f"{r['engine']:<8}{r['logprob_max_abs_diff']:>11}{r['logprob_mean_abs_diff']:>12}"
              f"{r['greedy_prefix_share']:>15}")
log = out / "gpu_tests.log"
tail = [l for l in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", l)]
print("\ngpu tests:", tail[-1] if tail else "no result (timed out?)")
EOF
