"""Fused ops family: ``add_rms_norm_linear``, ``silu_and_mul_linear`` and an attention backend's
``forward_rotary`` against float64 references of the unfused definition (``ops_reference``:
independent of every implementation), for each declared dtype, on strided inputs, eagerly and in
a captured graph whose inputs change before the replay.

Tolerance of a fused GEMV output, per element, for ``y = a @ W.T (+ b)`` where ``a`` is the
unfused sequence's input to the projection (the normed rows, or ``silu(gate) * up``) rounded to
the dtype as that sequence stores it:

    |y - y_ref| <= ulp(y_ref) + 4 u sqrt(sum_k (W_nk a_k)^2) + (K / 64 + 16) 2^-24 sum_k |W_nk a_k|

- ``ulp(y_ref)``: the output's own rounding (the ops family's 1-ulp rule; float32: 2^-20 |y|).
- ``4 u sqrt(...)``, u the dtype's unit roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32): a fused
  kernel may skip rounding ``a`` to the dtype (or round it from a float32 value a bit off the
  exact one): each element then differs by at most u |a_k|, with signs that do not conspire, so
  the sum of K such terms has a standard deviation of at most u sqrt(sum (W a)^2) / sqrt(3); four
  times that is more than 6 deviations. A kernel that drops one K tile of 64 is off by about
  sqrt(64 / K) of the norm, 8x (K = 4096) to 60x (K = 64) the bound in bf16.
- the last term: float32 accumulation in any blocked order (at most K / 64 sequential steps and a
  reduction tree), the usual ``steps * 2^-24 * sum |terms|`` bound.

The new residual of ``add_rms_norm_linear`` is an op output of its own: the 1-ulp rule applies.
``forward_rotary``: written cache rows within 1 ulp of the float64 rotation (values exactly),
every other slot untouched, and the output within the attention family's tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from conformance_tests import ops_reference as ref
from conformance_tests import reference as attn_ref
from conformance_tests.batches import declared_head_dim, random_batch, random_caches, spec_or_skip
from conformance_tests.coverage import dtype_name
from conformance_tests.ops_family import _platform_ops_active, pytest_generate_tests  # noqa: F401
from conformance_tests.tolerances import tolerance
from xhal import ops
from xhal.interfaces import BatchKind

F64 = torch.float64
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rand(
    *shape: int, dtype: torch.dtype, device, scale: float = 1.0, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU so every device sees the same values
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(device, dtype)


def gemv_bound(
    a: torch.Tensor, w: torch.Tensor, y_ref: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The module docstring's per-element bound for ``y = a @ w.T (+ b)``; a, w float64."""
    k = a.shape[-1]
    terms_sq = (a * a) @ (w * w).T  # sum_k (W a)^2: [M, N]
    terms_abs = a.abs() @ w.abs().T
    if dtype in ref.ULP_BITS:
        rounded = y_ref.to(dtype).to(F64)
        exponent = torch.floor(torch.log2(rounded.abs().clamp_min(ref.ULP_FLOOR)))
        ulp = torch.exp2(exponent - (ref.ULP_BITS[dtype] - 1))
    else:
        ulp = y_ref.abs() * 2.0**-20 + 1e-7
    return ulp + 4 * _UNIT_ROUNDOFF[dtype] * terms_sq.sqrt() + (k / 64 + 16) * 2.0**-24 * terms_abs


def check_gemv(out, a, w, y_ref, dtype, record_error) -> None:
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected the input's {dtype}"
    err = (out.detach().to("cpu", F64) - y_ref).abs()
    record_error(float(err.max()))
    bound = gemv_bound(a, w, y_ref, dtype)
    worst = float((err / bound).nan_to_num(float("inf")).max())
    assert worst <= 1.0, (
        f"{worst:.2f}x the fused-GEMV bound (max error {float(err.max()):.3e}): a fused kernel "
        f"must "
        "match the unfused sequence up to one skipped rounding of the projection's input"
    )


