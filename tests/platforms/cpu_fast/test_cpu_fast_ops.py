"""The ``cpu-fast`` platform's device ops and weight layout against the reference ``cpu``
platform's: norms against float64, the fused and gated ops as the reference sequence, the gated
MLP block, weights laid out column-major for its GEMMs and the packed linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xhal import platforms


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_float64_and_rotary_is_the_references_bit_for_bit(dtype: torch.dtype) -> None:
    """float32 norms come from one reduction (the squared 2-norm), so they match the float64
    definition to float32 rounding rather than the reference bit for bit; bfloat16 takes the
    reference's own code. Rotary is the reference's products and sums, bit for bit."""
    from xhal.platforms.cpu_fast.ops import FastCpuOps
    from xhal.platforms.cpu_ref.ops import CpuOps

    fast, ref = FastCpuOps(), CpuOps()
    g = torch.Generator().manual_seed(1)
    x, residual, weight = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(3))
    x[1] *= 1e-3  # a small row: eps matters there
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    want = _rms_norm64(x, weight, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(fast.rms_norm(x, weight, 1e-5).double(), want, **tol)
    else:
        assert torch.equal(fast.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    normed, summed = fast.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed.float(), ref_normed.float(), **tol)
    q = torch.randn(5, 4, 32, generator=g).to(dtype)
    k = torch.randn(5, 2, 32, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 7, 1, 2])
    for rotary_dim in (32, 16):  # full and partial rotary
        cache = torch.randn(16, rotary_dim, generator=g)
        for neox in (True, False):
            for got, want in zip(
                fast.rotary_embedding(positions, q, k, cache, neox),
                ref.rotary_embedding(positions, q, k, cache, neox),
            ):
                assert torch.equal(got, want)


def test_fused_and_gated_ops_are_the_reference_sequence() -> None:
    """The fused ops are the plain sequence of the platform's own ops (bit for bit), and that
    sequence matches the reference's to float32 rounding."""
    from xhal.platforms.cpu_fast.ops import FastCpuOps
    from xhal.platforms.cpu_ref.ops import CpuOps

    fast, ref = FastCpuOps(), CpuOps()
    g = torch.Generator().manual_seed(2)
    x, residual, norm_w = (torch.randn(3, 48, generator=g) for _ in range(3))
    weight, bias = torch.randn(20, 48, generator=g), torch.randn(20, generator=g)
    gate_up, down = torch.randn(3, 2 * 24, generator=g), torch.randn(48, 24, generator=g)
    assert torch.equal(fast.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    for b in (None, bias):
        y, summed = fast.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight, b)
        normed, plain_summed = fast.fused_add_rms_norm(x, residual, norm_w, 1e-6)
        assert torch.equal(summed, plain_summed)
        assert torch.equal(y, fast.linear(normed, weight, b))
        want, ref_summed = ref.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight, b)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    got = fast.silu_and_mul_linear(gate_up, down)
    assert torch.equal(got, ref.silu_and_mul_linear(gate_up, down))


def test_the_gated_mlp_block_runs_on_the_fast_ops() -> None:
    """cpu-fast's MLP block is its own two fused ops (the packed GEMMs), not the reference
    platform's solution of the op (the reference's plain ops: a batch-1 SmolLM2 decode fell
    from 1.31x to 1.23x transformers' rate with it, 8 concurrent from 4.8x to 4.0x the batch-1
    rate)."""
    from xhal.platforms.cpu_fast.ops import FastCpuOps

    ops = platforms.get("cpu-fast").ops
    assert ops.names["add_rms_norm_gated_mlp"] == "fast"
    # FastCpuOps keeps DeviceOps' default for the block: the platform composes it of its own
    # chosen ops (solutions.kernels.inherits_default), which are FastCpuOps' two fused ops
    assert "add_rms_norm_gated_mlp" not in ops.impls
    for op in ("add_rms_norm_linear", "silu_and_mul_linear"):
        assert isinstance(ops.impls[op].__self__, FastCpuOps), op
    g = torch.Generator().manual_seed(4)
    x, residual, norm_w = (torch.randn(2, 32, generator=g) for _ in range(3))
    w_gu, w_down = torch.randn(40, 32, generator=g), torch.randn(32, 20, generator=g)
    out, summed = ops.add_rms_norm_gated_mlp(x, residual, norm_w, 1e-6, w_gu, w_down)
    gate_up, want_summed = ops.add_rms_norm_linear(x, residual, norm_w, 1e-6, w_gu)
    assert torch.equal(out, ops.silu_and_mul_linear(gate_up, w_down))
    assert torch.equal(summed, want_summed)


