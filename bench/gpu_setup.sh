# Sourced at the start of every GPU device call: installs the carried wheels in .whl/ (made by
# bench/fetch_wheels.sh) into /tmp/site without the index and puts it and the repository on
# PYTHONPATH. Stops the call with a clear message when something nanogrpo needs is still missing.
#   source bench/gpu_setup.sh
if [ -n "${NANOGRPO_GPU_SETUP:-}" ]; then return 0 2>/dev/null || exit 0; fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "gpu_setup: installing .whl/*.whl failed"; return 1 2>/dev/null || exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
if ! python3 -c "import nanogrpo.config, nanogrpo.rewards" 2>/tmp/gpu_setup_err.txt; then
  echo "gpu_setup: nanogrpo does not import on this image; carry .whl (bash bench/fetch_wheels.sh here):"
  tail -3 /tmp/gpu_setup_err.txt
  return 1 2>/dev/null || exit 1
fi
python3 -c "import deepspeed" >/dev/null 2>&1 && echo "gpu_setup: deepspeed available" \
  || echo "gpu_setup: no deepspeed (its bench is skipped)"
export NANOGRPO_GPU_SETUP=1