def check_residual(out, expected, dtype, record_error) -> None:
    record_error(ref.max_error(out, expected))
    if dtype in ref.ULP_BITS:
        ulps = ref.max_ulps(out, expected, dtype)
        assert ulps <= ref.ULPS, (
            f"new residual {ulps:.1f} ulp from x + residual rounded once to {dtype}"
        )
    else:
        assert ref.max_error(out, expected) <= tolerance("ops", dtype)


def norm_reference(x, res, g, eps, w, b, dtype):
    """The unfused sequence in float64: (the projection's input a, y, the new residual)."""
    normed, summed = ref.fused_add_rms_norm(x, res, g, eps)
    a = normed.to(dtype).to(F64)  # rms_norm's output, stored in the dtype
    y = a @ w.detach().to("cpu", F64).T
    if b is not None:
        y = y + b.detach().to("cpu", F64)
    return a, y, summed


def silu_reference(x, w, b, dtype):
    a = ref.silu_and_mul(x).to(dtype).to(F64)  # silu_and_mul's output, stored in the dtype
    y = a @ w.detach().to("cpu", F64).T
    if b is not None:
        y = y + b.detach().to("cpu", F64)
    return a, y


# (M, K, N): decode rows (where a platform swaps in its fused kernel) and a few more; sizes off
# powers of 2 and a K that needs split-K on a GPU
CASES = [(1, 256, 96), (1, 1040, 64), (2, 200, 72), (4, 520, 136), (3, 64, 40)]


def _norm_inputs(m, k, n, bias, dtype, device, seed=0):
    x = rand(m, k, dtype=dtype, device=device, seed=seed)
    res = rand(m, k, dtype=dtype, device=device, seed=seed + 1)
    g = rand(k, dtype=dtype, device=device, scale=0.5, seed=seed + 2)
    w = rand(n, k, dtype=dtype, device=device, scale=k**-0.5, seed=seed + 3)
    b = rand(n, dtype=dtype, device=device, seed=seed + 4) if bias else None
    return x, res, g, w, b


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", CASES, ids=str)
def test_add_rms_norm_linear(m, k, n, bias, dtype, device, record_error, record_coverage) -> None:
    x, res, g, w, b = _norm_inputs(m, k, n, bias, dtype, device)
    y, summed = ops.add_rms_norm_linear(x, res, g, 1e-5, w, b)
    a, y_ref, summed_ref = norm_reference(x, res, g, 1e-5, w, b, dtype)
    check_gemv(y, a, w.detach().to("cpu", F64), y_ref, dtype, record_error)
    check_residual(summed, summed_ref, dtype, record_error)
    record_coverage(f"ops dtype {dtype_name(dtype)}")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", CASES, ids=str)
def test_silu_and_mul_linear(m, k, n, bias, dtype, device, record_error) -> None:
    x = rand(m, 2 * k, dtype=dtype, device=device)
    w = rand(n, k, dtype=dtype, device=device, scale=k**-0.5, seed=1)
    b = rand(n, dtype=dtype, device=device, seed=2) if bias else None
    a, y_ref = silu_reference(x, w, b, dtype)
    check_gemv(
        ops.silu_and_mul_linear(x, w, b), a, w.detach().to("cpu", F64), y_ref, dtype, record_error
    )


def test_fused_linears_take_strided_inputs(dtype, device, record_error) -> None:
    """x and residual as slices of wider rows, the gate | up input as a slice of a fused output."""
    k, n = 200, 48
    wide = rand(2, 3 * k, dtype=dtype, device=device)
    x, res = wide[:, :k], wide[:, 2 * k :]  # rows 3k apart
    g = rand(k, dtype=dtype, device=device, seed=5)
    w = rand(n, k, dtype=dtype, device=device, scale=k**-0.5, seed=6)
    y, summed = ops.add_rms_norm_linear(x, res, g, 1e-6, w)
    a, y_ref, summed_ref = norm_reference(x, res, g, 1e-6, w, None, dtype)
    check_gemv(y, a, w.detach().to("cpu", F64), y_ref, dtype, record_error)
    check_residual(summed, summed_ref, dtype, record_error)
    gate_up = wide[:, : 2 * k]  # rows 3k apart
    a, y_ref = silu_reference(gate_up, w, None, dtype)
    check_gemv(
        ops.silu_and_mul_linear(gate_up, w),
        a,
        w.detach().to("cpu", F64),
        y_ref,
        dtype,
        record_error,
    )


