#!/usr/bin/env bash
# Download TileLang 0.1.15 and the dependencies the GPU machine lacks (CPython 3.12, x86-64;
# ~80 MB) into two ignored folders, because one run carries at most 64 MiB:
#   .tl_whl1/  tilelang, ml-dtypes, torch-c-dlpack-ext, cloudpickle, psutil (53 MiB): run 1 carries
#              it alone (no .whl/, no .fi_aot/) and stashes it in the home
#              directory (`bash scripts/tilelang_wheels.sh stash`), which survives while the
#              machine stays warm (~30 s idle);
#   .tl_whl2/  z3-solver (28 MiB): run 2
#              carries it beside .whl/ (which has apache-tvm-ffi 0.1.12, shared with FlashInfer)
#              and installs both halves (`bash scripts/gpu_run.sh tilelang ...`).
# tilelang's own requirements (its METADATA): apache-tvm-ffi>=0.1.11,<0.1.13, torch-c-dlpack-ext,
# cloudpickle, ml-dtypes, numpy, psutil, torch, tqdm, typing-extensions, z3-solver>=4.13,<4.15.5;
# the machine has numpy, torch, tqdm and typing-extensions already (ml-dtypes 0.5.4 takes numpy 1.26+
# or 2.x; 0.7 would need numpy 2).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tl_whl1 .tl_whl2
get() {
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}
get .tl_whl1 tilelang==0.1.15 ml-dtypes==0.5.4 torch-c-dlpack-ext==0.1.5 cloudpickle==3.1.3 psutil==7.2.2
get .tl_whl2 z3-solver==4.15.4.0
ls .whl/apache_tvm_ffi-0.1.12-*.whl >/dev/null 2>&1 || echo "note: run scripts/fetch_gpu_wheels.sh too (apache-tvm-ffi 0.1.12 lives in .whl/)"
du -sh .tl_whl1 .tl_whl2
