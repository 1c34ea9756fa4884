"""Conformance family "attention", Qwen3's per-head q/k RMSNorm: ``layers.Attention`` given the
model's ``q_norm`` and ``k_norm`` either hands them to a backend that says ``fuses_qk_norm`` for
the step (the norm, rotary and KV write inside its attention) or runs ``qk_rms_norm`` first; either
way the cache must hold, and attention must use, keys and queries normed per head (each head's D
channels, q's with q's weight, k's with k's), rounded to the dtype as the unfused op stores them,
then rotated.

The float64 reference is written here, independent of every backend: per-head RMSNorm, rounded to
the dtype, the rotation (``ops_reference.rotary_embedding``), rounded again. A written key may be
off that by one ulp of its own rounding and by one ulp of the normed inputs it was rotated from
(float32 and float64 can straddle a rounding tie of the norm), not more: a norm applied after the
rotary, a weight of the other tensor, or a norm left out are off by O(1) of the head's values.
Outputs are checked against attention over the cache with the reference queries, within the
attention tolerance. Cases: GQA 4 and 8, head dims 64 and 128, every declared dtype, decode steps
over short contexts (one tile: unsplit on a split-KV kernel) and over 1K keys (split), and a mixed
step (which no decode kernel takes: the plain sequence).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch

from conformance_tests import grid, reference, solution_variants
from conformance_tests import ops_reference as ops_ref
from conformance_tests.batches import (
    Seq,
    allocate_blocks,
    build_batch,
    one_cpu_thread,
    random_caches,
    spec_or_skip,
)
from conformance_tests.solution_variants import _solution_under_test  # noqa: F401
from conformance_tests.tolerances import tolerance
from xhal.interfaces import BatchKind
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.layers import Attention, RMSNorm, RotaryEmbedding
from xhal.solutions.op_names import ATTENTION_OPS

pytestmark = pytest.mark.kernel_ops(*ATTENTION_OPS)  # every attention solution, as test_attention

F64 = torch.float64
EPS = 1e-6
NUM_LAYERS = 2
_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SHAPES = {  # name -> (kind, sequences)
    "short": (BatchKind.DECODE, [Seq(1, 17), Seq(1, 1), Seq(1, 40), Seq(1, 33)]),
    "long": (BatchKind.DECODE, [Seq(1, 1100), Seq(1, 2), Seq(1, 530)]),
    "mixed": (BatchKind.MIXED, [Seq(1, 70), Seq(5, 40), Seq(1, 3)]),
}
CASES = [  # (group, head dim, shape, NeoX halves or GPT-J pairs); Qwen3 rotates NeoX halves
    (group, head_dim, shape, True)
    for group in (4, 8)
    for head_dim in (64, 128)
    for shape in ("short", "long")
] + [(8, 64, "long", False), (4, 128, "mixed", True)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    solution_variants.parametrize(metafunc)
    if "dtype" in metafunc.fixturenames:
        caps = grid.platform_of(metafunc.config).capabilities.attention
        dtypes = [d for d in (torch.float32, torch.bfloat16) if d in caps.dtypes]
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


def rand(shape, dtype, device, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64).clamp(-2.0, 2.0) * scale + shift
    return x.to(device, dtype)


def normed_then_rotated(x, weight, positions, table, is_neox, dtype):
    """The unfused sequence in float64: (the normed heads rounded to the dtype, as qk_rms_norm
    stores them; those rotated, in float64). ``x [T, heads, D]``."""
    normed = ops_ref.rms_norm(x, weight, EPS).to(dtype).to(F64)
    return normed, ops_ref.rotary_embedding(positions, normed, table, is_neox)


def key_bound(rotated: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element: the written key's own rounding, plus one ulp of the normed inputs it mixes
    (at most twice the unit roundoff of the head's largest normed value)."""
    if dtype not in ops_ref.ULP_BITS:
        return torch.full_like(rotated, tolerance("ops", dtype))
    rounded = rotated.to(dtype).to(F64)
    exponent = torch.floor(torch.log2(rounded.abs().clamp_min(ops_ref.ULP_FLOOR)))
    ulp = torch.exp2(exponent - (ops_ref.ULP_BITS[dtype] - 1))
    return ulp + 2 * _UNIT[dtype] * normed.abs().amax(-1, keepdim=True)


