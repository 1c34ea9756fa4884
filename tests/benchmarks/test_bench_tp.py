"""bench_tp on the CPU over gloo: each TP size in processes of its own builds the same model
(dummy weights) and the same context (the seeded caches), so TP=2's logits equal TP=1's; and
a rank's read bytes count its shards."""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from benchmarks import bench_tp
from models.loader import load_model
from tests.support.conformance_run import REPO, explain, suite_env
from xhal.layers import TensorParallel


def test_tp2_step_matches_tp1_on_the_cpu() -> None:
    cmd = [sys.executable, "-m", "benchmarks.bench_tp", "--device", "cpu", "--shape", "tiny",
           "--batches", "1", "3", "--tp", "1", "2", "--ctx", "64"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=suite_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, explain(proc)
    header, *rows = proc.stdout.strip().splitlines()[-5:]
    cells = [dict(zip(header.split(), re.split(r"\s{2,}", row.strip()))) for row in rows]
    assert [(c["tp"], c["batch"]) for c in cells] == [
        ("1", "1"), ("1", "3"), ("2", "1"), ("2", "3")
    ]  # fmt: skip
    for c in cells[2:]:
        assert float(c["logits_rel_diff"]) < 1e-5, explain(proc)
        assert c["argmax_equal"] == f"{c['batch']}/{c['batch']}", explain(proc)


def test_rank_read_bytes_count_the_ranks_shards(tmp_path) -> None:
    import json

    config = bench_tp.SHAPES_TP["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    whole = load_model(tmp_path, torch.float32, load_format="dummy", progress=False)
    half = load_model(
        tmp_path, torch.float32, tp=TensorParallel(1, 2), load_format="dummy", progress=False
    )
    # hidden 64, 4 heads of 16 over 2 KV heads, intermediate 128, vocab 256, 2 layers; a rank's
    # halves: qkv (64 + 2 * 32) x 64, o 64 x 64, gate_up 256 x 64, down 64 x 128; both norms whole
    layer = (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) // 2 + 2 * 64
    weights = 2 * layer + 64 + 256 // 2 * 64 + 64  # final norm, LM-head shard, one embedding row
    kv = 64 * 2 * 1 * 16 * 2 * 4  # ctx 64 x 2 layers x the rank's KV head x 16 dims, K and V
    got = bench_tp._rank_read_bytes(half, config, 1, 64, 2, torch.float32)
    assert got == weights * 4 + kv
    assert bench_tp._rank_read_bytes(whole, config, 1, 64, 1, torch.float32) > got