def test_a_prefills_gated_activation_reuses_one_buffer_and_matches_the_reference() -> None:
    """Outside autograd a prefill-sized SiLU gate goes into the ops' reused buffer before the
    down projection: the product equals the reference's fused op (bit for bit: the same SiLU,
    product and GEMM), a second call with other inputs leaves the first result intact, and a
    smaller call after a larger one reads only its own rows."""
    from xhal.platforms.cpu_fast import scratch
    from xhal.platforms.cpu_fast.ops import FastCpuOps
    from xhal.platforms.cpu_ref.ops import CpuOps

    fast, ref = FastCpuOps(), CpuOps()
    g = torch.Generator().manual_seed(9)
    inter = 512
    rows = scratch.MIN_ELEMENTS // inter + 7  # past the threshold
    down = torch.randn(64, inter, generator=g)
    first, second = (torch.randn(rows, 2 * inter, generator=g) for _ in range(2))
    with torch.inference_mode():
        got = fast.silu_and_mul_linear(first, down)
        kept = got.clone()
        again = fast.silu_and_mul_linear(second, down)
        smaller = fast.silu_and_mul_linear(first[: rows - 5], down)
    assert torch.equal(got, kept)  # the buffer's reuse did not touch a returned tensor
    assert torch.equal(got, ref.silu_and_mul_linear(first, down))
    assert torch.equal(again, ref.silu_and_mul_linear(second, down))
    assert torch.equal(smaller, ref.silu_and_mul_linear(first[: rows - 5], down))


def test_weights_are_laid_out_column_major_and_steps_match_the_reference(
    llama_tied_dir: Path,
) -> None:
    """``ModelExecutor`` on ``cpu-fast`` stores every float32 matrix transposed: same shapes and
    values, the tied LM head still the embedding's parameter; a prefill and a decode step give
    the reference platform's logits."""
    from models.loader import load_model
    from xhal.executor import ExecutorConfig, ModelExecutor
    from xhal.interfaces.metadata import AttentionMetadata, BatchKind

    model = load_model(llama_tied_dir, torch.float32, progress=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = ExecutorConfig(dtype=torch.float32, enforce_eager=True)
    fast = ModelExecutor(model, platforms.get("cpu-fast"), config)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        if p.dim() == 2:
            assert p.t().is_contiguous() and not p.is_contiguous(), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = ModelExecutor(load_model(llama_tied_dir, torch.float32, progress=False),
                        platforms.get("cpu"), config)
    logits = []
    for executor in (fast, ref):
        executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=4))
        steps = []
        for ids, start in (([5, 9, 2, 7, 1], 0), ([3], 5)):
            n = len(ids)
            i32 = dict(dtype=torch.int32)
            metadata = AttentionMetadata.from_host_lengths(
                BatchKind.PREFILL if start == 0 else BatchKind.DECODE,
                torch.tensor([n], **i32), torch.tensor([start + n], **i32),
                torch.tensor([[0, 1]], dtype=torch.int32),
                torch.arange(start, start + n, dtype=torch.int32),
            )
            positions = torch.arange(start, start + n, dtype=torch.int32)
            hidden = executor.execute(torch.tensor(ids, dtype=torch.int32), positions, metadata)
            steps.append(executor.compute_logits(hidden, torch.tensor([n - 1])))
        logits.append(steps)
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not __import__("xhal.platforms.cpu_fast.packed").platforms.cpu_fast.packed
                    .available(), reason="cpu-fast's native kernels are not built here")
def test_packed_linear_serves_every_batch_of_two_rows_or_more() -> None:
    """The native GEMM on a packed copy gives ``x @ W.T + b`` within float32 rounding of a
    float64 product for decode batches and a prefill's rows alike (widths that are not a multiple
    of the tile, row counts that are not a multiple of its row group, a strided x); one row, a
    weight changed in place since packing and a weight that died are not served by it, and small
    matrices are not packed. (``forced``: whichever of it and MKL this CPU measured faster.)"""
    from xhal.platforms.cpu_fast.packed import forced

    with forced():
        _packed_linear_cases()