@pytest.mark.parametrize(
    "group,head_dim,shape,is_neox",
    CASES,
    ids=[f"gqa{g}-d{d}-{s}-{'neox' if n else 'gptj'}" for g, d, s, n in CASES],
)
def test_qk_norm_through_the_layer(
    group, head_dim, shape, is_neox, platform, dtype, device, record_error
) -> None:
    kind, seqs = SHAPES[shape]
    caps = platform.capabilities.attention
    if kind not in caps.batch_kinds:
        pytest.skip(f"{platform.name} does not declare batch kind {kind.name}")
    if head_dim not in caps.head_dims:  # the listed ones (any_head_dim's sample), as grid.py
        pytest.skip(f"{platform.name} does not list head_dim {head_dim} ({list(caps.head_dims)})")
    spec = spec_or_skip(platform, dtype, head_dim, caps.block_sizes[0], group)
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rng = random.Random(f"qk_norm {group} {head_dim} {shape} {dtype} {is_neox}")
    num_blocks = sum(math.ceil(s.kv_len / spec.block_size) for s in seqs) + 3
    rows = allocate_blocks(seqs, spec.block_size, num_blocks, rng)
    batch = build_batch(kind, seqs, rows, spec.block_size, device, num_padding=2)
    caches = random_caches(NUM_LAYERS, num_blocks, spec, device, rng)
    backend = platform.attention_backend(spec)
    backend.bind_kv_caches(caches)
    rotary = RotaryEmbedding(d, d, 4096, 10000.0, is_neox_style=is_neox).to(device)
    positions = [p for s in seqs for p in range(s.kv_len - s.q_len, s.kv_len)]
    positions = torch.tensor(positions + [0, 0], dtype=torch.int32, device=device)
    num_tokens = len(batch.slots)
    before = reference.snapshot(caches)
    backend.plan(batch.metadata)
    fused = backend.fuses_qk_norm  # what the layer asks, after the plan
    ctx = ForwardContext(
        metadata=batch.metadata,
        attention={layer: backend for layer in range(NUM_LAYERS)},
        collective=platform.collective(None),
    )
    worst = 0.0
    for layer in range(NUM_LAYERS):
        attn = Attention(h, d, spec.softmax_scale, hkv, layer_id=layer)
        q_norm, k_norm = RMSNorm(d, EPS).to(device), RMSNorm(d, EPS).to(device)
        with torch.no_grad():  # two different weights: one used for the other shows
            q_norm.weight.copy_(rand(d, dtype, device, seed=layer, scale=0.2, shift=1.0))
            k_norm.weight.copy_(rand(d, dtype, device, seed=10 + layer, scale=0.6, shift=0.3))
        qkv = rand((num_tokens, (h + 2 * hkv) * d), dtype, device, seed=20 + layer)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)  # strided, as the models pass
        q = q * 3.0  # off unit scale, so a norm left out shows
        with forward_context(ctx):
            out = attn(q, k, v, positions, rotary, q_norm, k_norm)
        platform.synchronize()
        assert out.shape == (num_tokens, h * d) and out.dtype == dtype
        table = rotary.cos_sin_cache
        _, q_ref = normed_then_rotated(
            q.view(num_tokens, h, d), q_norm.weight, positions, table, is_neox, dtype
        )
        k_normed, k_ref = normed_then_rotated(
            k.view(num_tokens, hkv, d), k_norm.weight, positions, table, is_neox, dtype
        )
        written = [t for t, s in enumerate(batch.slots) if s >= 0]
        slots = [batch.slots[t] for t in written]
        key_now = caches[layer].key.detach().cpu().view(-1, hkv, d).to(F64)
        err = (key_now[slots] - k_ref[written]).abs()
        over = float((err / key_bound(k_ref[written], k_normed[written], dtype)).max())
        assert over <= 1.0, (
            f"layer {layer} ({'fused' if fused else 'qk_rms_norm, then the backend'}): written "
            f"keys {over:.1f}x their bound (max error {float(err.max()):.3e}) from the float64 "
            "per-head norm, rounded to the dtype, then rotary"
        )
        untouched = torch.ones(key_now.shape[0], dtype=torch.bool)
        untouched[slots] = False
        old_key = before[layer][0].view(-1, hkv, d)
        assert torch.equal(key_now[untouched], old_key[untouched].to(F64)), "stray key writes"
        expected_v = reference.written_cache(before[layer][1], batch.slots, v.view(-1, hkv, d))
        problem = reference.cache_mismatch(caches[layer].value, expected_v, batch.slots)
        assert problem is None, f"layer {layer} value cache: {problem}"
        expected = reference.attention(
            q_ref.to(dtype), caches[layer].key, caches[layer].value, batch, spec
        )
        worst = max(
            worst, reference.max_error(out.view(num_tokens, h, d), expected, batch.real_rows)
        )
    record_error(worst)
    tol = tolerance("attention", dtype)
    assert worst <= tol, f"{shape} ({'fused' if fused else 'plain'}): max error {worst:.3e} > {tol}"
