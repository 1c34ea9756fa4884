"""cpu-fast's native C kernels against independent references: the decode attention (rotary, KV
write and attention in one call) against the reference platform's rotary and attention, the norm
against its float64 definition, the greedy pick against hand-built picks, and the torch path
taking over, with one log line, when no
compiler is there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.paged_host import PagedHost
from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.cache import LayerCache
from xhal.platforms.cpu_fast.kernels import calls, native
from xhal.platforms.cpu_ref.ops import CpuOps

NUM_BLOCKS = 32

needs_native = pytest.mark.skipif(
    native.library() is None, reason="the native kernels did not build (no C compiler?)"
)


def _caches(spec: AttentionSpec) -> LayerCache:
    shape = (NUM_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return LayerCache(torch.zeros(shape), torch.zeros(shape))


@needs_native
@pytest.mark.parametrize(
    "features, rotary_dim, is_neox",
    [
        ({}, 32, True),
        ({}, 16, False),  # partial GPT-J rotary
        ({"sliding_window": 5, "logits_soft_cap": 8.0}, 32, True),
        ({}, None, True),  # no rotary: plain forward
    ],
    ids=["neox", "gptj-partial", "window-cap", "no-rotary"],
)
def test_decode_matches_the_reference_rotation_and_attention(
    features: dict, rotary_dim: int | None, is_neox: bool
) -> None:
    """Decodes of unequal lengths on permuted blocks, one padding row first: the native step
    writes the reference's rotated keys and values and attends as the reference platform does
    on its own caches (float32, to rounding)."""
    spec = AttentionSpec(
        num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=4,
        scale=32**-0.5, **features,
    )  # fmt: skip
    fast = platforms.get("cpu-fast").attention_backend(spec)
    ref = platforms.get("cpu").attention_backend(spec)
    fast_cache, ref_cache = _caches(spec), _caches(spec)
    fast.bind_kv_caches([fast_cache])
    ref.bind_kv_caches([ref_cache])
    host = PagedHost(NUM_BLOCKS, spec.block_size, seed=7)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(64, rotary_dim, generator=g) if rotary_dim else None
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    for step, chunks in enumerate(([(0, 9), (1, 3), (2, 14)], [(0, 1), (1, 1), (2, 1)],
                                   [(2, 1), (0, 1), (1, 1)])):  # fmt: skip
        _, positions, metadata = host.step([(s, [0] * n) for s, n in chunks])
        positions = positions.int()
        fast.plan(metadata)
        ref.plan(metadata)
        assert (fast._plan.native is not None) == (step > 0)  # decode-only steps go native
        qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim, generator=g)
        q, k, v = (part.view(len(positions), -1, dim) for part in
                   qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))  # fmt: skip
        if table is None:
            got, q_rot, k_rot = fast.forward(0, q, k, v), q, k
        else:
            got = fast.forward_rotary(0, q, k, v, positions, table, is_neox)
            q_rot, k_rot = CpuOps().rotary_embedding(positions, q, k, table, is_neox)
        want = ref.forward(0, q_rot, k_rot, v)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast_cache.key, ref_cache.key, rtol=1e-6, atol=1e-6)
        assert torch.equal(fast_cache.value, ref_cache.value)


@needs_native
@pytest.mark.parametrize("rows", [4, 300], ids=["decode-rows", "prefill-rows-threaded"])
def test_norm_matches_its_float64_definition(rows: int) -> None:
    g = torch.Generator().manual_seed(5)
    x, residual = torch.randn(rows, 240, generator=g), torch.randn(rows, 240, generator=g)
    weight = torch.randn(240, generator=g)
    x[2] *= 1e-3  # a small row: eps matters there
    normed, summed = calls.add_rms_norm(x, residual, weight, 1e-5)
    s64 = x.double() + residual.double()
    want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(summed.double(), s64, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(normed.double(), want, rtol=2e-6, atol=2e-6)
    plain, same = calls.add_rms_norm(x, None, weight, 1e-5)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert same is x
    torch.testing.assert_close(plain.double(), want, rtol=2e-6, atol=2e-6)
    # inputs the kernels do not read come back None: the caller's torch path serves them
    assert calls.add_rms_norm(x.t().contiguous().t(), None, weight, 1e-5) is None
    assert calls.add_rms_norm(x.bfloat16(), None, weight, 1e-5) is None


@needs_native
def test_decode_attention_is_the_same_on_one_thread_or_several() -> None:
    """The (sequence, kv head) pairs split over threads each do the one-thread arithmetic: the
    output is bit for bit the same at 1 and 2 threads, for a batch of unequal lengths long
    enough (488 keys over 2 kv heads) for the kernel to take threads."""
    spec = AttentionSpec(
        num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16,
        scale=32**-0.5,
    )  # fmt: skip
    num_blocks = 40
    host = PagedHost(num_blocks, spec.block_size, seed=9)
    host.step([(s, [0] * n) for s, n in ((0, 150), (1, 40), (2, 200), (3, 94))])
    _, positions, metadata = host.step([(s, [0]) for s in range(4)])
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, h, 32, generator=g) for h in (6, 2, 2))
    table = torch.randn(256, 32, generator=g)
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    base = LayerCache(torch.zeros(shape), torch.zeros(shape))
    base.key.normal_(generator=g)
    base.value.normal_(generator=g)
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            fast = platforms.get("cpu-fast").attention_backend(spec)
            cache = LayerCache(base.key.clone(), base.value.clone())
            fast.bind_kv_caches([cache])
            fast.plan(metadata)
            assert fast._plan.native is not None
            outs.append((fast.forward_rotary(0, q, k, v, positions.int(), table, True), cache))
    finally:
        torch.set_num_threads(threads)
    (one, one_cache), (two, two_cache) = outs
    assert torch.equal(one, two)
    assert torch.equal(one_cache.key, two_cache.key)



@needs_native
def test_greedy_pick_is_the_lowest_index_of_the_maximum_and_a_nan_first() -> None:
    """The native argmax against a hand-built expectation: ties go to the lowest index, a row
    with a NaN picks its first NaN (torch's rule), an all ``-inf`` row picks 0; strided rows
    (a slice of a wider buffer) are read in place; the platform's ops serve greedy picks by it."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(6, 1100, generator=g)
    logits = wide[:, :1000]  # rows 1100 floats apart
    logits[0, 17] = logits[0, 900] = 40.0  # a tie: 17
    logits[1, 999] = 41.0  # the last column
    logits[2, 3] = logits[2, 5] = float("nan")  # NaN wins, the first one
    logits[2, 4] = 50.0
    logits[3] = float("-inf")
    logits[4, 0] = 42.0  # the first column
    logits[5, 500] = float("inf")
    expected = [17, 999, 3, 0, 0, 500]
    assert calls.argmax_rows(logits).tolist() == expected
    assert calls.argmax_rows(logits[:1]).tolist() == expected[:1]
    assert calls.argmax_rows(logits.contiguous()).tolist() == expected
    cpu_fast = platforms.get("cpu-fast").ops
    assert cpu_fast.argmax(logits).tolist() == expected
    # what the kernel does not read (other dtypes, columns not unit-strided) comes back None,
    # and the ops fall back to torch's argmax
    assert calls.argmax_rows(logits.double()) is None
    assert calls.argmax_rows(logits.t()) is None
    assert cpu_fast.argmax(logits.double()).tolist() == expected



def test_without_a_compiler_the_torch_path_serves_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))  # no build cached there
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.library() is None
        assert native.library() is None  # tried once, logged once
    assert len(caplog.records) == 1
    assert "did not build" in caplog.records[0].getMessage()
    from xhal.platforms.cpu_fast.ops import FastCpuOps

    g = torch.Generator().manual_seed(6)
    x, weight = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(
        FastCpuOps().rms_norm(x, weight, 1e-6), CpuOps().rms_norm(x, weight, 1e-6)
    )