def _packed_linear_cases() -> None:
    from xhal.platforms.cpu_fast.packed import MIN_ELEMENTS, TILE, PackedWeights

    g = torch.Generator().manual_seed(6)
    packed = PackedWeights()
    k = 320
    wide = torch.randn(4 * k, k, generator=g).t().contiguous().t()  # column-major, as prepared
    odd = torch.randn(MIN_ELEMENTS // k + TILE // 2 + 3, k, generator=g)  # row-major, ragged tile
    bias = torch.randn(4 * k, generator=g)
    assert packed.add(wide) and packed.add(odd)
    assert not packed.add(torch.randn(MIN_ELEMENTS // k - 1, k))  # small: not packed
    assert not packed.add(torch.randn(4 * k, k, dtype=torch.float64))
    for weight, bias_ in ((wide, bias), (odd, None)):
        for rows in (2, 3, 8, 13, 32, 33, 301):
            x = torch.randn(rows, k + 5, generator=g)[:, 2 : k + 2]  # rows k + 5 floats apart
            out = packed.linear(x, weight, bias_)
            assert out is not None and out.shape == (rows, weight.shape[0])
            want = x.double() @ weight.double().T
            if bias_ is not None:
                want += bias_.double()
            # float32 sums of 320 unit-scale products: errors of ~K * 2^-24 * |sum|
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-4)
    assert packed.linear(torch.randn(1, k), wide, None) is None  # one row: MKL's GEMV
    assert packed.linear(torch.randn(4, k + 1), wide, None) is None  # F.linear's error to raise
    wide.mul_(2)  # an in-place change (it bumps the version counter): the copy is stale
    assert packed.linear(torch.randn(4, k), wide, None) is None
    del odd, weight  # the loop variable held it too
    other = torch.randn(4 * k, k, generator=g)
    assert packed.add(other) and len(packed._packed) == 1  # the stale entry is gone
    del other
    assert not packed._packed  # a weight that dies takes its copy along


@pytest.mark.skipif(not __import__("xhal.platforms.cpu_fast.packed").platforms.cpu_fast.packed
                    .available(), reason="cpu-fast's native kernels are not built here")
def test_packed_or_mkl_is_chosen_per_bucket_by_timing_and_kept_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first product of a (rows rounded up to a power of two, N, K, threads) bucket times the
    packed copy against MKL; MKL takes the bucket only when clearly faster (a near tie stays
    packed); the choice is kept for the bucket and on disk, where a new process reads it without
    timing, even with timing off."""
    from xhal.platforms.cpu_fast import packed as module

    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    timed: list[str] = []

    def fake(product, mkl) -> list[float]:  # seconds per call of each
        timed.append(fake.rows)
        return list({8: (1.0, 2.0), 512: (1.0, 0.5), 32: (1.0, 0.98)}[fake.rows])

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(640, 256, generator=g)
    weights = module.PackedWeights(measure=fake)
    assert weights.add(weight)
    for rows, served in ((8, True), (512, False), (32, True), (5, True)):
        fake.rows = 1 << (rows - 1).bit_length()
        out = weights.linear(torch.randn(rows, 256, generator=g), weight, None)
        assert (out is not None) == served, rows
    assert timed == [8, 512, 32]  # 5 rows share the 8-row bucket: no timing
    threads = torch.get_num_threads()
    assert weights.choices == {(m, 640, 256, threads): m != 512 for m in (8, 512, 32)}
    monkeypatch.setenv("XHAL_AUTOTUNE", "0")
    again = module.PackedWeights(measure=lambda *fns: pytest.fail("timed a cached bucket"))
    assert again.add(weight)
    assert again.linear(torch.randn(300, 256, generator=g), weight, None) is None
    assert again.linear(torch.randn(7, 256, generator=g), weight, None) is not None
    with module.forced():
        assert again.linear(torch.randn(300, 256, generator=g), weight, None) is not None
    # an unseen bucket with timing off and nothing cached: the packed copy
    assert again.linear(torch.randn(2, 256, generator=g), weight, None) is not None
