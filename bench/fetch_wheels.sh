#!/usr/bin/env bash
# Download, on a machine with the package index, the wheels the GPU image lacks into .whl/
# (git-ignored), for CPython 3.12 on x86-64 Linux. A device call then carries .whl and starts
# with `source bench/gpu_setup.sh`, which installs them into /tmp/site (no index, no deps).
#
#   nanogrpo itself:  pydantic (+ core, annotated-types, typing-inspection, typing_extensions >= 4.16), math-verify
#                     (+ latex2sympy2_extended, antlr4 runtime); the image has the rest
#   DeepSpeed:        deepspeed, hjson (the image has einops, msgpack, ninja, py-cpuinfo, psutil)
#   TRL side by side: trl, datasets, dill, multiprocess (the image has accelerate, pyarrow, pandas,
#                     xxhash, fsspec, huggingface-hub, httpx)
# Versions: those this project is tested with. Total ~20 MB (the carry limit is 64 MiB a call).
# Usage: bash bench/fetch_wheels.sh [extra NAME==VERSION ...]
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
PLAT="$PLAT --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
  typing_extensions==4.16.0 hjson==3.1.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 "$@"
# DeepSpeed publishes only an sdist: build its (pure-python) wheel here
if ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
fi
ls -la .whl
du -sh .whl
