"""bench_solutions' table on a tiny config in Triton's interpreter: every op's every
implementation is built, agrees with its float32 reference, and gets a row with its floor; and
the check has teeth (a wrong implementation shows its error)."""

from __future__ import annotations

import torch

from benchmarks import bench_solutions as bs
from benchmarks.bench_model import CONFIG
from tests.support.triton_env import DEVICE

TINY = {
    **CONFIG,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
CEIL = {"read_bandwidth": 4e12, "flops": 8e14}


def _wall(run) -> float:  # the interpreter measures nothing; the rows only need a number
    run(1)
    return 1.0


def test_every_implementation_agrees_with_its_reference() -> None:
    torch.manual_seed(0)
    rows = [
        r for case in bs.op_cases(TINY, 1, CEIL, False, DEVICE) for r in bs.measure(case, _wall)
    ]
    impls = {(r["op"], r["impl"]) for r in rows}
    assert {("qkv", "cublas"), ("qkv", "triton_gemv"), ("qkv", "triton_stream")} <= impls
    assert {("norm+gate_up", "unfused"), ("norm+gate_up", "fused")} <= impls
    assert {("silu+down", "fused"), ("rotary+kv_write", "fused")} <= impls
    assert len(rows) == 4 * 3 + 2 * 2 + 2 + 2
    for r in rows:  # bf16 operands, float32 accumulation: a few units of bf16's 2^-8
        assert r["err"] < 3e-2, r
        assert r["floor_us"] > 0 and r["of_ceiling"] == r["floor_us"] / r["us"]
    # the projections' floors are their weight bytes over the read rate (batch 1 is read-bound)
    qkv = next(r for r in rows if r["op"] == "qkv")
    assert qkv["floor_us"] == (4 + 2 * 2) * 16 * 64 * 2 / CEIL["read_bandwidth"] * 1e6


def test_a_wrong_implementation_shows_its_error() -> None:
    ref = torch.ones(2, 8)
    case = bs.Case(
        "toy", 2, 1.0, ref, {"right": lambda i: ref.clone(), "wrong": lambda i: ref * 1.5}
    )
    errs = {r["impl"]: r["err"] for r in bs.measure(case, _wall)}
    assert errs == {"right": 0.0, "wrong": 0.5}
