#!/usr/bin/env bash
# xhal-serve --device cuda on the Qwen3-30B-A3B-shaped random-weight MoE (--load-format dummy, the
# config bench_moe measures) under xhal-bench-serve at concurrency 1 and 32. Run it after
# scripts/gpu_run.sh on the same machine (that installs the carried wheels into /tmp/site), or
# without them (the CUDA platform then uses its Triton attention). Results land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache PYTHONUNBUFFERED=1
out=${OUT:-/tmp/xhal-gpu}; mkdir -p "$out"
dir=$(python3 -m benchmarks.make_dummy_model /tmp/dummy-qwen3-30b-a3b --moe | tail -1)
python3 -m serve_cli --device cuda --model "$dir" --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --max-num-seqs 32 --port 8101 > "$out/serve_moe.log" 2>&1 &
server=$!
ready=0
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:8101/health >/dev/null && { ready=1; break; }
  kill -0 $server 2>/dev/null || break  # the server died: say so now, not after the wait
  sleep 1
done
if [ $ready != 1 ]; then
  echo "xhal-serve did not come up; last lines of its log:"; tail -40 "$out/serve_moe.log"
  kill -TERM $server 2>/dev/null; exit 1
fi
status=0
for c in 1 32; do
  python3 -m benchmarks.bench_serve --base-url http://127.0.0.1:8101 --token-ids --vocab-size 800 \
    --input-len 1024 --output-len 128 --num-prompts $((c == 1 ? 8 : 64)) --max-concurrency $c \
    --no-progress 2>&1 | tee -a "$out/serve_moe_bench.txt" || status=1
done
kill -TERM $server; wait $server
exit $status
