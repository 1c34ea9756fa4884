"""Fused ops family: ``add_rms_norm_gated_mlp``, a decoder layer's whole gated MLP block (residual
add, RMSNorm, gate_up, SiLU gate, down), against a float64 reference of the unfused sequence, for
each declared dtype and every solution of the op, eagerly and in a captured graph whose inputs
change before each replay.

Tolerance. The block is ``silu_and_mul_linear(add_rms_norm_linear(...))``, so each of its two
projections may deviate as ``test_fused.py`` allows a fused GEMV to. The gate and up values a
kernel rounds to the dtype may therefore differ from the rounded reference by their fused-GEMV
bound ``B`` plus one ulp; through ``act = silu(gate) * up`` that moves each activation by at most

    D_k = |silu'(gate_k) up_k| Bg_k + |silu(gate_k)| Bu_k + Bg_k Bu_k |silu'|max + ulp(act_k)

(first order, a second-order term, and the activation's own rounding). The down projection then
carries those deviations as a fused GEMV carries a skipped rounding: per output element

    |y - y_ref| <= ulp(y_ref) + 4 sqrt(sum_k (W_nk D_k)^2) + (I / 64 + 16) 2^-24 sum_k |W_nk a_k|

(independent deviations, more than 6 standard deviations; float32 accumulation in any blocked
order). A kernel that swaps the gate and up halves, drops a row block of either projection or
skips the norm is off by O(1) of the output; one that reads a stale input (a graph replay that
does not see the new x) likewise. The new residual is an op output of its own: the 1-ulp rule.
"""

from __future__ import annotations

import pytest
import torch

from conformance_tests import ops_reference as ref
from conformance_tests.ops_family import _platform_ops_active, pytest_generate_tests  # noqa: F401
from conformance_tests.test_fused import F64, check_residual, gemv_bound, norm_reference, rand
from xhal import ops

pytestmark = pytest.mark.kernel_ops("add_rms_norm_gated_mlp")

EPS = 1e-5
# (M, hidden, intermediate): decode rows (where a platform swaps in its fused block), sizes off
# powers of 2, a block most CTAs of a GPU get no rows of, rows past a decode kernel's limit
CASES = [(1, 256, 96), (2, 200, 72), (3, 64, 40), (4, 520, 136), (6, 128, 64)]
# one row of a block whose rows per CTA wrap a persistent kernel's ring of weight stages on a GPU
# (sm_90's 132 CTAs: gate_up 3.9 units of 64 KB against 3 stages, down 15.5 of 8 KB against 8)


def mlp_reference(x, res, g, w_gu, w_down, dtype, b_gu=None, b_down=None):
    """float64: (the rounded activation a, each activation's allowed deviation D, y, the new
    residual)."""
    inter = w_down.shape[1]
    w_gu64, w_down64 = w_gu.detach().to("cpu", F64), w_down.detach().to("cpu", F64)
    normed, gu_exact, summed = norm_reference(x, res, g, EPS, w_gu, b_gu, dtype)
    gu = gu_exact.to(dtype).to(F64)  # gate_up as the projection stores it
    radius = gemv_bound(normed, w_gu64, gu_exact, dtype) + ref.ulp(gu, dtype)
    gate, up = gu[:, :inter], gu[:, inter:]
    bg, bu = radius[:, :inter], radius[:, inter:]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dsilu = sig * (1 + gate * (1 - sig))  # silu'(gate), at most 1.1 in magnitude
    act_exact = silu * up
    act = act_exact.to(dtype).to(F64)
    deviation = (dsilu * up).abs() * bg + silu.abs() * bu + 1.1 * bg * bu + ref.ulp(act, dtype)
    y = act @ w_down64.T
    if b_down is not None:
        y = y + b_down.detach().to("cpu", F64)
    return act, deviation, y, summed


def check_block(
    out, x, res, g, w_gu, w_down, dtype, record_error, biases=(None, None)
) -> torch.Tensor:
    """Checks the block's output; returns the reference's new residual (float64)."""
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected the input's {dtype}"
    a, deviation, y_ref, summed = mlp_reference(x, res, g, w_gu, w_down, dtype, *biases)
    w64 = w_down.detach().to("cpu", F64)
    err = (out.detach().to("cpu", F64) - y_ref).abs()
    record_error(float(err.max()))
    bound = (
        ref.ulp(y_ref, dtype)
        + 4 * ((deviation * deviation) @ (w64 * w64).T).sqrt()
        + (w64.shape[1] / 64 + 16) * 2.0**-24 * (a.abs() @ w64.abs().T)
    )
    worst = float((err / bound).nan_to_num(float("inf")).max())
    assert worst <= 1.0, (
        f"{worst:.2f}x the gated-MLP bound (max error {float(err.max()):.3e}): the block must "
        "match norm -> gate_up -> silu * up -> down up to the roundings a fused GEMV may skip"
    )
    return summed


