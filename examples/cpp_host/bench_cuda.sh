#!/usr/bin/env bash
# The C++ host against the Python host on the GPU machine: builds examples/cpp_host, then for
# each batch size runs xhal_cpp_host and bench_python_step.py on the same 8B-shaped random-weight
# model (--load-format dummy, bf16, decode graphs captured) and the same batch, and prints a table:
# the decode step time of each host, their ratio, and the C++ -> Python -> C++ crossing itself
# (an EMPTY execute from C++ with its views built each call and built once, and a no-op call,
# against the EMPTY execute called from Python).
#
#   bash examples/cpp_host/bench_cuda.sh [OUT_DIR]
#
# Settings (environment): BATCHES ("1 8"), PROMPT_LEN (512), DECODE_STEPS (64), DEVICE (cuda),
# MODEL (a directory; default: benchmarks.make_dummy_model's 8B shape), LOAD_FORMAT (dummy),
# PYTHON (python3), BUILD_DIR (/tmp/cpp_host_build). Run through scripts/gpu_run.sh cpp_host to
# get the wheels and PYTHONPATH that stage sets up.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/xhal-gpu}}
mkdir -p "$out"
py=$(command -v "${PYTHON:-python3}")
build=${BUILD_DIR:-/tmp/cpp_host_build}
device=${DEVICE:-cuda}
prompt=${PROMPT_LEN:-512}
steps=${DECODE_STEPS:-64}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
start=$(date +%s)
cmake -S examples/cpp_host -B "$build" "${generator[@]}" -DPython3_EXECUTABLE="$py" > "$out/cpp_host_cmake.txt"
cmake --build "$build" >> "$out/cpp_host_cmake.txt"
echo "built $build/xhal_cpp_host in $(( $(date +%s) - start )) s"
model=${MODEL:-$("$py" -m benchmarks.make_dummy_model /tmp/dummy-8b | tail -1)}
load_format=${LOAD_FORMAT:-dummy}

for b in ${BATCHES:-1 8}; do
  max_len=$(( (prompt + steps + 16 + 15) / 16 * 16 ))
  common=(--model "$model" --device "$device" --load-format "$load_format" --block-size 16
          --max-model-len "$max_len" --num-blocks $(( b * max_len / 16 )))
  "$build/xhal_cpp_host" "${common[@]}" --synthetic "$b:$prompt:$(( steps + 1 ))" --max-num-seqs "$b" \
    --max-tokens-per-step $(( b * prompt )) --quiet --crossing-iters 2000 | tee "$out/cpp_host_b$b.txt"
  "$py" examples/cpp_host/bench_python_step.py "${common[@]}" --batch "$b" --prompt-len "$prompt" \
    --decode-steps "$steps" | tee "$out/cpp_host_python_b$b.txt"
done

"$py" - "$out" ${BATCHES:-1 8} <<'PYEOF'
import re, sys
from pathlib import Path
out, batches = Path(sys.argv[1]), sys.argv[2:]
def grab(text, line, key):
    """The number after KEY= on the first line starting with LINE (nan when absent)."""
    m = re.search(rf"^{line}\b.*\b{key}=([0-9.]+)", text, re.M)
    return float(m[1]) if m else float("nan")
def first_tokens(text):
    m = re.search(r"^tokens r0:(.*)$", text, re.M)
    return m[1].split() if m else None
rows = []
for b in batches:
    cpp = (out / f"cpp_host_b{b}.txt").read_text()
    pyt = (out / f"cpp_host_python_b{b}.txt").read_text()
    c_step = grab(cpp, "decode-steps", "step_us_median")
    p_step = grab(pyt, "python-decode-steps", "step_us_median")
    same = first_tokens(cpp) is not None and first_tokens(cpp) == first_tokens(pyt)
    rows.append((b, c_step / 1e3, p_step / 1e3, c_step / p_step,
                 grab(cpp, "crossing", "empty_execute_us_median"),
                 grab(pyt, "python-decode-steps", "empty_execute_us_median"),
                 grab(cpp, "crossing", "noop_call_us_median"),
                 "yes" if same else "NO",
                 grab(cpp, "decode-steps", "python_us_median") / 1e3,
                 grab(cpp, "decode-steps", "argmax_us_median"),
                 grab(cpp, "crossing", "empty_execute_prebuilt_views_us_median")))
head = ("batch", "C++ step ms", "Python step ms", "C++/Python", "C++ EMPTY execute us",
        "C++ EMPTY execute, views prebuilt us", "Python EMPTY execute us", "C++ no-op call us", "same r0 tokens",
        "C++ step: in Python ms", "C++ step: argmax us")
print("--- C++ host vs Python host, decode step (median), and the boundary crossing")
print(" | ".join(head))
for r in rows:
    print(" | ".join([str(r[0]), f"{r[1]:.3f}", f"{r[2]:.3f}", f"{r[3]:.3f}x", f"{r[4]:.1f}",
                      f"{r[10]:.1f}", f"{r[5]:.1f}", f"{r[6]:.2f}", r[7], f"{r[8]:.3f}", f"{r[9]:.1f}"]))
PYEOF
