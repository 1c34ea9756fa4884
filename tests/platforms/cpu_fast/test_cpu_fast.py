"""The ``cpu-fast`` platform against the reference ``cpu`` platform (the oracle): its attention on
the same paged caches and steps, its rotary and KV write, the conformance suite's attention
family, and ``xhal-serve --device cpu`` choosing it (its device ops and weight layout:
``test_cpu_fast_ops``). (Whole models: ``test_engine`` checks the engine, now on ``cpu-fast``,
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


def _spec(
    dtype: torch.dtype = torch.float32, block_size: int = 16, head_dim: int = 32, **features
) -> AttentionSpec:
    return AttentionSpec(
        num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype, block_size=block_size,
        scale=head_dim**-0.5, **features,
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


@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=["64", "128", "48-generic"])
def test_matches_the_reference_at_each_head_dim(head_dim: int) -> None:
    """The native decode attention's register paths (head dims 32, 64 and 128, over keys more
    than its prefetch distance and not a multiple of 16) and its generic loop (48)."""
    _run_both(_spec(head_dim=head_dim), STEPS)


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
