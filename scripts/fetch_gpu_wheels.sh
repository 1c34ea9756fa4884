#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton and nvcc but no network) into
# the ignored .whl/ folder: flashinfer-python 0.5.3 and its FFI, for CPython 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.12
ls -la .whl
