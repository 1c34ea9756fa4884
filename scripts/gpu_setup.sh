# Sourced by the GPU-machine scripts (gpu_run.sh, serve_loop_h200.sh) from the repository root:
# installs the carried wheels (.whl/) into /tmp/site once per machine, unpacks FlashInfer's
# compiled kernels (.fi_aot/) as its AOT directory when carried, and exports the environment the
# stages run in.
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
fi
aot=/tmp/site/flashinfer/data/aot
if ls .fi_aot/fi_aot.tar.xz.* >/dev/null 2>&1 && [ ! -d "$aot" ]; then
  mkdir -p "$aot" && cat .fi_aot/fi_aot.tar.xz.* | tar -xJ -C "$aot" && echo "FlashInfer AOT: $(ls "$aot" | wc -l) modules"
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache
export MAX_JOBS=16 PYTHONUNBUFFERED=1
