"""The Triton ``gemv`` (xhal/platforms/cuda/kernels/gemv.py) against float64 references: split K or
not, bias, fp16 / bf16 / fp32, M up to 64 (CUDA cores to 16, tensor cores above), ragged N and K,
strided x, and its config heuristic. Interpreted on CPU when there is no CUDA device
(tests/support/triton_env.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.triton_env import DEVICE, INTERPRETED, assert_matches

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from xhal.platforms.cuda.kernels.gemv import MAX_CORE_M, MAX_M, gemv, gemv_config, supports_gemv


def _gemv_case(M: int, N: int, K: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    return x, w, b, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16])
def test_gemv_heuristic_config(M: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, b, ref = _gemv_case(M, 100, 72, dtype, bias)  # N, K: no multiple of any block size
    assert_matches(gemv(x, w, b), ref, dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "config",
    [
        (16, 32, 3, 4, 2),  # split K: 3 splits of one 32-wide step, the last one ragged
        (8, 32, 1, 4, 3),  # no split: three steps through K in one program, pipelined
        (4, 16, 8, 4, 1),  # 8 splits asked, 5 steps of 16: trimmed to 5 (none left empty)
        (32, 128, 1, 4, 1),  # one step wider than K
    ],
)
def test_gemv_forced_config(config: tuple[int, ...], M: int, bias: bool) -> None:
    x, w, b, ref = _gemv_case(M, 100, 72, torch.bfloat16, bias)
    assert_matches(gemv(x, w, b, config=config), ref, torch.bfloat16)


def test_gemv_split_is_deterministic_and_matches_no_split() -> None:
    x, w, b, ref = _gemv_case(4, 64, 96, torch.float32, True, seed=1)
    split = gemv(x, w, b, config=(16, 16, 6, 4, 1))
    assert torch.equal(split, gemv(x, w, b, config=(16, 16, 6, 4, 1)))
    assert_matches(split, ref, torch.float32)
    assert_matches(gemv(x, w, b, config=(16, 16, 1, 4, 1)), ref, torch.float32)


def test_gemv_strided_x() -> None:
    _, w, b, _ = _gemv_case(3, 40, 24, torch.float16, True)
    wide = torch.randn(3, 48).to(torch.float16).to(DEVICE)
    x = wide[:, ::2]  # x_stride_k = 2
    ref = x.double() @ w.double().T + b.double()
    assert_matches(gemv(x, w, b), ref, torch.float16)
    xt = torch.randn(24, 3).to(torch.float16).to(DEVICE).T  # column-major x
    ref_t = xt.double() @ w.double().T + b.double()
    assert_matches(gemv(xt, w, b, config=(8, 16, 2, 4, 1)), ref_t, torch.float16)


def test_supports_gemv_rejects_what_the_kernel_cannot_do() -> None:
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(32, 16, **bf16)
    assert supports_gemv(torch.randn(1, 16, **bf16), w)
    assert supports_gemv(torch.randn(MAX_M, 16, **bf16), w)
    rejected = {
        "too many rows": (torch.randn(MAX_M + 1, 16, **bf16), w),
        "no rows": (torch.randn(0, 16, **bf16), w),
        "3-D x": (torch.randn(1, 1, 16, **bf16), w),
        "K mismatch": (torch.randn(1, 8, **bf16), w),
        "dtype mismatch": (torch.randn(1, 16, dtype=torch.float16, device=DEVICE), w),
        "integer dtype": (torch.ones(1, 16, dtype=torch.int32, device=DEVICE), w.to(torch.int32)),
        "transposed weight": (torch.randn(1, 32, **bf16), w.T),
        "strided weight": (torch.randn(1, 8, **bf16), w[:, ::2]),
    }
    for name, (x, weight) in rejected.items():
        assert not supports_gemv(x, weight), name
        with pytest.raises(ValueError, match="gemv"):
            gemv(x, weight)


def test_gemv_rejects_bad_bias_and_config() -> None:
    x, w, _, _ = _gemv_case(2, 32, 16, torch.float16, False)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(31, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="power-of-2"):
        gemv(x, w, config=(12, 16, 1, 4, 1))
    with pytest.raises(ValueError, match=">= 1"):
        gemv(x, w, config=(16, 16, 0, 4, 1))
    x32, w32, _, _ = _gemv_case(32, 32, 16, torch.float16, False)
    with pytest.raises(ValueError, match="tensor cores"):
        gemv(x32, w32, config=(8, 16, 1, 4, 1))


def test_gemv_config_splits_only_narrow_weights() -> None:
    sms = 132
    for M in range(1, MAX_M + 1):
        for N, K in [(4096, 4096), (28672, 4096), (512, 4096), (100, 72), (7, 5)]:
            block_n, block_k, split_k, num_warps, num_stages = gemv_config(M, N, K, sms)[:5]
            assert block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
            k_steps = math.ceil(K / block_k)
            assert (
                1 <= split_k <= k_steps
                and 1 <= num_stages <= (3 if M <= MAX_CORE_M else 4)
                and num_warps >= 1
            )
            n_blocks = math.ceil(N / block_n)
            if n_blocks >= 2 * sms:
                assert split_k == 1, (M, N, K)
            elif k_steps >= 2:  # too few row blocks to fill the SMs: K is split
                assert split_k > 1, (M, N, K)
    with pytest.raises(ValueError):
        gemv_config(MAX_M + 1, 64, 64)


# tensor-core path (17..64 rows) ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [17, 32, 40, 64])
def test_gemv_tensor_core_rows(M: int, dtype: torch.dtype) -> None:
    """Padded to 32 or 64 rows on tensor cores: the padding rows load zeros and store nothing."""
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip(
            "Triton 3.6's interpreter runs tl.dot on bfloat16's raw bits; compiled on CUDA it is "
            "checked"
        )
    x, w, b, ref = _gemv_case(M, 100, 72, dtype, True)
    assert_matches(gemv(x, w, b), ref, dtype)


@pytest.mark.parametrize(
    "config",
    [
        (16, 32, 3, 4, 2),  # split K, the last split ragged
        (32, 16, 1, 4, 3),  # no split, five pipelined steps
        (64, 128, 1, 4, 1),  # one step wider than K, a tile wider than N's remainder
    ],
)
def test_gemv_tensor_core_forced_config(config: tuple[int, ...]) -> None:
    x, w, b, ref = _gemv_case(48, 100, 72, torch.float16, True, seed=2)
    assert_matches(gemv(x, w, b, config=config), ref, torch.float16)


def test_gemv_tensor_core_strided_x_and_split_determinism() -> None:
    _, w, b, _ = _gemv_case(24, 40, 24, torch.float16, True)
    x = torch.randn(24, 48).to(torch.float16).to(DEVICE)[:, ::2]  # x_stride_k = 2
    ref = x.double() @ w.double().T + b.double()
    split = gemv(x, w, b, config=(16, 16, 2, 4, 1))
    assert torch.equal(split, gemv(x, w, b, config=(16, 16, 2, 4, 1)))
    assert_matches(split, ref, torch.float16)
