"""The ``cpu-fast`` platform against the reference ``cpu`` platform (the oracle): its attention on
the same paged caches and steps, the conformance suite's attention family, and ``xhal-serve
--device cpu`` choosing it. (Whole models: ``test_engine`` checks the engine, now on ``cpu-fast``,
against an offline loop on the reference platform and against transformers.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_cli.engine.runner.platform_choice import serving_platform
from tests.support.paged_host import PagedHost
from tests.support.paths import REPO
from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.cache import LayerCache

NUM_BLOCKS, NUM_LAYERS = 64, 2


def _spec(dtype: torch.dtype = torch.float32, block_size: int = 16, **features) -> AttentionSpec:
    return AttentionSpec(
        num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=block_size,
        scale=32**-0.5, **features,
    )


def _caches(spec: AttentionSpec) -> list[LayerCache]:
    shape = (NUM_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [LayerCache(torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype))
            for _ in range(NUM_LAYERS)]


def _run_both(spec: AttentionSpec, steps: list[tuple[list[tuple[int, int]], int]]) -> None:
    """Each step: (seq_id, new tokens) per sequence and a count of padding rows; both backends
    see the same q/k/v on caches of their own; outputs and caches must agree at every step."""
    fast = platforms.get("cpu-fast").attention_backend(spec)
    ref = platforms.get("cpu").attention_backend(spec)
    fast_caches, ref_caches = _caches(spec), _caches(spec)
    fast.bind_kv_caches(fast_caches)
    ref.bind_kv_caches(ref_caches)
    host = PagedHost(NUM_BLOCKS, spec.block_size, seed=3)
    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if spec.dtype == torch.float32 else 2e-2
    for chunks, pad in steps:
        _, _, metadata = host.step([(s, [0] * n) for s, n in chunks], pad_tokens=pad)
        fast.plan(metadata)
        ref.plan(metadata)
        real = sum(n for _, n in chunks)
        for layer in range(NUM_LAYERS):
            q, k, v = (
                torch.randn(real + pad, heads, spec.head_dim, generator=g).to(spec.dtype)
                for heads in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
            )
            got, want = fast.forward(layer, q, k, v), ref.forward(layer, q, k, v)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=tol, rtol=tol)
            assert torch.equal(fast_caches[layer].key, ref_caches[layer].key)
            assert torch.equal(fast_caches[layer].value, ref_caches[layer].value)


# a prefill of two sequences, a mixed step (a decode next to a chunk over a cached prefix and a
# fresh prefill), then decodes of unequal lengths, one with padding rows (slot -1)
STEPS = [
    ([(0, 37), (1, 5)], 0),
    ([(0, 1), (1, 20), (2, 9)], 3),
    ([(0, 1), (1, 1), (2, 1)], 0),
    ([(2, 1), (0, 1)], 5),
]


@pytest.mark.parametrize("block_size", [16, 128])
def test_matches_the_reference(block_size: int) -> None:
    _run_both(_spec(block_size=block_size), STEPS)


def test_matches_the_reference_with_a_window_and_a_logit_cap() -> None:
    _run_both(_spec(sliding_window=7), STEPS)
    _run_both(_spec(logits_soft_cap=5.0), STEPS)


def test_matches_the_reference_in_bfloat16() -> None:
    _run_both(_spec(torch.bfloat16), STEPS)


def test_refuses_graph_plans_and_non_contiguous_caches() -> None:
    spec = _spec()
    backend = platforms.get("cpu-fast").attention_backend(spec)
    _, _, metadata = PagedHost(NUM_BLOCKS, spec.block_size).step([(0, [0, 0])])
    with pytest.raises(RuntimeError, match="graph_key"):
        backend.plan(metadata, graph_key=1)
    shape = (spec.num_kv_heads, NUM_BLOCKS, spec.block_size, spec.head_dim)
    strided = torch.zeros(shape).transpose(0, 1).transpose(1, 2)  # right shape, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        backend.bind_kv_caches([LayerCache(strided, strided)])


def test_the_server_runs_cpu_fast_for_device_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XHAL_SERVE_CPU_PLATFORM", raising=False)
    assert serving_platform("cpu") == "cpu-fast"
    assert serving_platform("cuda") == "cuda"
    monkeypatch.setenv("XHAL_SERVE_CPU_PLATFORM", "cpu")
    assert serving_platform("cpu") == "cpu"
    monkeypatch.setenv("XHAL_SERVE_CPU_PLATFORM", "fast")
    with pytest.raises(ValueError, match="cpu-fast"):
        serving_platform("cpu")


def test_conformance_attention_family_passes_on_cpu_fast(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "conformance_tests.cli", "--device", "cpu-fast",
           "--family", "attention", "--report", str(report)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "attention    passed" in proc.stdout, proc.stdout[-2000:]


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


@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("scale", [1, 12], ids=["few-tokens", "many-tokens"])
def test_forward_rotary_is_the_reference_rotation_then_forward(
    rotary_dim: int, is_neox: bool, scale: int
) -> None:
    """The fused rotation writes the reference's rotated keys (float32, to rounding: a step of
    few tokens rotates by matrix; one of more than ``MATRIX_TOKENS`` in the native rotary and
    write) and attends with its rotated queries, at every layer of a step (they share the step's
    tables) and at the next step, whose positions are written into the same tensor (as a host
    with persistent input buffers does). Layer 0 gets q, k and v as the layers pass them (column
    blocks of one qkv buffer: rotated together), layer 1 as tensors of their own."""
    from xhal.platforms.cpu_ref.ops import CpuOps

    spec = _spec()
    fused = platforms.get("cpu-fast").attention_backend(spec)
    plain = platforms.get("cpu-fast").attention_backend(spec)
    fused_caches, plain_caches = _caches(spec), _caches(spec)
    fused.bind_kv_caches(fused_caches)
    plain.bind_kv_caches(plain_caches)
    host = PagedHost(NUM_BLOCKS, spec.block_size, seed=5)
    g = torch.Generator().manual_seed(4)
    table = torch.randn(64, rotary_dim, generator=g)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    # three steps: a prefill, a mixed step, decodes next to a short prefill (5 tokens each, or
    # prefill chunks 12 times as long)
    steps = ([(0, 3), (1, 2)], [(0, 1), (1, 1), (2, 3)], [(0, 1), (1, 1), (2, 1), (3, 2)])
    steps = tuple([(s, n if n == 1 else n * scale) for s, n in step] for step in steps)
    positions = torch.zeros(5 * scale, dtype=torch.int32)  # persistent: rewritten every step
    for chunks in steps:
        num_tokens = sum(n for _, n in chunks)
        _, step_positions, metadata = host.step([(s, [0] * n) for s, n in chunks])
        step_view = positions[:num_tokens]
        step_view.copy_(step_positions)
        fused.plan(metadata)
        plain.plan(metadata)
        for layer in range(NUM_LAYERS):
            qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g)
            q, k, v = (part.view(num_tokens, -1, dim) for part in
                       qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
            if layer == 1:
                q, k, v = q.clone(), k.clone(), v.clone()
            got = fused.forward_rotary(layer, q, k, v, step_view, table, is_neox)
            q_rot, k_rot = CpuOps().rotary_embedding(step_positions, q, k, table, is_neox)
            want = plain.forward(layer, q_rot, k_rot, v)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            fused_cache, plain_cache = fused_caches[layer], plain_caches[layer]
            torch.testing.assert_close(fused_cache.key, plain_cache.key, rtol=1e-6, atol=1e-6)
            assert torch.equal(fused_cache.value, plain_cache.value)


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
    matrices are not packed."""
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


