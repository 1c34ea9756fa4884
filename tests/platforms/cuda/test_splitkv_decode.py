"""The single-launch split-KV decode kernel (``kernels/splitkv_decode.py``) and its backend
against a float64 reference: GQA groups 4 and 8, sequences ending mid-page, several splits merged
by the last program to arrive, counters back at 0 after every launch. Interpreted on CPU when
there is no CUDA device (tests/support/triton_env.py); the cases stay tiny."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.triton_env import DEVICE, NO_RUNTIME_LOOPS, RUNTIME_LOOPS

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from xhal.platforms.cuda.kernels.splitkv_decode import Scratch, num_splits, splitkv_decode

pytestmark = pytest.mark.skipif(not RUNTIME_LOOPS, reason=f"split-KV decode {NO_RUNTIME_LOOPS}")

PAGE, HEAD_DIM = 16, 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _reference(q, k_cache, v_cache, table, kv_lens, scale, soft_cap=0.0, window=0):
    """float64: each sequence's keys gathered position by position through its block table,
    one query at position kv_len - 1 seeing its last ``window`` keys (all when 0)."""
    num_seqs, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, kv_len in enumerate(kv_lens.tolist()):
        n = torch.arange(kv_len)
        blocks = table[i, n // PAGE].long()
        keys, values = k_cache[blocks, n % PAGE].double(), v_cache[blocks, n % PAGE].double()
        for h in range(num_heads):
            s = keys[:, h // group] @ q[i, h].double() * scale
            if soft_cap > 0:
                s = soft_cap * torch.tanh(s / soft_cap)
            if window > 0:
                s[: max(kv_len - window, 0)] = float("-inf")
            out[i, h] = torch.softmax(s, dim=0) @ values[:, h // group]
    return out


def _case(kv_lens: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int):
    """A shuffled block table whose columns past each row's pages point at a block of NaNs (stale
    ids the kernel must never read), and q as a strided view of a fused qkv row."""
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(n / PAGE) for n in kv_lens) + 1
    num_blocks = width * len(kv_lens) + 1
    nan_block = num_blocks - 1
    table = torch.full((len(kv_lens), width), nan_block, dtype=torch.int32)
    ids = torch.randperm(nan_block, generator=g)
    for i, n in enumerate(kv_lens):
        pages = math.ceil(n / PAGE)
        table[i, :pages] = ids[i * width : i * width + pages]
    shape = (num_blocks, PAGE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    k_cache[nan_block], v_cache[nan_block] = float("nan"), float("nan")
    qkv = torch.randn(len(kv_lens), num_heads + 2 * num_kv_heads, HEAD_DIM, generator=g)
    q = qkv.to(dtype)[:, :num_heads]
    return q, k_cache, v_cache, table, torch.tensor(kv_lens, dtype=torch.int32)


def _check(out, ref, dtype) -> None:
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(ref.abs().max().item(), 1.0), err


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, dtype",
    [(8, 2, torch.bfloat16), (8, 1, torch.float32)],
    ids=["gqa4-bf16", "gqa8-fp32"],
)
def test_splits_merge_in_one_launch_and_counters_reset(num_heads, num_kv_heads, dtype) -> None:
    """Four splits over sequences ending mid-page (one of them a single key, so most of its
    splits are empty); a second launch on the same scratch with new queries and one more key
    per sequence is right too, which it cannot be if a counter was left above 0."""
    kv_lens = [150, 1, 37]
    q, k_cache, v_cache, table, lens = _case(kv_lens, num_heads, num_kv_heads, dtype, seed=0)
    splits, scale = 4, HEAD_DIM**-0.5
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    scratch = Scratch.make(len(kv_lens), num_kv_heads, num_heads // num_kv_heads, HEAD_DIM,
                           splits, torch.device(DEVICE))  # fmt: skip
    out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
    splitkv_decode(*dev[:5], out, scratch, splits, scale)
    _check(out, _reference(q, k_cache, v_cache, table, lens, scale), dtype)
    assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)

    q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    lens2 = lens + 1  # 151, 2, 38: still within each row's pages
    splitkv_decode(q2.to(DEVICE), *dev[1:4], lens2.to(DEVICE), out, scratch, splits, scale)
    _check(out, _reference(q2, k_cache, v_cache, table, lens2, scale), dtype)
    assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)


def test_window_and_soft_cap() -> None:
    """A sliding window that starts inside a tile of one split, a soft cap, three splits."""
    kv_lens = [140, 9]
    q, k_cache, v_cache, table, lens = _case(kv_lens, 4, 1, torch.float32, seed=2)
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    scratch = Scratch.make(2, 1, 4, HEAD_DIM, 3, torch.device(DEVICE))
    out = torch.zeros(q.shape, device=DEVICE)
    splitkv_decode(*dev, out, scratch, 3, 0.2, soft_cap=2.0, window=70)
    _check(out, _reference(q, k_cache, v_cache, table, lens, 0.2, 2.0, 70), torch.float32)


def test_split_count_fills_the_sms_from_shapes_only(monkeypatch) -> None:
    from xhal.platforms.cuda.kernels import splitkv_splits

    # the last program's merge (the spread merge's counts: test_splitkv_merge.py)
    monkeypatch.setattr(splitkv_splits, "SPREAD", False)
    # (num_seqs, kv heads, group, head dim, max context, SMs): two programs per SM wanted (33
    # splits at batch 1 x 8 KV heads on 132 SMs), capped by one merge round of 8K floats (16
    # splits of 4 x 128, 8 of 8 x 128), by the 64-key tiles of the context and by 64
    assert num_splits(1, 8, 4, 128, 4096, 132) == 16
    assert num_splits(1, 4, 8, 128, 4096, 132) == 8
    assert num_splits(4, 8, 4, 128, 4096, 132) == 9
    assert num_splits(1, 8, 4, 128, 100, 132) == 2
    assert num_splits(64, 8, 4, 128, 4096, 132) == 1
    assert num_splits(1, 1, 1, 64, 1 << 20, 132) == 64


def test_scratch_too_small_is_refused() -> None:
    q, k_cache, v_cache, table, lens = _case([20, 20], 4, 1, torch.float32, seed=3)
    scratch = Scratch.make(1, 1, 4, HEAD_DIM, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="scratch too small"):
        splitkv_decode(q, k_cache, v_cache, table, lens, torch.zeros(q.shape), scratch, 2, 1.0)


def test_a_pdl_setting_other_than_off_early_late_is_refused() -> None:
    """``use_pdl`` names the launch's trigger (``pdl.AUTO`` is a GEMV's size rule, not a
    trigger), and a prefetch depth is a count of tiles."""
    from xhal.platforms.cuda import pdl

    q, k_cache, v_cache, table, lens = _case([20], 4, 1, torch.float32, seed=3)
    scratch = Scratch.make(1, 1, 4, HEAD_DIM, 1, torch.device("cpu"))
    args = (q, k_cache, v_cache, table, lens, torch.zeros(q.shape), scratch, 1, 1.0)
    with pytest.raises(ValueError, match="use_pdl must be pdl.OFF, EARLY or LATE"):
        splitkv_decode(*args, use_pdl=pdl.AUTO)
    with pytest.raises(ValueError, match="prefetch >= 0 tiles"):
        splitkv_decode(*args, prefetch=-1)


def test_backend_takes_small_decodes_and_keeps_the_graph_key_policy() -> None:
    """Decode steps of ``min_seqs`` up to ``max_seqs`` sequences run split (two splits here), the
    others on the fallback; a graph key refuses metadata tensors other than those it was planned
    with."""
    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import AttentionSpec, BatchKind, LayerCache
    from xhal.platforms.cuda.splitkv_attention import SplitKVDecodeAttention
    from xhal.platforms.cuda.triton_attention import TritonAttention

    spec = AttentionSpec(8, 2, HEAD_DIM, torch.float32, PAGE)
    fallback = TritonAttention(spec)
    backend = SplitKVDecodeAttention(spec, fallback, num_sms=4, min_seqs=3, max_seqs=4)
    g = torch.Generator().manual_seed(4)
    shape = (24, PAGE, 2, HEAD_DIM)
    cache = LayerCache(torch.randn(shape, generator=g).to(DEVICE),
                       torch.randn(shape, generator=g).to(DEVICE))  # fmt: skip
    backend.bind_kv_caches([cache])
    blocks = torch.randperm(24, generator=g).tolist()

    def step(kv_lens: list[int]):
        rows, start = [], 0
        for n in kv_lens:
            rows.append(blocks[start : start + math.ceil(n / PAGE)])
            start += len(rows[-1])
        seqs = [Seq(1, n) for n in kv_lens]
        return build_batch(BatchKind.DECODE, seqs, rows, PAGE, torch.device(DEVICE),
                           max_blocks=12).metadata  # fmt: skip

    for kv_lens, split in (([150, 20, 5], True), ([40, 3], False), ([9, 8, 7, 6], False)):
        m = step(kv_lens)
        backend.plan(m, graph_key=len(kv_lens))
        assert (backend._decode is not None) == split
        if split:
            assert backend._decode.splits == 2
        qkv = torch.randn(len(kv_lens), 12, HEAD_DIM, generator=g).to(DEVICE)
        q, k, v = qkv.split([8, 2, 2], dim=1)
        out = backend.forward(0, q, k, v)
        ref = _reference(q.cpu(), cache.key.cpu(), cache.value.cpu(), m.block_table.cpu(),
                         m.kv_seq_lens_host, spec.softmax_scale)  # fmt: skip
        _check(out, ref, torch.float32)
        with pytest.raises(ValueError, match="persistent"):
            backend.plan(step(kv_lens), graph_key=len(kv_lens))


def _rotate64(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, is_neox: bool):
    """float64 rotary of ``x [B, heads, D]`` at ``pos [B]`` from a cos | sin ``table``, written
    out from the definition (NeoX halves or GPT-J pairs, dims past rotary_dim unrotated)."""
    x = x.double().clone()
    half = table.shape[1] // 2
    cos = table[pos.long(), :half].double()[:, None, :]
    sin = table[pos.long(), half:].double()[:, None, :]
    if is_neox:
        x1, x2 = x[..., :half].clone(), x[..., half : 2 * half].clone()
        x[..., :half], x[..., half : 2 * half] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0 : 2 * half : 2].clone(), x[..., 1 : 2 * half : 2].clone()
        x[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
        x[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
    return x


def _fused_case(kv_lens, num_heads, num_kv_heads, dtype, seed, rotary_dim, is_neox):
    """A ``_case`` plus this step's strided k / v and slots at each row's position kv_len - 1
    (those cache slots hold NaN before the launch: a program reading one would poison its
    output), the rotary table and positions; a last row of padding (kv_len 1, slot -1)."""
    q, k_cache, v_cache, table, lens = _case(kv_lens, num_heads, num_kv_heads, dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    qkv = torch.randn(len(kv_lens), num_heads + 2 * num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    k_new, v_new = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    last = lens.long() - 1
    slots = table[torch.arange(len(kv_lens)), last // PAGE].long() * PAGE + last % PAGE
    slots[-1] = -1  # the padding row
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // PAGE, slot % PAGE] = float("nan")
            v_cache[slot // PAGE, slot % PAGE] = float("nan")
    positions = last.to(torch.int32) + 5  # positions are the host's: not kv_len - 1 here
    angles = torch.rand(positions.max().item() + 8, rotary_dim // 2, generator=g) * 6.0
    rot_table = torch.cat([angles.cos(), angles.sin()], dim=1)  # float32 [max_pos, rotary_dim]
    slots = slots.to(torch.int32)
    return q, k_cache, v_cache, table, lens, k_new, v_new, slots, positions, rot_table


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, dtype, rotary_dim, is_neox, splits",
    [(8, 2, torch.bfloat16, 48, True, 4), (8, 1, torch.float32, 64, False, 3),
     (4, 1, torch.float32, 0, True, 1)],
    ids=["gqa4-bf16-neox-partial-4splits", "gqa8-fp32-gptj-3splits", "no-rotary-unsplit"],
)  # fmt: skip
def test_fused_rotary_and_kv_write(num_heads, num_kv_heads, dtype, rotary_dim, is_neox, splits):
    """The new token's k / v come with the launch (rotated in it unless rotary_dim is 0): the
    cache then holds exactly what the unfused rotary + KV write would store (and nothing else
    changed, the padding row's slot -1 included), and the output is attention over that cache;
    a second launch on the same scratch, one key later, is right too (counters reset)."""
    from xhal.platforms.cuda.kernels.splitkv_decode import NewToken, Rotary

    kv_lens = [150, 1, 37, 64, 1]
    case = _fused_case(kv_lens, num_heads, num_kv_heads, dtype, 5, rotary_dim or 2, is_neox)
    q, k_cache, v_cache, table, lens, k_new, v_new, slots, positions, rot_table = case
    scale = HEAD_DIM**-0.5
    scratch = Scratch.make(len(kv_lens), num_kv_heads, num_heads // num_kv_heads, HEAD_DIM,
                           splits, torch.device(DEVICE))  # fmt: skip
    for step in range(2):
        if rotary_dim:
            want_q = _rotate64(q, positions, rot_table, is_neox).to(dtype)
            want_k = _rotate64(k_new, positions, rot_table, is_neox).to(dtype)
        else:
            want_q, want_k = q, k_new
        want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want_k_cache[slot // PAGE, slot % PAGE] = want_k[i]
                want_v_cache[slot // PAGE, slot % PAGE] = v_new[i]
        dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens, k_new, v_new, slots)]
        rotary = Rotary(positions.to(DEVICE), rot_table.to(DEVICE), is_neox) if rotary_dim else None
        out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
        splitkv_decode(*dev[:5], out, scratch, splits, scale, new=NewToken(*dev[5:]),
                       rotary=rotary)  # fmt: skip
        got_k, got_v = dev[1].cpu(), dev[2].cpu()
        # the rotated key within one rounding of float64's, the value copied bit for bit
        assert torch.allclose(got_k.double(), want_k_cache.double(), rtol=TOL[dtype], atol=0,
                              equal_nan=True)  # fmt: skip
        assert torch.equal(got_v.isnan(), want_v_cache.isnan())
        assert torch.equal(got_v.nan_to_num(), want_v_cache.nan_to_num())
        ref = _reference(want_q, want_k_cache, want_v_cache, table, lens, scale)
        _check(out[:-1], ref[:-1], dtype)  # the padding row's output is unspecified
        assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)
        # the next step: one key more per sequence, new q / k / v, the written slots kept
        k_cache, v_cache = got_k, got_v
        lens = lens + torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32)
        last = lens.long() - 1
        slots = table[torch.arange(len(kv_lens)), last // PAGE].long() * PAGE + last % PAGE
        slots[-1] = -1
        slots = slots.to(torch.int32)
        positions = positions + 1
        g = torch.Generator().manual_seed(50 + step)
        q = torch.randn(q.shape, generator=g).to(dtype)
        k_new, v_new = (torch.randn(k_new.shape, generator=g).to(dtype) for _ in range(2))


def test_fused_window_and_soft_cap() -> None:
    """The new token under a sliding window and soft cap (its score capped like the cache's);
    one window starts inside a tile, one sequence has only its new key (kv_len 1)."""
    from xhal.platforms.cuda.kernels.splitkv_decode import NewToken

    kv_lens = [140, 9, 1]
    q, k_cache, v_cache, table, lens, k_new, v_new, slots, _, _ = _fused_case(
        kv_lens, 4, 1, torch.float32, 6, 2, True
    )
    slots[-1] = table[2, 0] * PAGE  # a real row this time
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        want_k[slot // PAGE, slot % PAGE], want_v[slot // PAGE, slot % PAGE] = k_new[i], v_new[i]
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens, k_new, v_new, slots)]
    scratch = Scratch.make(3, 1, 4, HEAD_DIM, 3, torch.device(DEVICE))
    out = torch.zeros(q.shape, device=DEVICE)
    splitkv_decode(*dev[:5], out, scratch, 3, 0.2, soft_cap=2.0, window=70,
                   new=NewToken(*dev[5:]))  # fmt: skip
    _check(out, _reference(q, want_k, want_v, table, lens, 0.2, 2.0, 70), torch.float32)
    for got, want in ((dev[1].cpu(), want_k), (dev[2].cpu(), want_v)):  # the NaN block kept
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm of each head's D channels (``x [B, heads, D]``), rounded to x's dtype as
    the unfused ``qk_rms_norm`` stores it."""
    x64 = x.double()
    inv = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (x64 * inv * w.double()).to(x.dtype)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, dtype, rotary_dim, is_neox, splits",
    [(8, 2, torch.bfloat16, 48, True, 4), (8, 1, torch.float32, 64, False, 1),
     (4, 1, torch.bfloat16, 0, True, 3)],
    ids=["gqa4-bf16-neox-partial-4splits", "gqa8-fp32-gptj-unsplit", "no-rotary-3splits"],
)  # fmt: skip
def test_fused_qk_norm(num_heads, num_kv_heads, dtype, rotary_dim, is_neox, splits) -> None:
    """Qwen3's per-head q / k RMSNorm inside the launch (``QKNorm``), before the rotary: the
    cache holds the normed, rotated key the unfused qk_rms_norm + rotary + KV write would store
    (q's and k's weights different, so using one for the other fails), and the output is
    attention with the normed, rotated q; q, k and v are strided slices of one qkv row."""
    from xhal.platforms.cuda.kernels.splitkv_decode import NewToken, QKNorm, Rotary

    kv_lens = [150, 1, 37, 64, 1]
    case = _fused_case(kv_lens, num_heads, num_kv_heads, dtype, 7, rotary_dim or 2, is_neox)
    q, k_cache, v_cache, table, lens, k_new, v_new, slots, positions, rot_table = case
    q, k_new = q * 3.0, k_new * 0.25 + 0.5  # off unit scale, so a norm left out shows
    g = torch.Generator().manual_seed(8)
    q_w = (torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype)
    k_w = (torch.rand(HEAD_DIM, generator=g) * 2.0 - 0.5).to(dtype)
    eps, scale = 1e-6, HEAD_DIM**-0.5
    want_q, want_k = _norm64(q, q_w, eps), _norm64(k_new, k_w, eps)
    if rotary_dim:
        want_q = _rotate64(want_q, positions, rot_table, is_neox).to(dtype)
        want_k = _rotate64(want_k, positions, rot_table, is_neox).to(dtype)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k_cache[slot // PAGE, slot % PAGE] = want_k[i]
            want_v_cache[slot // PAGE, slot % PAGE] = v_new[i]
    scratch = Scratch.make(len(kv_lens), num_kv_heads, num_heads // num_kv_heads, HEAD_DIM,
                           splits, torch.device(DEVICE))  # fmt: skip
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens, k_new, v_new, slots)]
    rotary = Rotary(positions.to(DEVICE), rot_table.to(DEVICE), is_neox) if rotary_dim else None
    norm = QKNorm(q_w.to(DEVICE), k_w.to(DEVICE), eps)
    out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
    splitkv_decode(*dev[:5], out, scratch, splits, scale, new=NewToken(*dev[5:]), rotary=rotary,
                   qk_norm=norm)  # fmt: skip
    # each written head within two roundings of its float64 row's largest value (Triton's
    # interpreter rounds float32 to bf16 toward zero, and rotary mixes two rounded inputs); the
    # rest of the cache, NaN blocks included, unchanged
    got_k = dev[1].cpu()
    written = slots[slots >= 0].long()
    got_rows = got_k.view(-1, num_kv_heads, HEAD_DIM)[written].double()
    want_rows = want_k_cache.view(-1, num_kv_heads, HEAD_DIM)[written].double()
    bound = 2 * TOL[dtype] * want_rows.abs().amax(-1, keepdim=True)
    assert ((got_rows - want_rows).abs() <= bound).all(), (got_rows - want_rows).abs().max()
    kept = torch.ones(got_k.shape[0] * PAGE, dtype=torch.bool)
    kept[written] = False
    for got, want in ((got_k, want_k_cache), (dev[2].cpu(), want_v_cache)):
        got, want = got.view(-1, num_kv_heads, HEAD_DIM), want.view(-1, num_kv_heads, HEAD_DIM)
        assert torch.equal(got[kept].nan_to_num(), want[kept].nan_to_num())
        assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(dev[2].cpu().nan_to_num(), want_v_cache.nan_to_num())
    ref = _reference(want_q, want_k_cache, want_v_cache, table, lens, scale)
    _check(out[:-1], ref[:-1], dtype)
    assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)


def test_qk_norm_needs_the_new_token_and_head_dim_weights() -> None:
    from xhal.platforms.cuda.kernels.splitkv_decode import NewToken, QKNorm

    q, k_cache, v_cache, table, lens, k_new, v_new, slots, _, _ = _fused_case(
        [20], 4, 1, torch.float32, 3, 2, True
    )
    scratch = Scratch.make(1, 1, 4, HEAD_DIM, 1, torch.device("cpu"))
    args = (q, k_cache, v_cache, table, lens, torch.zeros(q.shape), scratch, 1, 1.0)
    w = torch.ones(HEAD_DIM)
    with pytest.raises(ValueError, match="only with the new token"):
        splitkv_decode(*args, qk_norm=QKNorm(w, w, 1e-6))
    with pytest.raises(ValueError, match=f"two \\[{HEAD_DIM}\\] weights"):
        splitkv_decode(*args, new=NewToken(k_new, v_new, slots), qk_norm=QKNorm(w[:8], w, 1e-6))
