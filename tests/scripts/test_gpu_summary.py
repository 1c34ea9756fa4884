"""scripts/gpu_summary.py reads back what the benchmarks print (``benchmarks.common.table``) and the
conformance reports: a change to either format must not silently empty the summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from benchmarks.common import table
from tests.support.paths import REPO

# scripts/ is a folder of scripts, not a package: load gpu_summary.py by its path
_spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "scripts" / "gpu_summary.py")
gpu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_summary)


def test_summary_reads_reports_and_tables(tmp_path: Path) -> None:
    families = {"graph": {"passed": 30, "failed": 0, "skipped": 0, "max_error": 0.005}}
    (tmp_path / "conformance-cuda.json").write_text(
        json.dumps({"device": "cuda", "families": families})
    )
    decode = [
        {
            "batch": 1,
            "floor_ms": 3.85,
            "pipelined_ms": 4.75,
            "pipelined_x_floor": 1.23,
            "host_us": 245.0,
            "graph_speedup": 3.6,
        }
    ]
    peer = [{"batch": 1, "hf_eager_ms": 25.6, "xhal_graph_speedup_vs_hf_eager": 5.4}]
    attention = [
        {
            "path": "flashinfer-tc",
            "batch": 64,
            "ctx": 2048,
            "us": 143.0,
            "TB/s": 3.76,
            "of_copy_ceiling": 0.89,
        }
    ]
    (tmp_path / "bench_model.txt").write_text(
        "ceilings: ...\n"
        + table(decode, "decode step (execute + logits), llama3.2-1b shape, bf16")
        + "\n"
        + table(peer, "peer: Hugging Face transformers")
        + "\n"
    )
    (tmp_path / "bench_attention.txt").write_text(
        table(attention, "decode attention in a CUDA graph") + "\n"
    )
    (tmp_path / "serve_bench.txt").write_text(
        "P50 TTFT (ms)   29.36\nMean TPOT (ms)   4.74\nP50 TTFT (ms)   489.45\nMean TPOT (ms)   "
        "15.06\n"
    )
    lines = gpu_summary.conformance(tmp_path) + gpu_summary.benchmarks(tmp_path)
    text = "\n".join(lines)
    assert "cuda" in lines[0] and "graph" in lines[0] and "30 passed" in lines[0]
    assert "decode llama3.2-1b batch   1: pipelined 4.75 ms = 1.23x floor" in text
    assert "host 245" in text
    assert "5.4x (hf_eager)" in text
    assert "flashinfer-tc 64 x 2K: 143" in text and "0.89 of copy ceiling" in text
    assert "concurrency  1: TPOT 4.74 ms, TTFT p50 29.36" in text
    assert "concurrency 64: TPOT 15.06 ms" in text


def test_summary_reads_one_serve_run_per_shape_and_the_read_floor(tmp_path: Path) -> None:
    decode = [
        {
            "batch": 1,
            "floor_ms": 3.85,
            "read_floor_ms": 3.33,
            "pipelined_ms": 4.75,
            "pipelined_x_floor": 1.23,
            "pipelined_x_read_floor": 1.43,
            "host_us": 60.0,
            "graph_speedup": 3.6,
        }
    ]
    (tmp_path / "bench_model.txt").write_text(
        table(decode, "decode step (execute + logits), 8B") + "\n"
    )
    run = "P50 TTFT (ms)   {ttft}\nMean TPOT (ms)   {tpot}\nP50 ITL (ms)   {itl}\n"
    (tmp_path / "serve_bench.txt").write_text(
        "=== serve llama3.2-1b concurrency 1\n"
        + run.format(ttft=9.1, tpot=1.2, itl=1.1)
        + "=== serve llama3.2-1b concurrency 64\n"
        + run.format(ttft=90.5, tpot=5.5, itl=5.0)
        + "=== serve llama3-8b concurrency 1\n"
        + run.format(ttft=30.0, tpot=4.7, itl=4.6)
    )
    text = "\n".join(gpu_summary.benchmarks(tmp_path))
    assert "1.23x floor (1.43x read floor)" in text
    assert "llama3.2-1b concurrency  1: TPOT 1.2 ms, TTFT p50 9.1 ms, ITL p50 1.1 ms\n" in text
    assert "llama3.2-1b concurrency 64: TPOT 5.5 ms" in text
    assert "llama3-8b concurrency  1: TPOT 4.7 ms, TTFT p50 30.0 ms, ITL p50 4.6 ms" in text
    # with the read ceiling and the lengths the serve stage prints first: the 1B shape's 2.47 GB
    # of weights and 32 KB of KV a token at the mean context of 1,024 + 64, over the ITL
    (tmp_path / "serve_bench.txt").write_text(
        "=== read ceiling 4.33 TB/s\n=== serve lengths 1024 128\n"
        + "=== serve llama3.2-1b concurrency 1\n"
        + run.format(ttft=12.6, tpot=0.96, itl=0.95)
    )
    text = "\n".join(gpu_summary.benchmarks(tmp_path))
    assert "ITL p50 0.95 ms = 2.51 GB/token at 2.64 TB/s, 61% of the read ceiling" in text


def test_summary_of_an_empty_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_summary.py", str(tmp_path)])
    gpu_summary.main()
    assert "no results" in capsys.readouterr().out


def test_summary_reads_the_skinny_gemm_table_as_bench_skinny_mma_prints_it(tmp_path: Path) -> None:
    best = [
        {
            "projection": "8b qkv", "rows": 64, "cuBLAS us": 16.5, "cuBLAS of read": 0.73,
            "best": "64x6 ks8 s4 (plan)", "best us": 13.1, "best of read": 0.92,
            "cuBLAS / best": 1.26,
        }
    ]  # fmt: skip
    text = "8b o 4096x4096 | 64 | cuBLAS | 12.4 | 0.65 | 3.1e-03\n"  # the per-variant lines
    (tmp_path / "bench_skinny_mma.txt").write_text(
        text + table(best, "best launch shape against cuBLAS") + "\n"
    )
    lines = gpu_summary.benchmarks(tmp_path)
    assert lines == [
        "skinny GEMM 8b qkv x 64 rows: cuBLAS 16.5 us (0.73 of read), 64x6 ks8 s4 (plan) 13.1 us"
        " (0.92), cuBLAS / best 1.26"
    ]


def test_summary_reads_bench_tp_and_the_served_ids(tmp_path: Path) -> None:
    rows = [
        {"tp": 1, "batch": 1, "step_ms": 4.2, "read_floor_ms": 3.5, "x_read_floor": 1.2,
         "allreduce_ms": 0.0, "allreduce_share": 0.0, "one_shot_ms": "one rank",
         "logits_rel_diff": 0.0, "argmax_equal": "1/1", "one_shot_step_ms": "-"},
        {"tp": 2, "batch": 1, "step_ms": 2.6, "read_floor_ms": 1.75, "x_read_floor": 1.49,
         "allreduce_ms": 0.41, "allreduce_share": 0.158, "one_shot_ms": 0.22,
         "logits_rel_diff": 0.004, "argmax_equal": "1/1", "one_shot_step_ms": 2.45},
    ]  # fmt: skip
    (tmp_path / "bench_tp.txt").write_text(
        "ceilings: ...\n" + table(rows, "decode step, llama3-8b shape, ctx 2048, cuda; ...")
    )
    (tmp_path / "tp_served_ids.txt").write_text(
        "greedy ids equal for 15 of 16 prompts (ids_tp1.json vs ids_tp2.json)\n  prompt 3: ...\n"
    )
    lines = gpu_summary.benchmarks(tmp_path)
    assert lines == [
        "TP=1 batch   1: step 4.2 ms = 1.2x read floor, all-reduces 0 ms (0 of it), one-shot "
        "alone one rank, step with it -; logits vs the first TP size 0, argmax 1/1",
        "TP=2 batch   1: step 2.6 ms = 1.49x read floor, all-reduces 0.41 ms (0.158 of it), "
        "one-shot alone 0.22, step with it 2.45; logits vs the first TP size 0.004, argmax 1/1",
        "xhal-serve greedy ids equal for 15 of 16 prompts (ids_tp1.json vs ids_tp2.json)",
    ]


def test_conformance_runs_of_one_device_are_named_by_their_report(tmp_path: Path) -> None:
    families = {"collective": {"passed": 12, "failed": 0, "skipped": 0}}
    for name in ("cuda-nccl", "cuda-one-shot"):
        (tmp_path / f"conformance-{name}.json").write_text(
            json.dumps({"device": "cuda", "families": families})
        )
    assert [line.split()[1] for line in gpu_summary.conformance(tmp_path)] == [
        "cuda-nccl",
        "cuda-one-shot",
    ]