def _inputs(m, hidden, inter, dtype, device, seed=0):
    x = rand(m, hidden, dtype=dtype, device=device, seed=seed)
    res = rand(m, hidden, dtype=dtype, device=device, seed=seed + 1)
    g = rand(hidden, dtype=dtype, device=device, scale=0.5, seed=seed + 2) + 1.0
    w_gu = rand(2 * inter, hidden, dtype=dtype, device=device, scale=hidden**-0.5, seed=seed + 3)
    w_down = rand(hidden, inter, dtype=dtype, device=device, scale=inter**-0.5, seed=seed + 4)
    return x, res, g, w_gu, w_down


@pytest.mark.parametrize("m,hidden,inter", CASES, ids=str)
def test_gated_mlp(m, hidden, inter, dtype, device, record_error) -> None:
    x, res, g, w_gu, w_down = _inputs(m, hidden, inter, dtype, device)
    out, summed = ops.add_rms_norm_gated_mlp(x, res, g, EPS, w_gu, w_down)
    assert out.shape == x.shape and summed.shape == x.shape, (out.shape, summed.shape)
    summed_ref = check_block(out, x, res, g, w_gu, w_down, dtype, record_error)
    check_residual(summed, summed_ref, dtype, record_error)


def test_gated_mlp_with_biases(dtype, device, record_error) -> None:
    """Biases (Llama's ``mlp_bias``): gate_up's joins before the activation, down's after."""
    m, hidden, inter = 2, 128, 48
    x, res, g, w_gu, w_down = _inputs(m, hidden, inter, dtype, device, seed=40)
    b_gu = rand(2 * inter, dtype=dtype, device=device, seed=45)
    b_down = rand(hidden, dtype=dtype, device=device, seed=46)
    out, _ = ops.add_rms_norm_gated_mlp(x, res, g, EPS, w_gu, w_down, b_gu, b_down)
    check_block(out, x, res, g, w_gu, w_down, dtype, record_error, biases=(b_gu, b_down))


def test_gated_mlp_takes_strided_inputs(dtype, device, record_error) -> None:
    """x and residual as slices of wider rows (the residual stream beside another buffer)."""
    m, hidden, inter = 2, 200, 64
    wide = rand(m, 3 * hidden, dtype=dtype, device=device, seed=50)
    x, res = wide[:, :hidden], wide[:, 2 * hidden :]
    _, _, g, w_gu, w_down = _inputs(m, hidden, inter, dtype, device, seed=51)
    out, summed = ops.add_rms_norm_gated_mlp(x, res, g, EPS, w_gu, w_down)
    summed_ref = check_block(out, x, res, g, w_gu, w_down, dtype, record_error)
    check_residual(summed, summed_ref, dtype, record_error)


@pytest.mark.parametrize("m,hidden,inter", [(1, 256, 96), (1, 4096, 2048)], ids=str)
def test_gated_mlp_in_a_graph(m, hidden, inter, platform, dtype, device, record_error) -> None:
    """Decode steps run the block captured, where a platform picks its fused kernel; two blocks
    chained as layers chain them (one after another in one graph: a persistent kernel's grid
    barrier state carries from one launch to the next): each replay must read the inputs as
    they are then. The second case is the ring-wrapping one."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    declared = platform.capabilities.ops_dtypes
    if hidden > 1024 and dtype != (torch.bfloat16 if torch.bfloat16 in declared else declared[0]):
        pytest.skip("the ring-wrapping case runs in one dtype (bf16 where declared)")
    x, res, g, w_gu, w_down = _inputs(m, hidden, inter, dtype, device, seed=60)
    _, _, g2, w_gu2, w_down2 = _inputs(m, hidden, inter, dtype, device, seed=70)
    runner = platform.graph_runner()

    def step():
        out, summed = ops.add_rms_norm_gated_mlp(x, res, g, EPS, w_gu, w_down)
        out2, summed2 = ops.add_rms_norm_gated_mlp(out, summed, g2, EPS, w_gu2, w_down2)
        return out, summed, out2, summed2

    runner.capture("gated_mlp", step)
    for seed in (11, 23):  # new inputs, written in place, before each replay
        x.copy_(rand(m, hidden, dtype=dtype, device=device, seed=seed))
        res.copy_(rand(m, hidden, dtype=dtype, device=device, seed=seed + 1))
        out, summed, out2, summed2 = runner.replay("gated_mlp")
        platform.synchronize()
        summed_ref = check_block(out, x, res, g, w_gu, w_down, dtype, record_error)
        check_residual(summed, summed_ref, dtype, record_error)
        # the second block against its own inputs as the first left them
        check_block(out2, out, summed, g2, w_gu2, w_down2, dtype, record_error)


def test_gated_mlp_traces_with_fake_tensors(dtype) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 64, dtype=dtype)
        out, summed = torch.ops.xhal.add_rms_norm_gated_mlp(
            x, torch.empty_like(x), torch.empty(64, dtype=dtype), 1e-6,
            torch.empty(80, 64, dtype=dtype), torch.empty(64, 40, dtype=dtype), None, None,
        )  # fmt: skip
    assert out.shape == summed.shape == (3, 64) and out.dtype == summed.dtype == dtype
