#!/usr/bin/env bash
# One run on the GPU machine: install the carried wheels, then the stages named on the command
# line (default: conformance (cuda, cuda-triton), bench_gemv, bench_attention, bench_model); also
# serve, cpp_host (examples/cpp_host/bench_cuda.sh), conformance-<device>, pytest (PYTEST_ARGS),
# clocks (the batch-1 critical path and phase clocks), o_route (the MoE o projection fused with
# its router: bench_o_route, its conformance cases, the MoE step against it),
# overlap (XHAL_CUDA_OVERLAP's benchmark peers at batch 1: 1B, 8B, MoE), tp (issue 14, two GPUs:
# the collective family, bench_tp, scripts/tp_served.sh), skinny (the tensor-core
# skinny GEMM: bench_skinny_mma, its linear conformance cases, the 8B and 1B steps at 16 and 64 rows),
# solutions (the kernels chosen, checked against the pre-solution choices), tune (xhal-tune
# twice), tilelang (installs
# TileLang's wheels: scripts/tilelang_wheels.sh), prebuild (FlashInfer's JIT modules compiled side by side) and pack.
# Call with `.whl` carried; FlashInfer's JIT cache goes to .fi_cache/ (ignored) so later calls on a
# warm machine reuse it. `pack` bundles the compiled FlashInfer libraries into $OUT/fi_aot.tar.xz.*;
# put those parts in .fi_aot/ (ignored) and carry it too: they are unpacked as FlashInfer's AOT
# directory, so a fresh machine loads them instead of compiling. Results land in $OUT when set;
# a short summary of them (scripts/gpu_summary.py) comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_setup.sh  # the wheels, FlashInfer's AOT kernels, the environment
out=${OUT:-/tmp/xhal-gpu}; mkdir -p "$out"
py() { timeout -k 10 "${STAGE_TIMEOUT:-0}" python3 "$@"; }  # STAGE_TIMEOUT=N bounds each stage
stages=${*:-conformance bench_gemv bench_attention bench_model}
status=0
for stage in $stages; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tilelang) bash scripts/tilelang_wheels.sh install || status=1 ;;  # after the stash run (scripts/tilelang_wheels.sh)
    prebuild) py scripts/fi_prebuild.py 2>&1 | tee "$out/prebuild.txt" || status=1 ;;
    pack)  # every compiled module (<name>/<name>.so, the AOT layout), the ones unpacked above too
      find .fi_cache "$aot" -name '*.so' -path '*/cached_ops/*' -o -name '*.so' -path "$aot/*" 2>/dev/null \
        | while read -r so; do d=/tmp/fi_pack/$(basename "$so" .so); mkdir -p "$d"; [ -e "$d/${so##*/}" ] || cp "$so" "$d/"; done
      du -sh /tmp/fi_pack; XZ_OPT="-T16 -6" tar -cJ -C /tmp/fi_pack . | split -b 15M - "$out/fi_aot.tar.xz."
      ls -l "$out"/fi_aot.tar.xz.* ;;
    conformance)
      for dev in cuda cuda-triton; do
        py -m conformance_tests.cli --device $dev --report "$out/conformance-$dev.json" || status=1
      done ;;
    solutions)  # the kernels cuda and cuda-triton choose must be the pre-solution ones; host cost per call
      for dev in cuda cuda-triton; do
        py scripts/check_solutions.py --device $dev --expect-legacy 2>&1 | tee "$out/solutions-$dev.txt" || status=1
      done ;;
    tune)  # xhal-tune twice on the 8B shape for each linear solution of TUNE_LINEARS (default
      # "triton-tuned default": the tunable GEMV, then the default's skinny GEMM choice), batches
      # up to TUNE_MAX_BATCH (4): the second run of each times nothing
      dir=$(python3 -m benchmarks.make_dummy_model /tmp/dummy-llama3-8b llama3-8b | tail -1)
      for linear in ${TUNE_LINEARS:-triton-tuned default}; do
        for run in 1 2; do
          ( [ "$linear" = default ] || export XHAL_KERNEL_LINEAR=$linear
            XHAL_CACHE_DIR=/tmp/xhal-tune-cache py -m xhal.tools.tune_cli "$dir" --device cuda \
              --load-format dummy --max-batch ${TUNE_MAX_BATCH:-4} ) 2>&1 | tee -a "$out/tune.txt" || status=1
        done
      done ;;
    pytest)  # PYTEST_ARGS: e.g. "conformance_tests/test_attention_block.py --device cuda -x" (no -q:
      # the stage gives one, and a second drops pytest's summary line)
      py -m pytest -q ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.txt" || status=1 ;;
    conformance-*)  # CONF_ARGS narrows it, e.g. "--family attention" (FlashInfer's JIT is slow)
      py -m conformance_tests.cli --device "${stage#conformance-}" ${CONF_ARGS:-} --report "$out/$stage.json" || status=1 ;;
    cpp_host)  # examples/cpp_host built and run against the Python host (8B shape, random weights)
      timeout -k 10 "${STAGE_TIMEOUT:-0}" bash examples/cpp_host/bench_cuda.sh "$out" 2>&1 | tee "$out/cpp_host.txt" || status=1 ;;
    bench_*) py -m benchmarks.$stage ${BENCH_ARGS:-} 2>&1 | tee "$out/$stage.txt" || status=1 ;;
    overlap)  # XHAL_CUDA_OVERLAP's peers (benchmarks/pdl_variants.py), batch-1 steps, one process a model
      # OVERLAP_PEERS (e.g. auto-no-overlap) narrows the peers to those, the same for each model
      peers="auto-no-overlap auto-attn-early auto-overlap-attn-late auto-overlap-o auto-overlap-o-qkv"
      dense="$peers auto-overlap-mlp-shallow" moe="$peers auto-overlap-moe-down-early"
      [ -n "${OVERLAP_PEERS:-}" ] && dense=$OVERLAP_PEERS moe=$OVERLAP_PEERS
      for shape in llama3.2-1b llama3-8b; do
        py -m benchmarks.bench_model --shape $shape --batches 1 --no-hf \
          --pdl $dense 2>&1 | tee "$out/overlap-$shape.txt" || status=1
      done
      py -m benchmarks.bench_moe --batches 1 --no-hf --no-sweep --pdl-batches 1 \
        --pdl $moe 2>&1 | tee "$out/overlap-moe.txt" || status=1 ;;
    clocks)  # where a batch-1 layer's time goes (twenty-eighth session): the MoE and 1B steps with
      # the kernel profile's critical path and the split-KV / router phase clocks
      # (benchmarks/phase_clock.py), against CLOCK_PEERS (default: the o projection and router
      # in one launch, the merge by the last program alone, 64-key tiles, o not beside the
      # attention) and CLOCK_PEERS_1B (o's stream started late, not beside); the 8B step against
      # 64-key tiles; first the split-KV merge and tile tests (the spread merge's waiting runs
      # only on a GPU)
      py -m pytest -q tests/platforms/cuda/test_splitkv_merge.py \
        tests/platforms/cuda/test_splitkv_tiles.py 2>&1 | tail -3 | tee "$out/clocks-tests.txt" || status=1
      peers=${CLOCK_PEERS:-auto-o-route auto-no-spread auto-attn-64-key-tiles auto-no-overlap}
      py -m benchmarks.bench_moe --batches 1 --no-hf --no-sweep --pdl-batches 1 --phase-clock \
        --profile --pdl auto $peers 2>&1 | tee "$out/clocks-moe.txt" || status=1
      peers=${CLOCK_PEERS_1B:-auto-overlap-attn-late auto-no-overlap}
      py -m benchmarks.bench_model --shape llama3.2-1b --batches 1 --no-hf --phase-clock --kernels \
        --pdl auto $peers 2>&1 | tee "$out/clocks-1b.txt" || status=1
      py -m benchmarks.bench_model --shape llama3-8b --batches 1 --no-hf --phase-clock \
        --pdl auto auto-attn-64-key-tiles 2>&1 | tee "$out/clocks-8b.txt" || status=1 ;;
    o_route)  # the route entry (thirty-first session): checks, timings and phase marks against
      # the o GEMV + fused router, its conformance cases (both solutions), the MoE batch-1 step
      # against the auto-o-route peer
      py -m benchmarks.bench_o_route 2>&1 | tee "$out/o_route.txt" || status=1
      py -m pytest -q conformance_tests/test_moe.py -k linear_add --device cuda 2>&1 | tail -3 \
        | tee "$out/o_route-conformance.txt" || status=1
      py -m benchmarks.bench_moe --batches 1 --no-hf --no-sweep --pdl-batches 1 --profile \
        --pdl auto auto-o-route 2>&1 | tee "$out/o_route-moe.txt" || status=1 ;;
    skinny)  # the tensor-core skinny GEMM (benchmarks/bench_skinny_mma.py: its checks, its launch
      # shapes against cuBLAS; BENCH_ARGS narrows it), linear's conformance cases through it, the
      # 8B and 1B steps at SKINNY_BATCHES (16 64) with it where it timed faster (the default),
      # everywhere and nowhere, and the choices made (the tuning cache's skinny-mma-or-cublas);
      # SKINNY_WGMMA=1 adds the wgmma builds' sweep
      py -m benchmarks.bench_skinny_mma ${BENCH_ARGS:-} 2>&1 | tee "$out/skinny.txt" || status=1
      XHAL_CUDA_SKINNY_MMA=1 py -m pytest -q conformance_tests/test_ops.py conformance_tests/test_fused.py \
        --device cuda -k linear 2>&1 | tail -15 | tee -a "$out/skinny.txt" || status=1
      tuning=$(mktemp -d)  # bench_model with skinny_choice's log lines (each shape's timings)
      log_choices="import logging, runpy, sys; logging.basicConfig(level=logging.WARNING)
