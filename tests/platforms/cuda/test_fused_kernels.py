"""The CUDA platform's fused decode kernels (``fused_gemv``, ``rotary_kv``) against float64
references, in Triton's interpreter on CPU (compiled where a GPU is present), with the conformance
fused family's tolerance; that tolerance rejects a GEMV that drops one K tile; and the fused
family itself passes on the interpreted kernels for one dtype (the whole family, every dtype, runs
on the GPU)."""

from __future__ import annotations

import pytest
import torch

from conformance_tests.test_fused import check_gemv, gemv_bound, norm_reference, silu_reference
from tests.support.triton_env import DEVICE
from xhal.layers.rotary import RotaryEmbedding
from xhal.platforms.cuda.kernels import fused_gemv, rotary_kv

F64 = torch.float64


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(DEVICE, dtype)


def _errors(values: list[float]):
    return values.append


# (M, K, N, config): the heuristic, forced K splits (the reduce carries the sum of squares), the
# TUNED tile shapes (fused_gemv_config) on K and N not multiples of their tiles, and weight tiles
# through TMA descriptors (tma, the sixth field), pipelined, split, and on N and K past the tiles
# (the descriptor reads zeros there; K a multiple of 16 bytes, as TMA needs)
CASES = [
    (1, 192, 40, None),
    (1, 320, 24, (8, 64, 2, 4, 2)),
    (3, 96, 17, (8, 32, 4, 4, 1)),
    (1, 1500, 23, (4, 1024, 1, 4, 1)),
    (1, 2100, 13, (8, 2048, 1, 8, 1)),
    (1, 1504, 23, (4, 256, 1, 4, 3, 1)),
    (2, 704, 9, (8, 64, 2, 4, 2, 1)),
    (1, 304, 11, (16, 64, 1, 4, 4, 1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n,config", CASES, ids=str)
def test_fused_gemvs_match_the_unfused_sequence(m, k, n, config, dtype) -> None:
    x, res = _rand(m, k, dtype=dtype, seed=0), _rand(m, k, dtype=dtype, seed=1)
    g, b = _rand(k, dtype=dtype, seed=2, scale=0.5), _rand(n, dtype=dtype, seed=3)
    w = _rand(n, k, dtype=dtype, seed=4, scale=k**-0.5)
    w64, errors = w.cpu().double(), []
    y, summed = fused_gemv.add_rms_norm_gemv(x, res, g, 1e-5, w, b, config=config)
    a, y_ref, summed_ref = norm_reference(x, res, g, 1e-5, w, b, dtype)
    check_gemv(y, a, w64, y_ref, dtype, _errors(errors))
    # the residual is x + residual rounded once (the interpreter truncates instead: 1 ulp)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23
    assert (summed.cpu().double() - summed_ref).abs().max() <= ulp * summed_ref.abs().max()
    gate_up = _rand(m, 2 * k, dtype=dtype, seed=5)
    a, y_ref = silu_reference(gate_up, w, b, dtype)
    check_gemv(
        fused_gemv.silu_and_mul_gemv(gate_up, w, b, config=config),
        a,
        w64,
        y_ref,
        dtype,
        _errors(errors),
    )
    plain_ref = x.cpu().double() @ w64.T
    check_gemv(
        fused_gemv.stream_gemv(x, w, config=config),
        x.cpu().double(),
        w64,
        plain_ref,
        dtype,
        _errors(errors),
    )


@pytest.mark.parametrize("key", sorted(fused_gemv.TUNED), ids=str)
def test_a_tuned_shape_applies_to_one_row_of_its_own_op_only(key) -> None:
    prologue, n, k = key
    tuned = fused_gemv.TUNED[key]
    assert fused_gemv.fused_gemv_config(1, n, k, 132, prologue) == tuned
    heuristic = fused_gemv.fused_gemv_config(1, n, k, 132, prologue, table={})
    two_rows = fused_gemv.fused_gemv_config(2, n, k, 132, prologue)
    assert two_rows == fused_gemv.fused_gemv_config(2, n, k, 132, prologue, table={})
    other = (prologue + 1) % 3
    if (other, n, k) not in fused_gemv.TUNED:
        assert fused_gemv.fused_gemv_config(1, n, k, 132, other) == fused_gemv.fused_gemv_config(
            1, n, k, 132, other, table={}
        )
    # the benchmarks' peer: the table before these rows
    previous = fused_gemv.PREVIOUS.get(key, heuristic)
    assert fused_gemv.fused_gemv_config(1, n, k, 132, prologue, table=fused_gemv.PREVIOUS) == (
        previous
    )


def test_a_tma_config_needs_aligned_weight_rows() -> None:
    x, w = _rand(1, 100, dtype=torch.bfloat16, seed=0), _rand(8, 100, dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        fused_gemv.stream_gemv(x, w, config=(4, 64, 1, 4, 2, 1))
    with pytest.raises(ValueError, match="tma 0 or 1"):
        fused_gemv.stream_gemv(x, w, config=(4, 64, 1, 4, 2, 2))


def test_the_fused_bound_rejects_a_gemv_that_drops_one_k_tile() -> None:
    """Computed in float64, no kernel: the tolerance is tight enough to see a lost tile of 64."""
    m, k, n = 1, 4096, 64
    dtype = torch.bfloat16
    a = _rand(m, k, dtype=dtype, seed=0).cpu().double()
    w = _rand(n, k, dtype=dtype, seed=1, scale=k**-0.5).cpu().double()
    y_ref = a @ w.T
    dropped = a[:, 64:] @ w[:, 64:].T  # the first tile of 64 missing
    assert ((dropped - y_ref).abs() > gemv_bound(a, w, y_ref, dtype)).float().mean() > 0.5


@pytest.mark.parametrize("is_neox,rotary_dim", [(True, 32), (False, 32), (True, 16)], ids=str)
def test_rotary_write_kv_rotates_q_and_writes_rotated_k_and_v(is_neox, rotary_dim) -> None:
    from conformance_tests import ops_reference as ref

    num_tokens, h, hkv, d, dtype = 3, 4, 2, 32, torch.bfloat16
    qkv = _rand(num_tokens, (h + 2 * hkv) * d, dtype=dtype, seed=0)  # q, k, v strided views
    q, k, v = (t.view(num_tokens, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    positions = torch.tensor([5, 0, 40], dtype=torch.int32, device=DEVICE)
    table = RotaryEmbedding(d, rotary_dim, 64, 10000.0, is_neox).cos_sin_cache.to(DEVICE)
    k_cache = _rand(4, 4, hkv, d, dtype=dtype, seed=1)
    v_cache = _rand(4, 4, hkv, d, dtype=dtype, seed=2)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, -1, 2], dtype=torch.int32, device=DEVICE)  # the middle token: padding
    q_out = rotary_kv.rotary_write_kv(positions, q, k, v, table, is_neox, k_cache, v_cache, slots)
    k_ref = ref.rotary_embedding(positions, k, table, is_neox)
    q_ref = ref.rotary_embedding(positions, q, table, is_neox)
    assert (
        ref.max_ulps(q_out, q_ref, dtype) <= 2
    )  # 1 ulp, and 1 more for the interpreter's truncation
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert ref.max_ulps(flat_k[[7, 2]], k_ref[[0, 2]], dtype) <= 2
    assert torch.equal(flat_v[[7, 2]], v[[0, 2]])
    untouched = [s for s in range(16) if s not in (7, 2)]
    assert torch.equal(flat_k[untouched], before_k.view(-1, hkv, d)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, hkv, d)[untouched])


def test_fused_family_passes_on_the_interpreted_kernels(tmp_path) -> None:
    """The conformance fused family with the kernels interpreted, float32 only (the interpreter
    takes minutes for every dtype; the GPU run covers them)."""
    from tests.support.conformance_run import explain, run_conformance

    proc, report = run_conformance(
        "cuda-fused-interpreted",
        "tests.support.triton_fused_interpreted_platform",
        tmp_path / "r.json",
        ("fused",),
        XHAL_FUSED_TEST_DTYPES="float32",
    )
    assert proc.returncode == 0 and report is not None, explain(proc)
    fam = report["families"]["fused"]
    assert fam["status"] == "passed" and fam["failed"] == 0 and fam["passed"] >= 20, explain(proc)


def test_qk_norm_kernel_norms_each_head_with_its_weight() -> None:
    """Qwen3-30B-A3B's 32 q and 4 k heads of 128 from a strided qkv row, against float64."""
    from conformance_tests import ops_reference as ref
    from xhal.platforms.cuda.kernels import qk_norm

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 40 * 128, generator=g).to(DEVICE)
    q, k = qkv[:, : 32 * 128], qkv[:, 32 * 128 : 36 * 128]
    q_weight, k_weight = (torch.rand(128, generator=g).to(DEVICE) + 0.5 for _ in range(2))
    assert qk_norm.supports(q, k, q_weight)
    q_out, k_out = qk_norm.qk_rms_norm(q, k, q_weight, k_weight, 1e-6)
    for out, x, w in ((q_out, q, q_weight), (k_out, k, k_weight)):
        expected = ref.rms_norm(x.reshape(-1, 128), w, 1e-6).reshape(2, -1)
        assert ref.max_error(out, expected) < 1e-5