@pytest.mark.parametrize("m,k,n", [c for c in CASES if c[0] <= 2], ids=str)
def test_fused_linears_in_a_graph(m, k, n, platform, dtype, device, record_error) -> None:
    """Decode steps run these captured, where a platform picks its fused kernels: the replay
    must read the inputs as they are at replay time."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    x, res, g, w, b = _norm_inputs(m, k, n, True, dtype, device)
    gate_up = rand(m, 2 * n, dtype=dtype, device=device, seed=7)
    w_down = rand(k, n, dtype=dtype, device=device, scale=n**-0.5, seed=8)
    runner = platform.graph_runner()

    def step():
        y, summed = ops.add_rms_norm_linear(x, res, g, 1e-5, w, b)
        return y, summed, ops.silu_and_mul_linear(gate_up, w_down)

    runner.capture("fused", step)
    for seed in (11, 23):  # new inputs, written in place, before each replay
        x.copy_(rand(m, k, dtype=dtype, device=device, seed=seed))
        res.copy_(rand(m, k, dtype=dtype, device=device, seed=seed + 1))
        gate_up.copy_(rand(m, 2 * n, dtype=dtype, device=device, seed=seed + 2))
        y, summed, down = runner.replay("fused")
        platform.synchronize()
        a, y_ref, summed_ref = norm_reference(x, res, g, 1e-5, w, b, dtype)
        check_gemv(y, a, w.detach().to("cpu", F64), y_ref, dtype, record_error)
        check_residual(summed, summed_ref, dtype, record_error)
        a, down_ref = silu_reference(gate_up, w_down, None, dtype)
        check_gemv(down, a, w_down.detach().to("cpu", F64), down_ref, dtype, record_error)


def test_fused_ops_trace_with_fake_tensors(dtype) -> None:
    """The fused ops' fake implementations give the shapes and dtypes the kernels return."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, res, g = (
            torch.empty(3, 64, dtype=dtype),
            torch.empty(3, 64, dtype=dtype),
            torch.empty(64, dtype=dtype),
        )
        w = torch.empty(40, 64, dtype=dtype)
        y, summed = torch.ops.xhal.add_rms_norm_linear(x, res, g, 1e-6, w, None)
        down = torch.ops.xhal.silu_and_mul_linear(torch.empty(3, 128, dtype=dtype), w, None)
    assert (y.shape, summed.shape, down.shape) == ((3, 40), (3, 64), (3, 40))
    assert y.dtype == summed.dtype == down.dtype == dtype


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "kind", [BatchKind.DECODE, BatchKind.PREFILL], ids=lambda k: k.name.lower()
)
def test_forward_rotary(kind, is_neox, platform, dtype, device, record_error) -> None:
    """A backend that fuses rotary into its KV write: the cache holds the rotated keys and the
    values, nothing else changes, and the output is attention over the rotated q and keys."""
    caps = platform.capabilities.attention
    if kind not in caps.batch_kinds:
        pytest.skip(f"{platform.name} does not declare batch kind {kind.name}")
    spec = spec_or_skip(platform, dtype, declared_head_dim(platform), caps.block_sizes[0], 4)
    backend = platform.attention_backend(spec)
    if not backend.fuses_rotary:
        pytest.skip(f"{type(backend).__name__} does not fuse rotary with the KV write")
    rng = random.Random(17)
    batch, num_blocks = random_batch(kind, spec.block_size, device, rng)
    caches = random_caches(1, num_blocks, spec, device, rng)
    backend.bind_kv_caches(caches)
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    num_tokens = len(batch.slots)
    qkv = rand(num_tokens, (h + 2 * hkv) * d, dtype=dtype, device=device, seed=3).clamp(-2, 2)
    q, k, v = (t.view(num_tokens, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    positions = [p for s in batch.seqs for p in range(s.kv_len - s.q_len, s.kv_len)]
    positions += [0] * (num_tokens - len(positions))  # trailing padding rows
    positions = torch.tensor(positions, dtype=torch.int32, device=device)
    table = ref.rope_cache(4096, d).to(device)
    before = attn_ref.snapshot(caches)
    backend.plan(batch.metadata)
    out = backend.forward_rotary(0, q, k, v, positions, table, is_neox)
    platform.synchronize()
    k_rot = ref.rotary_embedding(positions, k, table, is_neox)  # float64 [T, Hkv, D]
    q_rot = ref.rotary_embedding(positions, q, table, is_neox)
    written = [t for t, s in enumerate(batch.slots) if s >= 0]
    slots = [batch.slots[t] for t in written]
    key_now = caches[0].key.detach().cpu().view(-1, hkv, d)
    if dtype in ref.ULP_BITS:
        ulps = ref.max_ulps(key_now[slots], k_rot[written], dtype)
        assert ulps <= ref.ULPS, f"rotated keys in the cache {ulps:.1f} ulp from float64"
    else:
        assert ref.max_error(key_now[slots], k_rot[written]) <= tolerance("ops", dtype)
    problem = attn_ref.cache_mismatch(
        caches[0].value, attn_ref.written_cache(before[0][1], batch.slots, v), batch.slots
    )
    assert problem is None, f"value cache after forward_rotary: {problem}"
    untouched = torch.ones(key_now.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(key_now[untouched], before[0][0].view(-1, hkv, d)[untouched]), (
        "forward_rotary changed key slots it was not given"
    )
    expected = attn_ref.attention(q_rot, caches[0].key, caches[0].value, batch, spec)
    err = attn_ref.max_error(out, expected, batch.real_rows)
    record_error(err)
    assert err <= tolerance("attention", dtype), (
        f"max error {err:.3e} > {tolerance('attention', dtype):.1e}"
    )


# (T, H, Hkv, D): Qwen3-30B-A3B's heads at batch 1, an odd head dim, a few tokens
QK_NORM_CASES = [(1, 32, 4, 128), (3, 5, 1, 40), (7, 4, 2, 64)]


@pytest.mark.parametrize("t,h,hkv,d", QK_NORM_CASES, ids=str)
def test_qk_rms_norm(t, h, hkv, d, dtype, device, record_error) -> None:
    """Qwen3's per-head norms of q and k, both read as slices of one fused qkv row: each head
    within 1 ulp of its float64 RMSNorm with its own weight (q's or k's), v untouched."""
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype, device=device, seed=31)
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]
    q_weight = rand(d, dtype=dtype, device=device, scale=0.5, seed=32)
    k_weight = rand(d, dtype=dtype, device=device, scale=0.5, seed=33) + 1.0
    before = qkv.detach().cpu().clone()
    q_out, k_out = ops.qk_rms_norm(q, k, q_weight, k_weight, 1e-6)
    assert q_out.shape == (t, h * d) and k_out.shape == (t, hkv * d), (q_out.shape, k_out.shape)
    assert q_out.dtype == k_out.dtype == dtype
    for out, x, w in ((q_out, q, q_weight), (k_out, k, k_weight)):
        expected = ref.rms_norm(x.reshape(-1, d), w, 1e-6)  # float64, one row per head
        got = out.reshape(-1, d)
        record_error(ref.max_error(got, expected))
        if dtype in ref.ULP_BITS:
            ulps = ref.max_ulps(got, expected, dtype)
            assert ulps <= ref.ULPS, f"{ulps:.1f} ulp from float64 per-head RMSNorm"
        else:
            assert ref.max_error(got, expected) <= tolerance("ops", dtype)
    assert torch.equal(qkv.detach().cpu(), before), "qk_rms_norm changed its input"