@pytest.mark.parametrize("blocks", [[3, 4, 5], [5, 3, 4]], ids=["consecutive", "scattered"])
def test_a_lone_decode_matches_the_reference_in_place_or_gathered(blocks: list[int]) -> None:
    """One decoding sequence whose blocks are consecutive cache rows is read in place (no
    gather); scattered blocks are gathered; both match the reference, over cached keys written
    by a prefill step first, and with q, k, v as column blocks of one qkv buffer."""
    from xhal.interfaces.metadata import AttentionMetadata, BatchKind

    spec = _spec()
    fast = platforms.get("cpu-fast").attention_backend(spec)
    ref = platforms.get("cpu").attention_backend(spec)
    fast_caches, ref_caches = _caches(spec), _caches(spec)
    fast.bind_kv_caches(fast_caches)
    ref.bind_kv_caches(ref_caches)
    table = torch.tensor([blocks], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    for kind, q_len, kv_len in ((BatchKind.PREFILL, 39, 39), (BatchKind.DECODE, 1, 40)):
        positions = torch.arange(kv_len - q_len, kv_len)
        slots = (table[0, positions // 16] * 16 + positions % 16).int()
        metadata = AttentionMetadata.from_host_lengths(
            kind, torch.tensor([q_len], dtype=torch.int32),
            torch.tensor([kv_len], dtype=torch.int32), table, slots,
        )
        fast.plan(metadata)
        ref.plan(metadata)
        if kind == BatchKind.DECODE:
            assert (fast._plan.decode_start is not None) == (blocks == [3, 4, 5])
        qkv = torch.randn(q_len, (heads + 2 * kv_heads) * dim, generator=g)
        q, k, v = (part.view(q_len, -1, dim) for part in
                   qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        for layer in range(NUM_LAYERS):
            got, want = fast.forward(layer, q, k, v), ref.forward(layer, q, k, v)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(fast_caches[layer].key, ref_caches[layer].key)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_q_and_k_of_one_qkv_buffer_are_rotated_as_one_view(
    num_tokens: int, inference: bool
) -> None:
    """As the layers pass them, served under inference mode (whose views record no base)."""
    from xhal.platforms.cpu_fast.attention import _joined

    with torch.inference_mode(inference):
        qkv = torch.randn(num_tokens, (8 + 2 * 2) * 32)
        q, k, _ = (part.view(num_tokens, -1, 32) for part in qkv.split([256, 64, 64], dim=-1))
    joined = _joined(q, k)
    assert joined is not None and joined.shape == (num_tokens, 10, 32)
    assert torch.equal(joined, torch.cat([q, k], dim=1))
    assert _joined(q, k.clone()) is None and _joined(k, q) is None
