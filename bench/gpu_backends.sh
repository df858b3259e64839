#!/usr/bin/env bash
# One GRPO update step through each training backend on one GPU (bench/backend_step.py), then the
# 7B-shaped step within 80 GB (bench/gpu_7b_step.py) and the loss-path memory at 64 x 512.
#   single (AdamW on the GPU; then on the CPU), DDP and FSDP2 under torchrun, DeepSpeed ZeRO-2 and
#   ZeRO-3 with the optimizer on the CPU (the seed's setup) under the deepspeed launcher.
# DeepSpeed is not on the GPU image: carry .whl (bash bench/fetch_wheels.sh here); without it the
# DeepSpeed rows say "skipped". Its CPU Adam op is built (JIT, ~1-2 min) on first use.
# Logs and JSON under $OUT; a table ends the output.  Usage: bash bench/gpu_backends.sh
# (SHAPE=qwen2.5-1.5b ROWS=16 LEN=512 by default; TOTAL=540 seconds for everything)
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/gpu_setup.sh || exit 1
SHAPE=${SHAPE:-qwen2.5-1.5b}
ROWS=${ROWS:-16}
LEN=${LEN:-512}
TOTAL=${TOTAL:-540}
start=$(date +%s)
ARGS="--shape $SHAPE --rows $ROWS --len $LEN --steps 4"
left() { echo $((TOTAL - ($(date +%s) - start))); }
run() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  [ "$(left)" -lt 30 ] && { echo "$name: skipped (time)"; return; }
  [ "$t" -gt "$(left)" ] && t=$(left)
  echo "== $name"
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1 || echo "$name: exit $? (see $OUT/$name.log)"
  grep '^{' "$OUT/$name.log" | tail -1
}
PORT=29611
run single 90 python3 bench/backend_step.py --backend single $ARGS
run single_offload 120 python3 bench/backend_step.py --backend single --offload 1 $ARGS
run ddp 90 python3 -m torch.distributed.run --nproc_per_node 1 --master_port $((PORT++)) \
  bench/backend_step.py --backend ddp $ARGS
run fsdp2 90 python3 -m torch.distributed.run --nproc_per_node 1 --master_port $((PORT++)) \
  bench/backend_step.py --backend fsdp2 $ARGS
if python3 -c "import deepspeed" >/dev/null 2>&1; then
  for st in 2 3; do
    run "zero${st}_offload" 240 deepspeed --num_gpus 1 --master_port $((PORT++)) \
      bench/backend_step.py --backend deepspeed --stage $st --offload 1 $ARGS
  done
else
  echo "zero2_offload, zero3_offload: skipped (no deepspeed: carry .whl)"
fi
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  run gpu_7b_step 240 python3 bench/gpu_7b_step.py
  run loss_memory 120 python3 bench/loss_memory.py
else
  echo "gpu_7b_step, loss_memory: skipped (no CUDA)"
fi
echo "######## summary"
python3 - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
p = out / "backend_step.jsonl"
rows = [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
print(f"{'backend':<12}{'stage':>6}{'offload':>8}{'shape':>14}{'rows x len':>12}{'step s':>8}{'peak GiB':>9}")
for r in rows:
    print(f"{r['backend']:<12}{str(r['stage'] or '-'):>6}{str(r['offload']):>8}{r['shape']:>14}"
          f"{str(r['rows']) + 'x' + str(r['len']):>12}{r['step_s_median']:>8}{str(r['peak_gpu_gib']):>9}")
for name in ("gpu_7b_step.log", "loss_memory.log"):
    f = out / name
    if f.exists():
        print(f"-- {name}")
        print("\n".join(f.read_text().splitlines()[-5:]))
PYEOF
echo "total $(( $(date +%s) - start ))s"
