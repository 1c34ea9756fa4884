#!/usr/bin/env bash
# Issue 14's served check on a 2-GPU machine: xhal-serve on the Llama-3-8B-shaped dummy model
# (the same model at every TP size) at TP=1 on GPU 0, then at TP=2 (graphs and async scheduling,
# the CUDA defaults), each answering the same 16 greedy prompts of 16 tokens
# (benchmarks/served_ids.py); then the two runs' ids compared, and each server at concurrency 1
# under xhal-bench-serve (TPOT). Run after scripts/gpu_run.sh on the same machine (its wheels);
# results land in $OUT. SHAPE (llama3-8b) picks another benchmarks.make_dummy_model shape.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # no NVLink multicast (the device docs)
out=${OUT:-/tmp/xhal-gpu}; mkdir -p "$out"
dir=$(python3 -m benchmarks.make_dummy_model "/tmp/dummy-${SHAPE:-llama3-8b}" "${SHAPE:-llama3-8b}" | tail -1)
status=0
serve() {  # serve TP PORT: start, wait for health (or the server's death), fetch ids, bench, stop
  local tp=$1 port=$2 visible=0
  [ "$tp" -gt 1 ] && visible=$(seq -s, 0 $((tp - 1)))
  CUDA_VISIBLE_DEVICES=$visible python3 -m serve_cli --device cuda --model "$dir" --load-format dummy \
    --dtype bfloat16 --max-model-len 4096 --max-num-seqs 16 --tensor-parallel-size "$tp" \
    --port "$port" > "$out/tp_served_tp$tp.log" 2>&1 &
  local server=$! ready=0
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && { ready=1; break; }
    kill -0 $server 2>/dev/null || break  # the server died: say so now, not after the wait
    sleep 1
  done
  if [ $ready != 1 ]; then
    echo "xhal-serve at TP=$tp did not come up; last lines of its log:"; tail -40 "$out/tp_served_tp$tp.log"
    kill -TERM $server 2>/dev/null; wait $server; status=1; return
  fi
  python3 -m benchmarks.served_ids fetch "$out/ids_tp$tp.json" --base-url "http://127.0.0.1:$port" || status=1
  python3 -m benchmarks.bench_serve --base-url "http://127.0.0.1:$port" --token-ids --vocab-size 800 \
    --input-len 1024 --output-len 128 --num-prompts 8 --max-concurrency 1 --no-progress 2>&1 \
    | tee -a "$out/tp_served_bench.txt" || status=1
  kill -TERM $server; wait $server
}
serve 1 8201
serve 2 8202
if [ -f "$out/ids_tp1.json" ] && [ -f "$out/ids_tp2.json" ]; then
  python3 -m benchmarks.served_ids compare "$out/ids_tp1.json" "$out/ids_tp2.json" | tee "$out/tp_served_ids.txt"
fi
exit $status
