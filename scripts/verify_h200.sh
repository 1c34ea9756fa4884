#!/usr/bin/env bash
# A merged tree's verification on one H200 (carry `.whl` and `.fi_aot`): the stages named on the
# command line (default all, in this order), each bounded by its *_TIMEOUT so one slow stage cannot
# eat the rest; every stage's log and the conformance report come back under $OUT.
#   conformance   every conformance family on cuda (every registered solution)
#   model-8b      the 8B-shaped decode step at batch 1 and 64 with its kernel profile
#   model-8b-fi   the same at batch 1 with FlashInfer's decode attention forced (the peer of the
#                 default's split-KV kernel: XHAL_KERNEL_PAGED_DECODE_ATTENTION=flashinfer)
#   model-1b, model-1b-fi   the Llama-3.2-1B shape at batch 1, likewise
#   moe           the Qwen3-30B-A3B-shaped MoE step at batch 1, 16 and 64
#   solutions     every implementation of every decode op (bench_solutions)
#   pdl-1b, pdl-8b, pdl-moe   programmatic dependent launch off / early / late / auto (--pdl): the 1B
#                 shape at batch 1, the 8B shape at batch 1 and 64, the MoE shape at batch 1, each
#                 setting's graphs captured and timed in one process, kernels per layer
#   pdl-conformance  the fused, graph, ops and attention families with XHAL_CUDA_PDL=1
#   host          host time inside execute per graph decode step (bench_host_step: 8B and 1B
#                 shapes, batch 1 and 64, five repeats, idle / spun / busy / in-flight entries)
#   serve         xhal-serve on the random 1B and 8B shapes at concurrency 1 and 64 (gpu_run.sh serve)
#   gemv          the batch-1 stream GEMVs, previous launch shapes against wider tiles and cuBLAS
#                 (bench_decode_gemv; GEMV_JSON=FILE writes the winners, which
#                 BENCH_GEMV_TABLE=FILE then loads into the model benchmarks' executors)
#   gemv-1b, gemv-8b, gemv-moe  batch-1 steps with the tree's GEMVs against the previous ones
#                 (--pdl auto auto-previous-gemv: both captured and timed in one process)
#   activation    the gated activation on the 8B / 1B decode shapes: Triton, FlashInfer's and the
#                 torch sequence, checked against float64, then timed (bench_activation)
#   act-8b        the 8B step at batch 1, 16 and 64 with the Triton activation against the torch
#                 sequence (--pdl auto auto-torch-activation, one process), kernels per layer,
#                 and every kernel of the eager steps by module and op (--trace)
# Split the stages over two calls where one call's time limit is short, e.g.
# `scripts/verify_h200.sh conformance model-8b model-8b-fi model-1b`, then `... moe solutions`.
set -uo pipefail
cd "$(dirname "$0")/.."
root=/tmp/xhal-verify
status=0
stage() {  # stage NAME TIMEOUT [ENV=VALUE ...] -- GPU_RUN_STAGE [BENCH_ARGS]
  local name=$1 timeout=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local what=$1; shift
  echo "=== $name ($(date +%T))"
  env "${envs[@]}" OUT="$root/$name" STAGE_TIMEOUT="$timeout" BENCH_ARGS="$*" \
    bash scripts/gpu_run.sh "$what" > "$root/$name.log" 2>&1 || status=1
  tail -n 15 "$root/$name.log"
  # few files come back from a device call: one log, appended stage by stage so a call cut at
  # its time limit still brings back the stages it finished
  [ -n "${OUT:-}" ] && { echo "##### $root/$name.log"; cat "$root/$name.log"; } >> "$OUT/verify.log"
}
mkdir -p "$root"
model="--no-hf --kernels"
fi=XHAL_KERNEL_PAGED_DECODE_ATTENTION=flashinfer
pdl=${PDL_VARIANTS:-off early late auto}  # the --pdl settings of the pdl-* stages
for name in ${*:-conformance model-8b model-8b-fi model-1b model-1b-fi moe solutions}; do
  case $name in
    conformance) stage $name "${CONF_TIMEOUT:-240}" -- conformance-cuda ;;
    model-8b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3-8b --batches 1 64 $model ;;
    model-8b-fi) stage $name "${MODEL_TIMEOUT:-90}" $fi -- bench_model --shape llama3-8b --batches 1 $model ;;
    model-1b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3.2-1b --batches 1 $model ;;
    model-1b-fi) stage $name "${MODEL_TIMEOUT:-90}" $fi -- bench_model --shape llama3.2-1b --batches 1 $model ;;
    moe) stage $name "${MOE_TIMEOUT:-150}" -- bench_moe --batches 1 16 64 --no-hf --no-sweep --profile ;;
    solutions) stage $name "${SOLUTIONS_TIMEOUT:-240}" -- bench_solutions ;;
    pdl-1b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3.2-1b --batches 1 $model --pdl $pdl ;;
    pdl-8b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3-8b --batches 1 64 $model --pdl $pdl ;;
    pdl-moe) stage $name "${MOE_TIMEOUT:-150}" -- bench_moe --batches 1 --no-hf --no-sweep --profile --pdl $pdl ;;
    host) stage $name "${HOST_TIMEOUT:-150}" -- bench_host_step --shapes llama3-8b llama3.2-1b --parts ;;
    serve) stage $name "${SERVE_TIMEOUT:-400}" -- serve ;;
    pdl-conformance) stage $name "${CONF_TIMEOUT:-240}" XHAL_CUDA_PDL=1 \
      CONF_ARGS="${PDL_FAMILIES:---family fused --family graph --family ops --family attention}" -- conformance-cuda ;;
    gemv) stage $name "${GEMV_TIMEOUT:-120}" -- bench_decode_gemv ${GEMV_JSON:+--json $GEMV_JSON} ;;
    gemv-1b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3.2-1b --batches 1 $model --pdl auto auto-previous-gemv ;;
    gemv-8b) stage $name "${MODEL_TIMEOUT:-90}" -- bench_model --shape llama3-8b --batches 1 $model --pdl auto auto-previous-gemv ;;
    gemv-moe) stage $name "${MOE_TIMEOUT:-150}" -- bench_moe --batches 1 --no-hf --no-sweep --profile --pdl auto auto-previous-gemv ;;
    activation) stage $name "${MODEL_TIMEOUT:-90}" -- bench_activation ;;
    act-8b) stage $name "${ACT_TIMEOUT:-150}" -- bench_model --shape llama3-8b --batches 1 16 64 $model --trace --pdl auto auto-torch-activation ;;
    *) echo "unknown stage $name (conformance model-8b model-8b-fi model-1b model-1b-fi moe solutions pdl-1b pdl-8b pdl-moe pdl-conformance host serve gemv gemv-1b gemv-8b gemv-moe activation act-8b)"; exit 2 ;;
  esac
done
if [ -n "${OUT:-}" ]; then  # and the conformance reports
  cp "$root"/conformance/conformance-cuda.json "$OUT/" 2>/dev/null
  cp "$root"/pdl-conformance/conformance-cuda.json "$OUT/conformance-cuda-pdl.json" 2>/dev/null
fi
exit $status