@needs_native
def test_the_build_is_cached_and_can_be_switched_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    assert native.library() is not None
    assert len(list((tmp_path / "cpu_fast").glob("decode_kernels-*.so"))) == 1
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # a second process: no compile
    assert native.library() is not None
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("XHAL_CPU_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.library() is None
    assert "XHAL_CPU_NATIVE=0" in caplog.records[-1].getMessage()
    with native.torch_path():  # benchmarks' switch, whatever was loaded
        monkeypatch.setattr(native, "_tried", False)
        monkeypatch.delenv("XHAL_CPU_NATIVE")
        assert native.library() is None


@needs_native
def test_prefill_rotary_leaves_positions_past_the_table_to_the_torch_path() -> None:
    """The native rotary reads the table's rows unchecked: a position past its end (or below 0)
    is not served (nothing written), so the torch path raises its own indexing error."""
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(40, 4, 16, generator=g), *torch.randn(2, 40, 2, 16, generator=g)
    k_flat, v_flat = torch.zeros(64, 2, 16), torch.zeros(64, 2, 16)
    table, slots, out = torch.randn(50, 16, generator=g), torch.arange(40), torch.empty(40, 6, 16)
    positions = torch.arange(40, dtype=torch.int32)
    args = (table, True, slots, k_flat, v_flat, out)
    assert calls.rotary_write(q, k, v, positions, *args)
    assert torch.equal(v_flat[:40], v)  # written
    v_flat.zero_()
    for bad in (50, -1):
        positions[7] = bad
        assert not calls.rotary_write(q, k, v, positions, *args)
        assert not v_flat.any()  # nothing written


def _causal_float64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention spelled out in float64: q ``[Lq, H, D]``, the last Lq of the keys
    ``[L, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [H(kv), T, D]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) * scale  # [H, T, T]
    num_queries, num_keys = scores.shape[-2:]
    future = torch.ones(num_queries, num_keys, dtype=torch.bool).triu(1 + num_keys - num_queries)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (weights @ v).transpose(0, 1)


@needs_native
@pytest.mark.parametrize(
    "num_tokens, prefix, heads, kv_heads, dim",
    [
        (1, 0, 9, 3, 64),
        (31, 0, 4, 4, 32),
        (65, 0, 8, 2, 64),
        (300, 0, 9, 3, 64),
        (97, 0, 6, 1, 128),
        (1, 70, 9, 3, 64),  # cached prefixes: off a block edge, on one, longer than the chunk
        (40, 64, 4, 2, 32),
        (33, 130, 9, 3, 64),
    ],
)
def test_prefill_attention_matches_causal_attention_in_float64(
    num_tokens: int, prefix: int, heads: int, kv_heads: int, dim: int
) -> None:
    """The native causal prefill attention (key blocks of 64, query blocks of 32, the heads of a
    KV group together) on q, k, v as column blocks of one qkv buffer, the chunk's queries the
    last of its keys (after a cached prefix or none), against float64: lengths off every block
    edge, one token, no GQA and a group of 6, on one thread and two (scores up to |s| ~ 20, so
    the running max is exercised)."""
    g = torch.Generator().manual_seed(num_tokens + prefix)
    num_keys = prefix + num_tokens
    qkv = torch.randn(num_keys, (heads + 2 * kv_heads) * dim, generator=g) * 1.5
    q, k, v = (
        part.view(num_keys, -1, dim)
        for part in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    )
    q = q[prefix:]
    scale = dim**-0.5
    want = _causal_float64(q, k, v, scale)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full((num_tokens, heads, dim), float("nan"))
            assert calls.prefill_attention(q, k, v, scale, out)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_prefill_attention_declines_what_it_does_not_read() -> None:
    """Head dims that are not a multiple of 32, bfloat16, a strided head axis, fewer keys than
    queries, a non-contiguous output and any call inside ``sdpa_prefill()`` come back False with
    the output untouched: the caller's SDPA serves them."""
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    out = torch.zeros(5, 4, 32)
    assert not calls.prefill_attention(q[..., :16], k[..., :16], k[..., :16], 1.0, out[..., :16])
    assert not calls.prefill_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 1.0, out)
    assert not calls.prefill_attention(q, k[:, :1].expand(5, 2, 32), k, 1.0, out)
    assert not calls.prefill_attention(q, k[:4], k[:4], 1.0, out)
    assert not calls.prefill_attention(q, k, k, 1.0, torch.zeros(5, 32, 4).transpose(1, 2))
    with calls.sdpa_prefill():
        assert not calls.prefill_attention(q, k, k, 1.0, out)
    assert not out.any()
    assert calls.prefill_attention(q, k, k, 1.0, out)  # served again after the block
