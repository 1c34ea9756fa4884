"""The C++ host (examples/cpp_host) built with CMake and run on --device cpu: its greedy tokens
equal the Python executor's for the same prompts and schedule, each step makes one execute and
one compute_logits call on zero-copy tensors, and Python errors come back as clean failures.

Builds the example once per session (about a minute on a loaded two-core machine). Skipped when
cmake, a C++ compiler or pybind11 (``pip install -e '.[cpp-host]'``) is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import llama_gqa
from tests.support.paths import REPO

ROOT = REPO
SOURCE = ROOT / "examples" / "cpp_host"
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, MAX_MODEL_LEN = 16, 64, 8, 256
# three requests: two prompts start together, a longer one arrives at step 2 and is prefilled in
# chunks next to the others' decodes; they finish at different steps
REQUESTS = [(0, 4, [1, 5, 9, 13, 17]), (0, 3, [3, 4]), (2, 5, list(range(7, 27)))]
TOKEN_BUDGET = 8


@pytest.fixture(scope="module")
def host_binary(tmp_path_factory) -> Path:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if importlib.util.find_spec("pybind11") is None:
        missing.append("pybind11 (pip install -e '.[cpp-host]')")
    if missing:
        pytest.skip(f"building the C++ host needs {', '.join(missing)}")
    build = tmp_path_factory.mktemp("cpp_host_build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (
        ["cmake", "-S", str(SOURCE), "-B", str(build), *generator,
         f"-DPython3_EXECUTABLE={sys.executable}"],
        ["cmake", "--build", str(build)],
    ):
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return build / "xhal_cpp_host"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return llama_gqa(tmp_path_factory.mktemp("cpp_host_ckpt"))


def run_host(binary: Path, checkpoint: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [str(binary), "--model", str(checkpoint), "--python", sys.executable,
            "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
            "--max-num-seqs", str(MAX_SEQS), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-tokens-per-step", str(TOKEN_BUDGET)]
    for arrival, max_new, prompt in REQUESTS:
        args += ["--request", f"{arrival}:{max_new}:{','.join(map(str, prompt))}"]
    # one intra-op thread: spinning OpenMP workers on a loaded two-core machine slow a step
    # from milliseconds to a tenth of a second
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*args, *extra], check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=env,
    )


def parse_steps(stdout: str) -> list[tuple[str, list[tuple[int, int, int, bool]]]]:
    """Each step's kind and chunks (request, start, num_tokens, samples)."""
    steps = []
    for kind, chunks in re.findall(
        r"^step \d+ kind=(\w+) .*chunks=(\S*) sampled", stdout, re.MULTILINE
    ):
        parsed = [
            (int(r), int(start), int(n), star == "*")
            for r, start, n, star in re.findall(r"r(\d+):(\d+)\+(\d+)(\*?)", chunks)
        ]
        steps.append((kind, parsed))
    return steps


def parse_tokens(stdout: str) -> dict[int, list[int]]:
    return {
        int(r): [int(t) for t in toks.split()]
        for r, toks in re.findall(r"^tokens r(\d+):(.*)$", stdout, re.MULTILINE)
    }