logging.getLogger('xhal.platforms.cuda.skinny_choice').setLevel(logging.INFO)
sys.argv[0] = 'bench_model'; runpy.run_module('benchmarks.bench_model', run_name='__main__')"
      for shape in llama3-8b llama3.2-1b; do
        XHAL_CACHE_DIR=$tuning py -c "$log_choices" --shape $shape --no-hf \
          --batches ${SKINNY_BATCHES:-16 64} --pdl auto-skinny-mma auto-no-skinny 2>&1 \
          | tee "$out/skinny-$shape.txt" || status=1
      done
      cat "$tuning"/tuning/*.json 2>&1 | tee "$out/skinny-choices.txt"
      if [ "${SKINNY_WGMMA:-0}" = 1 ]; then
        py -m benchmarks.bench_skinny_mma --wgmma --rows 16 64 2>&1 | tee "$out/skinny-wgmma.txt" || status=1
      fi ;;
    serve)  # xhal-serve --device cuda on random Llama-3-shaped models (SERVE_SHAPES, default both
      # the 3.2-1B and the 8B shapes), each at concurrency 1 and 64, under xhal-bench-serve;
      # prompt and output lengths SERVE_INPUT_LEN / SERVE_OUTPUT_LEN (default 1024 / 128); the
      # read ceiling first, so the summary sets concurrency 1's bytes per token against it
      py -m benchmarks.read_ceiling | tee -a "$out/serve_bench.txt"
      echo "=== serve lengths ${SERVE_INPUT_LEN:-1024} ${SERVE_OUTPUT_LEN:-128}" | tee -a "$out/serve_bench.txt"
      for shape in ${SERVE_SHAPES:-llama3.2-1b llama3-8b}; do
        dir=$(python3 -m benchmarks.make_dummy_model "/tmp/dummy-$shape" "$shape" | tail -1)
        python3 -m serve_cli --device cuda --model "$dir" --load-format dummy --dtype bfloat16 \
          --max-model-len 4096 --max-num-seqs 64 --port 8100 > "$out/serve-$shape.log" 2>&1 &
        server=$!
        for _ in $(seq 300); do curl -sf http://127.0.0.1:8100/health >/dev/null && break; sleep 1; done
        for c in 1 64; do
          echo "=== serve $shape concurrency $c" | tee -a "$out/serve_bench.txt"
          python3 -m benchmarks.bench_serve --base-url http://127.0.0.1:8100 --token-ids --vocab-size 800 \
            --input-len "${SERVE_INPUT_LEN:-1024}" --output-len "${SERVE_OUTPUT_LEN:-128}" \
            --num-prompts $((c == 1 ? 8 : 128)) --max-concurrency $c \
            --no-progress 2>&1 | tee -a "$out/serve_bench.txt" || status=1
        done
        kill -TERM $server; wait $server
      done ;;
    tp)  # issue 14 on a 2-GPU machine (nvidia-h200-x2): the collective family over NCCL with 2
      # ranks, then with the one-shot all-reduce (XHAL_CUDA_ONE_SHOT_ALLREDUCE); the 8B-shaped
      # step at TP=1 and TP=2 (benchmarks/bench_tp.py: floors, the all-reduce share, NCCL against
      # the one-shot all-reduce alone and in the step; BENCH_ARGS replaces its defaults); then
      # xhal-serve at TP=1 and TP=2 (scripts/tp_served.sh: greedy ids compared)
      export NCCL_NVLS_ENABLE=0
      py -m conformance_tests.cli --device cuda --family collective \
        --report "$out/conformance-cuda-nccl.json" || status=1
      XHAL_CUDA_ONE_SHOT_ALLREDUCE=1 py -m conformance_tests.cli --device cuda --family collective \
        --report "$out/conformance-cuda-one-shot.json" || status=1
      py -m benchmarks.bench_tp ${BENCH_ARGS:---shape llama3-8b --batches 1 64 --tp 1 2} 2>&1 \
        | tee "$out/bench_tp.txt" || status=1
      OUT=$out timeout -k 10 "${STAGE_TIMEOUT:-0}" bash scripts/tp_served.sh 2>&1 | tail -40 || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
python3 scripts/gpu_summary.py "$out"
exit $status
