#!/usr/bin/env bash
# Issue 11's served 1B target in one GPU call (carry .whl and .fi_aot): xhal-serve --device cuda
# on the random Llama-3.2-1B shape, 512-token prompts, 256 out, at concurrency 1 (8 prompts) and
# 64 (128), as `gpu_run.sh serve` runs them, with the CPU time per output token of the API
# process, the engine process and the client (bench_serve --server-pid); then, unless
# LOOP_STEPS=0, the served loop's per-stage host time on the device with the real executor and
# the server's settings (bench_host_stages --device cuda --batch 1, its launching torch ops
# listed by stage). SERVE_CONCURRENCY (default "1 64") and SERVE_MAX_SEQS (default 64) narrow
# it; LABEL names the tree in the loop table (a copied tree has no git of its own). Results in
# $OUT; a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_setup.sh  # the wheels, FlashInfer's AOT kernels, the environment
out=${OUT:-/tmp/xhal-gpu}; mkdir -p "$out"
bound=${STAGE_TIMEOUT:-150}
dir=$(python3 -m benchmarks.make_dummy_model /tmp/dummy-llama3.2-1b llama3.2-1b | tail -1)
python3 -m serve_cli --device cuda --model "$dir" --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --max-num-seqs "${SERVE_MAX_SEQS:-64}" --port 8100 > "$out/serve-llama3.2-1b.log" 2>&1 &
server=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8100/health >/dev/null && break; sleep 0.5; done
echo "server up at $(date +%T)"
status=0
for c in ${SERVE_CONCURRENCY:-1 64}; do
  echo "=== serve llama3.2-1b concurrency $c" | tee -a "$out/serve_bench.txt"
  timeout -k 5 "$bound" python3 -m benchmarks.bench_serve --base-url http://127.0.0.1:8100 \
    --token-ids --vocab-size 800 --input-len 512 --output-len 256 --num-prompts $((c == 1 ? 8 : 128)) \
    --max-concurrency $c --no-progress --server-pid $server 2>&1 | tee -a "$out/serve_bench.txt" || status=1
done
kill -TERM $server; wait $server
if [ "${LOOP_STEPS:-200}" != 0 ]; then
  timeout -k 5 "$bound" python3 -m benchmarks.bench_host_stages --device cuda --model "$dir" \
    --load-format dummy --dtype bfloat16 --batch 1 --prompt-len 512 --loop-steps "${LOOP_STEPS:-200}" \
    --max-num-seqs "${SERVE_MAX_SEQS:-64}" --max-model-len 4096 --prefix-caching \
    --no-stages --launches --label "${LABEL:-this tree}" 2>&1 \
    | grep -v "it/s\]" | tee "$out/host_stages.txt" || status=1
fi
echo "=== summary"
grep -E "^=== serve|Mean TPOT|P50 ITL|Output token throughput|^  (server|client|child)" "$out/serve_bench.txt"
exit $status
