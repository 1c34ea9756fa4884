"""Conformance family "attention", a decoder layer's whole attention block in one backend call
(``AttentionBackend.forward_block``): the residual add, the input RMSNorm, the qkv projection,
Qwen3's per-head q/k norms (when the block has them), rotary, the KV write, attention and the o
projection. A backend that says ``fuses_block`` for a planned step is held to the unfused sequence
here; one that never says it, or declines the call (``forward_block`` returns None), skips (the
layer then runs the sequence, which the rest of the suite covers op by op). Declining under graph
capture a block the eager warm-up ran fails: the decode graph would not hold what was checked.

The float64 reference is written here, independent of every backend. Each stored value may be
off it by what the fused family allows a fused GEMV (``test_fused.gemv_bound``: one skipped
rounding of the normed input, float32 accumulation) and by the roundings after it:

- the new residual: the 1-ulp rule of every op output;
- the written values: the qkv projection's bound ``B``; the written keys: ``B`` carried through
  the per-head norm (scaled by the norm's gain) and the rotation (a pair of channels: twice), plus
  the key's own rounding and, with the norm, one ulp of the normed inputs (as
  ``test_attention_qk_norm`` allows);
- the output: attention (over the cache as written, with the reference's queries) within the
  attention tolerance ``t`` per channel, then rounded, then the o projection:
  ``|o - o_ref| <= gemv_bound + 4 sqrt(sum_k W_nk^2 (t + ulp(attn_k))^2)`` (independent
  deviations). The queries are drawn at three times the keys' scale, so each head's attention
  picks a few keys and its output stays O(1), where the absolute tolerance ``t`` means something.

A block that forgets the residual add, the norm, the rotation of either q or k, a head's KV group
or the o projection is off by O(1) of the output. Cases: batch-1 decodes (where a GPU kernel
takes the block) over one key, a short context and over 1K keys, GQA 4 and 8, head dims 64 and
128, with and without the q/k norm, NeoX halves and GPT-J pairs; a batch of three decodes and a
mixed step, which a backend may also fuse. In a captured graph (a decode bucket of one sequence,
as the executor captures it), replays with new inputs must equal eager calls on the same inputs
exactly, as the graph family requires of every backend.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conformance_tests import ops_reference as ops_ref
from conformance_tests import reference
from conformance_tests.batches import (
    Seq,
    allocate_blocks,
    build_batch,
    random_caches,
    runner_or_skip,
    spec_or_skip,
)
from conformance_tests.solution_variants import _solution_under_test  # noqa: F401
from conformance_tests.test_attention_qk_norm import (  # the same grid of solutions and dtypes
    _one_cpu_thread,  # noqa: F401
    pytest_generate_tests,  # noqa: F401
    rand,
)
from conformance_tests.test_fused import _UNIT_ROUNDOFF, check_residual, gemv_bound, norm_reference
from conformance_tests.tolerances import tolerance
from xhal.interfaces import AttentionBlock, BatchKind, Platform
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.layers import Attention, RotaryEmbedding
from xhal.solutions.op_names import ATTENTION_OPS

pytestmark = pytest.mark.kernel_ops(*ATTENTION_OPS)  # every attention solution, as test_attention

F64 = torch.float64
EPS = 1e-5
QK_EPS = 1e-6
HIDDEN = 384  # not the heads' H * D: the two projections' row lengths differ
NUM_LAYERS = 2
SHAPES = {  # name -> (kind, sequences)
    "one-key": (BatchKind.DECODE, [Seq(1, 1)]),
    "short": (BatchKind.DECODE, [Seq(1, 37)]),
    "long": (BatchKind.DECODE, [Seq(1, 1100)]),
    "three": (BatchKind.DECODE, [Seq(1, 17), Seq(1, 300), Seq(1, 2)]),
    "mixed": (BatchKind.MIXED, [Seq(1, 70), Seq(5, 40)]),
}
CASES = [  # (group, head dim, shape, q/k norm, NeoX halves or GPT-J pairs)
    (group, head_dim, shape, qk_norm, True)
    for group in (4, 8)
    for head_dim in (64, 128)
    for shape in ("short", "long")
    for qk_norm in (False, True)
] + [
    (4, 64, "one-key", False, True),
    (8, 128, "one-key", True, True),
    (4, 64, "long", False, False),
    (4, 128, "three", False, True),
    (8, 64, "mixed", True, True),
]


def random_block(spec, dtype, device, seed: int, qk_norm: bool, rotary) -> AttentionBlock:
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    # queries three times the keys' scale (the q rows, or q's norm weight): scores spread enough
    # that each head's attention picks a few keys, so its output stays O(1) over long contexts
    qkv_weight = rand(((h + 2 * hkv) * d, HIDDEN), dtype, device, seed + 1, HIDDEN**-0.5)
    norms = {}
    if qk_norm:  # two different weights, so that one used for the other shows
        norms = dict(
            q_norm_weight=rand(d, dtype, device, seed + 3, scale=0.5, shift=3.0),
            k_norm_weight=rand(d, dtype, device, seed + 4, scale=0.6, shift=0.3),
            qk_norm_eps=QK_EPS,
        )
    else:
        with torch.no_grad():
            qkv_weight[: h * d] *= 3.0
    return AttentionBlock(
        norm_weight=rand(HIDDEN, dtype, device, seed, scale=0.3, shift=1.0),
        norm_eps=EPS,
        qkv_weight=qkv_weight,
        o_weight=rand((HIDDEN, h * d), dtype, device, seed + 2, scale=(h * d) ** -0.5),
        cos_sin_cache=rotary.cos_sin_cache,
        is_neox=rotary.is_neox_style,
        **norms,
    )


def block_reference(block: AttentionBlock, hidden, residual, positions, spec, dtype):
    """The unfused sequence in float64, every stored value rounded to the dtype as the unfused
    ops store it: (the normed rows, qkv before its rounding, the new residual, q, k (normed,
    rotated) and v as they reach the cache, k as the projection stores it, the normed keys
    before the rotation (or None))."""
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    normed, qkv_exact, summed = norm_reference(
        hidden, residual, block.norm_weight, EPS, block.qkv_weight, None, dtype
    )
    qkv = qkv_exact.to(dtype).to(F64)
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, h, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    k_pre, k_normed = k, None
    if block.q_norm_weight is not None:
        q = ops_ref.rms_norm(q, block.q_norm_weight, QK_EPS).to(dtype).to(F64)
        k = k_normed = ops_ref.rms_norm(k, block.k_norm_weight, QK_EPS).to(dtype).to(F64)
    table = block.cos_sin_cache
    q = ops_ref.rotary_embedding(positions, q, table, block.is_neox).to(dtype).to(F64)
    k = ops_ref.rotary_embedding(positions, k, table, block.is_neox)
    return normed, qkv_exact, summed, q, k, v, k_pre, k_normed


def key_bound(k_ref, k_pre, k_normed, qkv_bound_k, block, dtype) -> torch.Tensor:
    """Per written key element: the qkv bound of its head (through the norm when normed, twice
    for the rotation's pair), its own rounding, and one ulp of the normed inputs when normed."""
    head_bound = qkv_bound_k.amax(-1, keepdim=True)  # [T, Hkv, 1]
    if k_normed is not None:
        # n = x w / rms(x): a deviation b of x's channels moves n by at most
        # b |w| (1 + max|x| / rms) / rms (the channel itself, then the rms it changes)
        w_max = block.k_norm_weight.detach().cpu().double().abs().max()
        rms = (k_pre.pow(2).mean(-1, keepdim=True) + QK_EPS).sqrt()
        head_bound = head_bound * w_max * (1 + k_pre.abs().amax(-1, keepdim=True) / rms) / rms
    bound = 2.0 * head_bound + ops_ref.ulp(k_ref, dtype)
    if k_normed is not None:
        bound = bound + 2 * _UNIT_ROUNDOFF[dtype] * k_normed.abs().amax(-1, keepdim=True)
    return bound


def check_block(
    platform: Platform,
    group: int,
    head_dim: int,
    shape: str,
    qk_norm: bool,
    is_neox: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> float:
    """Run the block through ``layers.Attention`` on ``platform`` and check it; the worst output
    error relative to its bound (<= 1 passes). Skips when the backend does not fuse the block for
    the planned step."""
    kind, seqs = SHAPES[shape]
    caps = platform.capabilities.attention
    if kind not in caps.batch_kinds:
        pytest.skip(f"{platform.name} does not declare batch kind {kind.name}")
    if head_dim not in caps.head_dims:
        pytest.skip(f"{platform.name} does not list head_dim {head_dim} ({list(caps.head_dims)})")
    spec = spec_or_skip(platform, dtype, head_dim, caps.block_sizes[0], group)
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rng = random.Random(f"block {group} {head_dim} {shape} {qk_norm} {is_neox} {dtype}")
    num_blocks = sum(math.ceil(s.kv_len / spec.block_size) for s in seqs) + 3
    rows = allocate_blocks(seqs, spec.block_size, num_blocks, rng)
    batch = build_batch(kind, seqs, rows, spec.block_size, device)
    caches = random_caches(NUM_LAYERS, num_blocks, spec, device, rng)
    backend = platform.attention_backend(spec)
    backend.bind_kv_caches(caches)
    backend.plan(batch.metadata)
    if not backend.fuses_block:
        pytest.skip(f"{type(backend).__name__} does not fuse the attention block of this step")
    rotary = RotaryEmbedding(d, d, 4096, 10000.0, is_neox_style=is_neox).to(device)
    positions = [p for s in seqs for p in range(s.kv_len - s.q_len, s.kv_len)]
    positions = torch.tensor(positions, dtype=torch.int32, device=device)
    num_tokens = len(batch.slots)
    before = reference.snapshot(caches)
    ctx = ForwardContext(
        metadata=batch.metadata,
        attention={layer: backend for layer in range(NUM_LAYERS)},
        collective=platform.collective(None),
    )
    worst = 0.0
    for layer in range(NUM_LAYERS):
        attn = Attention(h, d, spec.softmax_scale, hkv, layer_id=layer)
        block = random_block(spec, dtype, device, 100 * layer, qk_norm, rotary)
        hidden = rand((num_tokens, HIDDEN), dtype, device, seed=20 + layer)
        residual = rand((num_tokens, HIDDEN), dtype, device, seed=40 + layer, scale=2.0)
        with forward_context(ctx):
            fused = attn.forward_block(block, hidden, residual, positions)
        if fused is None:  # the layer would run its sequence, which the other families cover
            pytest.skip(f"{type(backend).__name__} declined the block of layer {layer}")
        out, summed = fused
        platform.synchronize()
        assert out.shape == (num_tokens, HIDDEN) and out.dtype == dtype, (out.shape, out.dtype)
        normed, qkv_exact, summed_ref, q_ref, k_ref, v_ref, k_pre, k_normed = block_reference(
            block, hidden, residual, positions, spec, dtype
        )
        check_residual(summed, summed_ref, dtype, lambda _: None)
        w_qkv = block.qkv_weight.detach().cpu().double()
        qkv_bound = gemv_bound(normed, w_qkv, qkv_exact, dtype)
        written = [t for t, s in enumerate(batch.slots) if s >= 0]
        slots = [batch.slots[t] for t in written]
        v_now = caches[layer].value.detach().cpu().view(-1, hkv, d).to(F64)
        v_bound = qkv_bound[:, (h + hkv) * d :].reshape(num_tokens, hkv, d)
        over_v = float(((v_now[slots] - v_ref[written]).abs() / v_bound[written]).max())
        assert over_v <= 1.0, f"layer {layer}: written values {over_v:.1f}x their bound"
        k_now = caches[layer].key.detach().cpu().view(-1, hkv, d).to(F64)
        k_qkv_bound = qkv_bound[:, h * d : (h + hkv) * d].reshape(num_tokens, hkv, d)
        bound = key_bound(k_ref, k_pre, k_normed, k_qkv_bound, block, dtype)
        err = (k_now[slots] - k_ref[written]).abs()
        over_k = float((err / bound[written]).max())
        assert over_k <= 1.0, (
            f"layer {layer}: written keys {over_k:.1f}x their bound (max error "
            f"{float(err.max()):.3e}) from the float64 norm, qkv, "
            f"{'q/k norm, ' if qk_norm else ''}rotary"
        )
        untouched = torch.ones(k_now.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(
            k_now[untouched], before[layer][0].view(-1, hkv, d)[untouched].to(F64)
        ), "stray key writes"
        # attention over the cache as the backend wrote it, with the reference's queries
        attn_ref = reference.attention(
            q_ref.to(dtype), caches[layer].key, caches[layer].value, batch, spec
        )  # [R, H, D]
        attn_ref = attn_ref.reshape(len(batch.real_rows), h * d)
        attn_stored = attn_ref.to(dtype).to(F64)
        w_o = block.o_weight.detach().cpu().double()
        o_ref = attn_stored @ w_o.T
        radius = tolerance("attention", dtype) + ops_ref.ulp(attn_stored, dtype)
        o_bound = gemv_bound(attn_stored, w_o, o_ref, dtype) + 4 * ((radius**2) @ (w_o**2).T).sqrt()
        err = (out.detach().cpu()[batch.real_rows].to(F64) - o_ref).abs()
        over = float((err / o_bound).nan_to_num(float("inf")).max())
        assert over <= 1.0, (
            f"layer {layer}: output {over:.2f}x its bound (max error {float(err.max()):.3e}) "
            "from the float64 sequence (norm, qkv, rotary, attention, o)"
        )
        worst = max(worst, over)
    return worst


@pytest.mark.parametrize(
    "group,head_dim,shape,qk_norm,is_neox",
    CASES,
    ids=[
        f"gqa{g}-d{d}-{s}{'-qknorm' if n else ''}-{'neox' if x else 'gptj'}"
        for g, d, s, n, x in CASES
    ],
)
def test_attention_block(
    group, head_dim, shape, qk_norm, is_neox, platform, dtype, device, record_error
) -> None:
    worst = check_block(platform, group, head_dim, shape, qk_norm, is_neox, dtype, device)
    record_error(worst)


def check_block_in_graph(
    platform: Platform, group: int, head_dim: int, qk_norm: bool, dtype, device
) -> None:
    """The block captured as a one-sequence decode bucket (an eager call first, as the
    executor's warm-up makes one) and replayed twice with new hidden and residual rows: each
    replay's outputs equal an eager call's on the same inputs, bit for bit. Skips as
    ``check_block`` does."""
    runner = runner_or_skip(platform)
    caps = platform.capabilities.attention
    if head_dim not in caps.head_dims:
        pytest.skip(f"{platform.name} does not list head_dim {head_dim} ({list(caps.head_dims)})")
    spec = spec_or_skip(platform, dtype, head_dim, caps.block_sizes[0], group)
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rng = random.Random(f"block graph {group} {head_dim} {qk_norm} {dtype}")
    seqs = [Seq(1, 300)]
    num_blocks = math.ceil(300 / spec.block_size) + 3
    rows = allocate_blocks(seqs, spec.block_size, num_blocks, rng)
    batch = build_batch(BatchKind.DECODE, seqs, rows, spec.block_size, device)
    backend = platform.attention_backend(spec)
    backend.bind_kv_caches(random_caches(1, num_blocks, spec, device, rng))
    backend.plan(batch.metadata)  # eagerly first: a backend that never fuses may refuse graphs
    if not backend.fuses_block:
        pytest.skip(f"{type(backend).__name__} does not fuse the attention block of this step")
    key = ("decode", 1)
    backend.plan(batch.metadata, graph_key=key)
    rotary = RotaryEmbedding(d, d, 4096, 10000.0).to(device)
    block = random_block(spec, dtype, device, 7, qk_norm, rotary)
    attn = Attention(h, d, spec.softmax_scale, hkv, layer_id=0)
    positions = torch.tensor([299], dtype=torch.int32, device=device)
    hidden = rand((1, HIDDEN), dtype, device, seed=1)
    residual = rand((1, HIDDEN), dtype, device, seed=2, scale=2.0)
    ctx = ForwardContext(
        metadata=batch.metadata, attention={0: backend}, collective=platform.collective(None)
    )

    def step():
        return attn.forward_block(block, hidden, residual, positions)

    with forward_context(ctx):
        # the warm-up: whatever a backend builds, it builds outside the capture
        if step() is None:
            pytest.skip(f"{type(backend).__name__} declined the block of this step")
        platform.synchronize()
        captured = runner.capture(key, step)
    assert captured is not None, (
        "the backend declined under capture the block it ran eagerly: a decode graph would "
        "hold the unfused layer where the eager step fused it"
    )
    for seed in (11, 12):
        hidden.copy_(rand((1, HIDDEN), dtype, device, seed=seed))
        residual.copy_(rand((1, HIDDEN), dtype, device, seed=seed + 1, scale=2.0))
        backend.plan(batch.metadata, graph_key=key)
        backend.before_replay(key)
        replayed = [t.clone() for t in runner.replay(key)]
        backend.plan(batch.metadata)
        with forward_context(ctx):
            eager = step()
        platform.synchronize()
        for name, r, e in zip(("output", "new residual"), replayed, eager):
            assert torch.equal(r, e), (
                f"the replayed block's {name} differs from an eager call on the same inputs "
                f"(max difference {float((r.float() - e.float()).abs().max()):.3e})"
            )


@pytest.mark.parametrize(
    "group,head_dim,qk_norm", [(4, 64, False), (8, 128, True)], ids=["gqa4-d64", "gqa8-d128-qknorm"]
)
def test_attention_block_in_a_graph(group, head_dim, qk_norm, platform, dtype, device) -> None:
    check_block_in_graph(platform, group, head_dim, qk_norm, dtype, device)
