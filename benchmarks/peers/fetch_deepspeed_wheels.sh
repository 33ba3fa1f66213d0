#!/usr/bin/env bash
# On a CPU machine with network and torch importable: build or download what DeepSpeed needs into .peer-wheels/
# (git-ignored), to carry to the GPU machine, which has no package index. There:
#   pip install --no-deps --target /tmp/dspkgs .peer-wheels/*.whl
#   PYTHONPATH=.:/tmp/dspkgs TORCH_EXTENSIONS_DIR=/tmp/ds_ext DS_SKIP_CUDA_CHECK=1 python3 benchmarks/peers/run.py ...
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.peer-wheels
mkdir -p "$out"
DS_BUILD_OPS=0 python -m pip wheel --no-deps --no-build-isolation -w "$out" deepspeed==0.19.8
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d "$out" \
    hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions
ls -la "$out"