def python_greedy(
    checkpoint: Path, steps: list[tuple[str, list[tuple[int, int, int, bool]]]], convention: str
) -> dict[int, list[int]]:
    """The Python executor run eagerly on the same schedule, inputs laid out by the Python
    host's path (xhal.adapter.to_xllm) with its own block assignment; argmax in torch."""
    from models.loader import load_model
    from xhal import platforms
    from xhal.adapter.to_xllm import to_xllm
    from xhal.executor import ExecutorConfig, ModelExecutor

    platform = platforms.get("cpu")
    model = load_model(checkpoint, "auto", platform.device(), progress=False)
    executor = ModelExecutor(
        model,
        platform,
        ExecutorConfig(
            dtype=torch.float32,
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_SEQS,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            metadata_convention=convention,
        ),
    )
    executor.bind_kv_caches(executor.allocate_kv_caches(NUM_BLOCKS))
    per_request = NUM_BLOCKS // len(REQUESTS)
    blocks = {r: list(range(r * per_request, (r + 1) * per_request)) for r in range(len(REQUESTS))}
    generated: dict[int, list[int]] = {r: [] for r in range(len(REQUESTS))}
    for _, chunks in steps:
        ids, positions, slots, q, kv, table, selected, sampled = [], [], [], [], [], [], [], []
        for r, start, n, samples in chunks:
            known = REQUESTS[r][2] + generated[r]
            ids += known[start : start + n]
            positions += range(start, start + n)
            slots += [
                blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(start, start + n)
            ]
            q.append(n)
            kv.append(start + n)
            table.append(blocks[r][: -(-(start + n) // BLOCK_SIZE)])
            if samples:
                selected.append(len(ids) - 1)
                sampled.append(r)
        view = to_xllm(
            q,
            kv,
            table,
            slots,
            convention,
            "cpu",
            block_size=BLOCK_SIZE if convention == "cuda" else None,
        )
        i32 = {"dtype": torch.int32}
        hidden = executor.execute(torch.tensor(ids, **i32), torch.tensor(positions, **i32), view)
        logits = executor.compute_logits(hidden, torch.tensor(selected, **i32))
        for r, token in zip(sampled, logits.argmax(-1).tolist()):
            generated[r].append(token)
    return generated


# staged: device fields in their own buffers filled by one copy a step and logits copied into
# C++'s buffer, the data path a GPU takes, run on the CPU
@pytest.mark.parametrize(
    ("convention", "staged"), [("cuda", False), ("npu", False), ("cuda", True)]
)
def test_cpp_host_matches_python_executor(host_binary, checkpoint, convention, staged):
    # the staged run also times the boundary (EMPTY steps, a no-op call) a few times
    extra = ["--staged", "--crossing-iters", "3"] if staged else []
    proc = run_host(host_binary, checkpoint, "--convention", convention, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    steps = parse_steps(out)
    kinds = {kind for kind, _ in steps}
    # prefill, chunked prefill and decode in one run, and batches that mix them
    assert {"PREFILL", "CHUNKED_PREFILL", "DECODE", "MIXED"} <= kinds, kinds
    finished_at = {
        r: max(i for i, (_, ch) in enumerate(steps) for c in ch if c[0] == r)
        for r in range(len(REQUESTS))
    }
    assert len(set(finished_at.values())) == len(REQUESTS), finished_at  # different steps

    tokens = parse_tokens(out)
    assert {r: len(t) for r, t in tokens.items()} == {r: n for r, (_, n, _) in enumerate(REQUESTS)}
    assert tokens == python_greedy(checkpoint, steps, convention)

    sampling_steps = sum(any(c[3] for c in ch) for _, ch in steps)
    summary = re.search(
        r"summary steps=(\d+) execute_calls=(\d+) compute_logits_calls=(\d+) "
        r"built_next_while_python_held_gil=(\d+)/\d+ zero_copy=(\w+)",
        out,
    )
    assert summary, out
    assert int(summary[1]) == int(summary[2]) == len(steps)  # one execute per step
    assert int(summary[3]) == sampling_steps  # one compute_logits per sampling step
    assert summary[5] == "ok"
    # every tensor handed over on step 0 is the C++ buffer itself
    checks = re.findall(
        r"^zero-copy (\w+) cpp=(0x[0-9a-f]+) python=(0x[0-9a-f]+) ok$", out, re.MULTILINE
    )
    assert {
        "host_slot",
        "input_ids",
        "positions",
        "slot_mapping",
        "block_table",
        "kv_seq_lens_host",
    } <= {name for name, _, _ in checks}
    assert all(cpp == python for _, cpp, python in checks)
    assert "gil-probe ok" in out
    if staged:
        assert re.search(
            r"^crossing iters=3 empty_execute_us_median=[0-9.]+ "
            r"empty_execute_prebuilt_views_us_median=[0-9.]+ ",
            out,
            re.MULTILINE,
        ), out


def test_unknown_device_is_a_python_error(host_binary, checkpoint):
    proc = run_host(host_binary, checkpoint, "--device", "no-such-device")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "python error" in proc.stderr and "no-such-device" in proc.stderr
    assert "cpu" in proc.stderr  # the registry's message lists the known platforms


def test_wrong_shape_is_a_python_error(host_binary, checkpoint):
    proc = run_host(host_binary, checkpoint, "--fault", "block-table-shape")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ValueError" in proc.stderr and "block_table has shape" in proc.stderr


def test_bad_arguments_fail_cleanly(host_binary, checkpoint):
    proc = run_host(host_binary, checkpoint, "--request", "0:2:1,999999")
    assert proc.returncode == 2 and "outside the vocabulary" in proc.stderr
    proc = run_host(host_binary, checkpoint, "--convention", "tpu")
    assert proc.returncode == 2 and "--convention expects cuda or npu" in proc.stderr


@pytest.mark.parametrize("threads", [0, 2])
def test_cpp_argmax_matches_torch(host_binary, tmp_path, threads):
    """Ragged vocabulary (not a multiple of the vector lanes), many ties, maxima at both ends."""
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 7, 1003
    logits = torch.randint(-20, 20, (rows, vocab), generator=generator).float() * 0.5
    logits[1, -1] = logits[2, 0] = 100.0
    logits[3] = 1.0  # all equal: the first index
    path = tmp_path / "logits.bin"
    path.write_bytes(logits.numpy().tobytes())
    proc = subprocess.run(
        [
            str(host_binary.with_name("argmax_check")),
            str(rows),
            str(vocab),
            str(path),
            str(threads),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == logits.argmax(-1).tolist()
