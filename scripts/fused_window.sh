#!/usr/bin/env bash
# The fused decode kernels' H200 run (issue 12 items 2 and 6): `scripts/fused_window.sh check`
# installs the carried wheels, runs the conformance families the change touches on cuda (fused,
# ops; FUSED_FAMILIES overrides) and bench_model's batch-1 step for both shapes with the fused path
# on and off (XHAL_CUDA_FUSED) and with programmatic dependent launch (XHAL_CUDA_PDL=1);
# `scripts/fused_window.sh bench` runs bench_solutions (every implementation side by side, the
# read-kernel shapes, --tune). A short table of the step times comes last. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/xhal-gpu}; mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache PYTHONUNBUFFERED=1
mode=${1:-check}
status=0
if [ "$mode" = check ]; then
  fams=""
  for f in ${FUSED_FAMILIES:-fused ops}; do fams="$fams --family $f"; done
  CONF_ARGS="$fams" STAGE_TIMEOUT=${CONF_TIMEOUT:-150} bash scripts/gpu_run.sh conformance-cuda || status=1
  if [ -n "${TRITON_FUSED-1}" ]; then  # TRITON_FUSED= skips it; the Triton attention's forward_rotary too
    CONF_ARGS="--family fused" STAGE_TIMEOUT=${CONF_TIMEOUT:-150} bash scripts/gpu_run.sh conformance-cuda-triton || status=1
  fi
  # MODEL_RUNS: shape:variant pairs; fused / unfused (XHAL_CUDA_FUSED) / pdl (fused + XHAL_CUDA_PDL=1)
  for run in ${MODEL_RUNS:-llama3-8b:fused llama3-8b:unfused llama3-8b:pdl llama3.2-1b:fused llama3.2-1b:unfused}; do
    shape=${run%%:*} variant=${run#*:}
    case $variant in
      fused) envs="XHAL_CUDA_FUSED=1 XHAL_CUDA_PDL=0" ;;
      unfused) envs="XHAL_CUDA_FUSED=0 XHAL_CUDA_PDL=0" ;;
      pdl) envs="XHAL_CUDA_FUSED=1 XHAL_CUDA_PDL=1" ;;
      *) echo "unknown variant $variant"; status=1; continue ;;
    esac
    echo "=== bench_model $shape $variant ($envs) $(date +%T)"
    env $envs timeout -k 5 "${MODEL_TIMEOUT:-75}" python3 -m benchmarks.bench_model --shape "$shape" \
      --batches ${MODEL_BATCHES:-1} --no-hf --kernels 2>&1 | tee "$out/model-$shape-$variant.txt" || status=1
  done
else
  BENCH_ARGS=${BENCH_ARGS:---tune} STAGE_TIMEOUT=${BENCH_TIMEOUT:-270} bash scripts/gpu_run.sh bench_solutions || status=1
  cp "$out/bench_solutions.txt" "$out/bench_solutions.log" 2>/dev/null
fi
echo "=== summary ($mode)"
grep -h -E "^ceilings" "$out"/model-*.txt "$out"/bench_solutions.txt 2>/dev/null | head -3
for f in "$out"/model-*.txt; do
  [ -e "$f" ] || continue
  # the decode table's batch-1 row: pipelined ms and its ratio to the read floor; kernels per layer
  row=$(awk '/^decode step/{getline; getline; print; exit}' "$f")
  kern=$(grep -m1 -E "^--- kernels per step" "$f" | sed 's/.*step, //')
  layer=$(grep -m1 -E "per layer:" "$f" | sed 's/ *per layer: //')
  echo "$(basename "$f" .txt): $row | $kern | per layer $layer"
done
exit $status
