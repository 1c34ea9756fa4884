#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, transformers and nvcc but no
# network) into the ignored .whl/ folder, for CPython 3.12 on x86-64: flashinfer-python 0.5.3 and
# its FFI, and what xhal-serve needs there (fastapi, pydantic, uvicorn, pyzmq; ~5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.12 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  annotated-doc==0.0.7 typing-inspection==0.4.5 uvicorn==0.54.0 pyzmq==27.3.0 opentelemetry-api==1.45.2
ls -la .whl
