"""The torch_npu emulation catches real mistakes and computes the documented numbers.

References are independent of the emulation: float64 dense attention over K/V gathered per sequence
by its block table, and float64 formulas for the DeviceOps.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from npu_emulation import install, is_installed, reset_state, uninstall

BF16 = torch.bfloat16
MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)


@pytest.fixture
def npu():
    """The emulated torch_npu module for one test (left installed if an earlier test, e.g. an
    emulated NPU platform, installed it)."""
    installed_before = is_installed()
    mod = install()
    yield mod
    reset_state()
    if not installed_before:
        uninstall()


# attention helpers --------------------------------------------------------------------------------
def make_batch(q_lens, kv_lens, *, heads=4, kv_heads=2, head_dim=128, block_size=128, seed=0):
    """Random caches ``[nb, bs, Hkv, D]`` holding every kv token, permuted block tables, q."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(q_lens), max(blocks) + 1, dtype=torch.int32)  # one padding column
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return SimpleNamespace(
        q=torch.randn(sum(q_lens), heads, head_dim, generator=g).to(BF16),
        k=torch.randn(*shape, generator=g).to(BF16),
        v=torch.randn(*shape, generator=g).to(BF16),
        table=table, q_lens=list(q_lens), kv_lens=list(kv_lens), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
    )


def fia_kwargs(b, **overrides):
    kw = dict(
        num_heads=b.heads, num_key_value_heads=b.kv_heads, input_layout="TND",
        scale=b.head_dim**-0.5, block_table=b.table, block_size=b.block_size,
        actual_seq_lengths=list(itertools.accumulate(b.q_lens)),
        actual_seq_lengths_kv=list(b.kv_lens), sparse_mode=3, atten_mask=MASK,
    )
    return kw | overrides


def flat(cache):  # [nb, bs, Hkv, D] -> BnBsH [nb, bs, Hkv*D], as vllm-ascend passes it
    return cache.view(cache.shape[0], cache.shape[1], -1)


def call_fia(npu, b, q=None, **overrides):
    out, _ = npu.npu_fused_infer_attention_score(
        b.q if q is None else q, flat(b.k), flat(b.v), **fia_kwargs(b, **overrides)
    )
    return out


def reference(b, q=None, kv_lens=None, window=None):
    """float64, per sequence: gather K/V by block table, dense causal aligned bottom-right."""
    q = (b.q if q is None else q).double()
    kv_lens = b.kv_lens if kv_lens is None else kv_lens
    out, start, group = torch.zeros_like(q), 0, b.heads // b.kv_heads
    for i, (q_len, kv_len) in enumerate(zip(b.q_lens, kv_lens)):
        pos = torch.arange(kv_len)
        rows = b.table[i, pos // b.block_size].long()
        keys = b.k[rows, pos % b.block_size].double().repeat_interleave(group, 1)
        values = b.v[rows, pos % b.block_size].double().repeat_interleave(group, 1)
        for t in range(q_len):
            p = kv_len - q_len + t
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,khd->hk", q[start + t], keys[lo : p + 1]) * b.head_dim**-0.5
            out[start + t] = torch.einsum("hk,khd->hd", s.softmax(-1), values[lo : p + 1])
        start += q_len
    return out


def max_err(out, ref):
    return (out.double() - ref).abs().max().item()


TOL = 2e-2  # bf16 output rounding against a float64 reference

CASES = {
    "prefill": ([37, 130], [37, 130]),
    "decode": ([1, 1, 1], [300, 5, 129]),
    "chunked": ([40, 100], [168, 356]),
    "mixed": ([1, 60, 1, 7], [250, 60, 3, 140]),
}


# FIA numbers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("group", [2, 4])
def test_fia_matches_dense_reference(npu, kind, group):
    b = make_batch(*CASES[kind], heads=4 * group // 2, kv_heads=2, seed=len(kind))
    assert max_err(call_fia(npu, b), reference(b)) < TOL


def test_fia_bnnbsd_cache_and_lse(npu):
    b = make_batch([5, 1], [133, 40])
    kc, vc = (c.transpose(1, 2).contiguous() for c in (b.k, b.v))  # [nb, Hkv, bs, D]
    kw = fia_kwargs(b, softmax_lse_flag=True)
    out, lse = npu.npu_fused_infer_attention_score(b.q, kc, vc, **kw)
    assert max_err(out, reference(b)) < TOL
    assert lse.shape == (6, 4, 1) and lse.dtype == torch.float32
    # decode row of sequence 1 sees all 40 keys: lse = logsumexp of its scores
    pos = torch.arange(40)
    keys = b.k[b.table[1, pos // 128].long(), pos % 128].double().repeat_interleave(2, 1)
    scores = torch.einsum("hd,khd->hk", b.q[5].double(), keys) / math.sqrt(128)
    assert torch.allclose(lse[5, :, 0].double(), scores.logsumexp(-1), atol=1e-2)


def test_fia_without_page_attention_takes_cumulative_kv(npu):
    g = torch.Generator().manual_seed(5)
    q_lens, cu = [3, 5], [3, 8]
    q, k, v = (torch.randn(8, h, 128, generator=g).to(BF16) for h in (4, 2, 2))
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=2, input_layout="TND", scale=128**-0.5,
        actual_seq_lengths=cu, actual_seq_lengths_kv=cu, sparse_mode=3, atten_mask=MASK,
    )
    for start, n in zip([0, 3], q_lens):  # dense causal per sequence, float64
        qs, ks, vs = (x[start : start + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(128)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vs)
        assert max_err(out[start : start + n], ref) < TOL
    with pytest.raises(RuntimeError, match="cumulative"):
        npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=4, num_key_value_heads=2, input_layout="TND",
            actual_seq_lengths=cu, actual_seq_lengths_kv=q_lens, sparse_mode=3, atten_mask=MASK,
        )


def test_fia_out_variant_writes_given_tensors(npu):
    b = make_batch([3, 1], [3, 200])
    out, lse = torch.empty_like(b.q), torch.empty(1, dtype=BF16)
    get_workspace = npu._npu_fused_infer_attention_score_get_max_workspace
    ws = get_workspace(b.q, flat(b.k), flat(b.v), **fia_kwargs(b))
    res = npu.npu_fused_infer_attention_score.out(
        b.q, flat(b.k), flat(b.v), workspace=ws, out=[out, lse], **fia_kwargs(b)
    )
    assert res[0] is out and max_err(out, reference(b)) < TOL and lse.item() == 0


def test_sliding_window_band_mode4_and_decode_ignores_it(npu):
    b = make_batch([50, 20], [50, 180])
    out = call_fia(npu, b, sparse_mode=4, pre_tokens=15, next_tokens=0)  # window 16
    assert max_err(out, reference(b, window=16)) < TOL
    d = make_batch([1, 1], [90, 200])  # Q_S == 1: doc says sparse_mode/pre_tokens are ignored
    out = call_fia(npu, d, sparse_mode=4, pre_tokens=15, next_tokens=0)
    assert max_err(out, reference(d)) < TOL


# FIA catches mistakes -----------------------------------------------------------------------------
def test_cumulative_kv_lengths_rejected_or_wrong(npu):
    b = make_batch([1, 1], [100, 200])
    with pytest.raises(RuntimeError, match="PER-SEQUENCE"):  # 300 needs 3 blocks; table has 3 cols
        call_fia(npu, b, actual_seq_lengths_kv=[100, 300 + 128])
    b = make_batch([1, 1], [130, 50])  # cumulative [130, 180] fits the table: reads wrong blocks
    wrong = call_fia(npu, b, actual_seq_lengths_kv=[130, 180])
    assert max_err(wrong, reference(b)) > 10 * TOL
    assert max_err(call_fia(npu, b), reference(b)) < TOL


def test_per_sequence_q_lengths_rejected(npu):
    b = make_batch([5, 3], [5, 3])
    with pytest.raises(RuntimeError, match="CUMULATIVE|561002"):
        call_fia(npu, b, actual_seq_lengths=[5, 3])


def test_block_size_16_rejected(npu):
    b = make_batch([20, 4], [20, 40], block_size=16)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        call_fia(npu, b)
    d = make_batch([1, 1], [20, 40], block_size=16)  # doc: Q_S == 1 only needs <= 512
    assert max_err(call_fia(npu, d), reference(d)) < TOL


def test_missing_or_wrong_causal_mask_rejected(npu):
    b = make_batch([12, 30], [12, 40])
    with pytest.raises(RuntimeError, match="needs atten_mask"):
        call_fia(npu, b, atten_mask=None)
    with pytest.raises(RuntimeError, match="2048"):
        call_fia(npu, b, atten_mask=MASK[:128, :128])
    with pytest.raises(RuntimeError, match="2048"):
        call_fia(npu, b, atten_mask=MASK.float())
    with pytest.raises(RuntimeError, match="compressed causal"):
        call_fia(npu, b, atten_mask=torch.tril(torch.ones(2048, 2048), -1).to(torch.int8))
    with pytest.raises(RuntimeError, match="no mask"):
        call_fia(npu, b, sparse_mode=0)
    call_fia(npu, b, atten_mask=MASK.bool().view(1, 1, 2048, 2048))  # documented forms pass


@pytest.mark.parametrize("name", ["actual_seq_lengths", "actual_seq_lengths_kv"])
def test_tensor_lengths_rejected(npu, name):
    b = make_batch([4, 2], [9, 30])
    values = fia_kwargs(b)[name]
    with pytest.raises(TypeError, match="must be tuple of ints, not Tensor"):
        call_fia(npu, b, **{name: torch.tensor(values, dtype=torch.int32)})
    with pytest.raises(TypeError, match="tuple of ints"):
        call_fia(npu, b, **{name: [torch.tensor(v) for v in values]})
    call_fia(npu, b, **{name: tuple(values)})


def test_query_rows_must_equal_last_cumulative_length(npu):
    b = make_batch([4, 2], [9, 30])
    padded = torch.cat([b.q, torch.zeros(3, 4, 128, dtype=BF16)])  # bucket padding rows
    with pytest.raises(RuntimeError, match="561002"):
        call_fia(npu, b, q=padded)


def test_layout_dtype_and_cache_view_rejected(npu):
    b = make_batch([3], [3])
    with pytest.raises(RuntimeError, match="input_layout"):
        call_fia(npu, b, input_layout="TNDX")
    with pytest.raises(NotImplementedError, match="TND"):
        call_fia(npu, b, input_layout="BSH")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        npu.npu_fused_infer_attention_score(b.q.float(), flat(b.k).float(), flat(b.v).float(),
                                            **fia_kwargs(b))
    with pytest.raises(RuntimeError, match="BnNBsD"):  # the xhal cache, not viewed as BnBsH
        npu.npu_fused_infer_attention_score(b.q, b.k, b.v, **fia_kwargs(b))
    with pytest.raises(TypeError, match="scale_value"):
        call_fia(npu, b, scale_value=0.1)
    with pytest.raises(RuntimeError, match="num_heads"):
        call_fia(npu, b, num_heads=8)


# KV-cache writers ---------------------------------------------------------------------------------
def test_scatter_pa_kv_cache_norm_skips_padding(npu):
    k, v = torch.randn(4, 2, 128).to(BF16), torch.randn(4, 2, 128).to(BF16)
    kc, vc = torch.zeros(3, 128, 2, 128, dtype=BF16), torch.zeros(3, 128, 2, 128, dtype=BF16)
    slots = torch.tensor([5, -1, 300, 128], dtype=torch.int32)
    npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots, cache_mode="Norm")
    assert torch.equal(kc[0, 5], k[0]) and torch.equal(vc[2, 44], v[2])
    assert torch.equal(kc[1, 0], k[3])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3  # the -1 row wrote nothing
    with pytest.raises(RuntimeError, match="PA_NZ"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots)  # default cache_mode expects NZ
    with pytest.raises(RuntimeError, match="unique"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, torch.tensor([1, 1, 2, 3]), cache_mode="Norm")
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_scatter_pa_kv_cache(k.transpose(0, 1).contiguous().transpose(0, 1), v, kc, vc,
                                    slots, cache_mode="Norm")


def test_reshape_and_cache_and_scatter_nd_update(npu):
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kc, vc = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    npu._npu_reshape_and_cache(k, v, kc, vc, torch.tensor([17, -1, 0], dtype=torch.int32))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[0, 0], v[2])
    assert int(kc.ne(0).sum()) == 256
    flat_cache = kc.view(32, 2, 64)  # the portable fallback: one slot per index row (§1.2)
    npu.npu_scatter_nd_update_(flat_cache, torch.tensor([[31], [2]]), k[:2])
    assert torch.equal(kc[1, 15], k[0]) and torch.equal(kc[0, 2], k[1])
    with pytest.raises(RuntimeError, match="does NOT skip -1"):
        npu.npu_scatter_nd_update_(flat_cache, torch.tensor([[-1], [2]]), k[:2])


# graphs -------------------------------------------------------------------------------------------
def decode_setup(npu):
    b = make_batch([1, 1], [130, 50], seed=7)
    q = b.q.clone()  # the graph's static input
    return b, q


def eager(npu, b, q, kv_lens):
    return call_fia(npu, b, q=q, actual_seq_lengths_kv=kv_lens)


def next_step(b, q):
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(BF16))
    return [n + 1 for n in b.kv_lens]


def test_graph_bakes_lengths_and_manual_update_fixes_them(npu):
    b, q = decode_setup(npu)
    g, host_lens = torch.npu.NPUGraph(), list(b.kv_lens)
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle()):
        s = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(s)
        out = eager(npu, b, q, host_lens)
        handle = torch.npu.graph_task_group_end(s)
        doubled = out * 2  # work after attention replays too
    assert max_err(out, reference(b, q=q)) < TOL
    new_lens = next_step(b, q)
    host_lens[:] = new_lens  # mutating the host list the capture saw changes nothing either
    g.replay()  # no update: stale lengths
    assert torch.equal(out, eager(npu, b, q, b.kv_lens))
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) > 10 * TOL
    update_stream = torch.npu.Stream()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        eager(npu, b, q, new_lens)  # re-issued, not run
        torch.npu.graph_task_update_end(update_stream)
    g.replay()
    assert torch.equal(out, eager(npu, b, q, new_lens)) and torch.equal(doubled, out * 2)
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL


def test_graph_vllm_ascend_order_out_variant_with_external_event(npu):
    b, q = decode_setup(npu)
    out, lse = torch.empty_like(q), torch.empty(1, dtype=BF16)
    g, event = torch.npu.NPUGraph(), torch.npu.ExternalEvent()

    def fia_out(kv_lens):
        npu.npu_fused_infer_attention_score.out(
            q, flat(b.k), flat(b.v), out=[out, lse],
            **fia_kwargs(b, actual_seq_lengths_kv=kv_lens),
        )

    with torch.npu.graph(g):
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        fia_out(b.kv_lens)
        handle = torch.npu.graph_task_group_end(s)
    new_lens = next_step(b, q)
    g.replay()  # parks at the captured event.wait
    with pytest.raises(RuntimeError, match="hang"):
        torch.npu.synchronize()
    update_stream = torch.npu.Stream()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        fia_out(new_lens)
        torch.npu.graph_task_update_end(update_stream)
        event.record(update_stream)  # the replay resumes with the new lengths
    torch.npu.synchronize()
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL


def test_graph_auto_dispatch_capture_update(npu):
    b, q = decode_setup(npu)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = eager(npu, b, q, b.kv_lens)
    new_lens = next_step(b, q)
    g.replay()  # without update the replay waits on its event forever
    with pytest.raises(RuntimeError, match="hang"):
        torch.npu.synchronize()
    with pytest.raises(RuntimeError, match="blocked"):
        g.replay()  # queued behind the blocked one
    g.reset()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = eager(npu, b, q, b.kv_lens)
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": new_lens}])
    g.replay()
    torch.npu.synchronize()
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL
    with pytest.raises(TypeError, match="not Tensor"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": torch.tensor(new_lens)}])
    with pytest.raises(RuntimeError, match="PER-SEQUENCE"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [130, 131 + 500]}])


def test_graph_update_protocol_misuse_raises(npu):
    b, q = decode_setup(npu)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        s = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(s)
        eager(npu, b, q, b.kv_lens)
        handle = torch.npu.graph_task_group_end(s)
    with pytest.raises(RuntimeError, match="differ from the capture stream"):
        torch.npu.graph_task_update_begin(s, handle)
    update_stream = torch.npu.Stream()
    torch.npu.graph_task_update_begin(update_stream, handle)
    eager(npu, b, q, b.kv_lens)  # issued on the current stream, not the update stream
    with pytest.raises(RuntimeError, match="re-issue the same ops"):
        torch.npu.graph_task_update_end(update_stream)
    with pytest.raises(RuntimeError, match="auto_dispatch_capture"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": b.kv_lens}])
    with pytest.raises(RuntimeError, match="default stream"):
        torch.npu.NPUGraph().capture_begin()
    with pytest.raises(RuntimeError, match="host"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            q.sum().item()


_WRAPPED: dict[str, object] = {}


@torch.library.custom_op("npu_emu_test::wrapped_fia", mutates_args=())
def _wrapped_fia(q: torch.Tensor) -> torch.Tensor:
    npu, b = _WRAPPED["npu"], _WRAPPED["batch"]
    return call_fia(npu, b, q=q)


def test_fia_inside_another_custom_op_refused_under_capture(npu):
    b, q = decode_setup(npu)
    _WRAPPED.update(npu=npu, batch=b)
    assert max_err(_wrapped_fia(q), reference(b, q=q)) < TOL  # eager is fine
    with pytest.raises(RuntimeError, match="called inside another op"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            _wrapped_fia(q)


def test_collective_inside_task_group_raises(npu, tmp_path):
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
    try:
        x = torch.ones(4)
        with pytest.raises(RuntimeError, match="never put a collective inside a task group"):
            with torch.npu.graph(torch.npu.NPUGraph()):
                torch.npu.graph_task_group_begin(torch.npu.current_stream())
                dist.all_reduce(x)
        with torch.npu.graph(torch.npu.NPUGraph()):  # outside a task group it is captured
            dist.all_reduce(x)
    finally:
        if created:
            dist.destroy_process_group()


# DeviceOps ----------------------------------------------------------------------------------------
def test_rms_norms_match_reference(npu):
    x, r = torch.randn(5, 64).to(BF16), torch.randn(5, 64).to(BF16)
    w = (1 + 0.1 * torch.randn(64)).to(BF16)
    xd, rd, wd = x.double(), r.double(), w.double()
    y, rstd = npu.npu_rms_norm(x, w, 1e-6)
    ref_rstd = 1 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == BF16 and rstd.dtype == torch.float32 and rstd.shape == (5, 1)
    assert max_err(y, xd * ref_rstd * wd) < 3e-2 and max_err(rstd, ref_rstd) < 1e-4
    x0, r0 = x.clone(), r.clone()
    y, _, summed = npu.npu_add_rms_norm(x, r, w, 1e-6)
    s = xd + rd
    assert max_err(summed, s) < 3e-2 and torch.equal(x, x0) and torch.equal(r, r0)
    assert max_err(y, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * wd) < 3e-2


def test_swiglu_matches_reference(npu):
    x = torch.randn(3, 4, 32)
    a, c = x.double().chunk(2, -1)
    assert max_err(npu.npu_swiglu(x), torch.nn.functional.silu(a) * c) < 1e-5
    a, c = x.double().chunk(2, 1)
    assert max_err(npu.npu_swiglu(x, dim=1), torch.nn.functional.silu(a) * c) < 1e-5
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_swiglu(x.transpose(0, 1))


def rope_reference(positions, x, cache, neox):
    """Complex-number rotation of x [T, H, D] (independent of the chunk/interleave code)."""
    x, cache = x.double(), cache.double()
    half = cache.shape[-1] // 2
    cos, sin = cache[positions.long()].split(half, -1)
    i = torch.arange(half)
    first, second = (i, i + half) if neox else (2 * i, 2 * i + 1)
    z = torch.complex(x[..., first], x[..., second]) * torch.complex(cos, sin)[:, None]
    out = x.clone()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def rope_cache(max_pos, rot):
    inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], -1).float()


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_ops_match_reference(npu, neox):
    pos, cache = torch.tensor([5, 0, 63, 17], dtype=torch.int32), rope_cache(64, 64)
    q, k = torch.randn(4, 4, 128).to(BF16), torch.randn(4, 2, 128).to(BF16)
    mode = "half" if neox else "interleaved"
    q2, k2 = npu.npu_mrope(pos, q.view(4, -1), k.view(4, -1), cache, 128, rotary_mode=mode)
    assert max_err(q2.view(4, 4, 128), rope_reference(pos, q, cache, neox)) < 3e-2
    assert max_err(k2.view(4, 2, 128), rope_reference(pos, k, cache, neox)) < 3e-2
    qi, ki = q.view(4, -1).clone(), k.view(4, -1).clone()
    assert npu._npu_rotary_embedding(pos, qi, ki, 128, cache, neox) is None  # in place
    assert torch.equal(qi, q2) and torch.equal(ki, k2)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        npu.npu_mrope(pos, torch.zeros(4, 160, dtype=BF16), torch.zeros(4, 80, dtype=BF16),
                      rope_cache(64, 32), 80, rotary_mode=mode)


def test_mrope_sections_pick_position_rows(npu):
    cache = rope_cache(64, 64)
    pos = torch.tensor([[1, 2, 3], [10, 20, 30], [40, 50, 60]])
    q, k = torch.randn(3, 64), torch.randn(3, 64)
    q2, _ = npu.npu_mrope(pos, q, k, cache, 64, mrope_section=[8, 12, 12])
    for t in range(3):  # each channel pair rotated by the angle of its section's position row
        row = torch.cat([torch.full((8,), 0), torch.full((12,), 1), torch.full((12,), 2)])
        angle_pos = pos[row, t]
        c, s = cache[angle_pos, torch.arange(32)], cache[angle_pos, 32 + torch.arange(32)]
        x1, x2 = q[t, :32], q[t, 32:]
        assert torch.allclose(q2[t], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]), atol=1e-5)


def top_k_top_p_reference(logits, p, k):
    out = logits.double().clone()
    for i, row in enumerate(logits.double()):
        kth = row.sort(descending=True).values[int(k[i]) - 1]
        kept = row.masked_fill(row < kth, float("-inf"))
        probs = kept.softmax(-1)
        mass_before = 0.0
        for j in probs.argsort(descending=True).tolist():
            if mass_before >= float(p[i]):
                kept[j] = float("-inf")
            mass_before += float(probs[j])
        out[i] = kept
    return out


def test_top_k_top_p_matches_reference_and_enforces_k_range(npu):
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(3))
    p, k = torch.tensor([0.9, 0.5, 1.0]), torch.tensor([1, 40, 1024], dtype=torch.int32)
    out = npu.npu_top_k_top_p(logits, p, k)
    ref = top_k_top_p_reference(logits, p, k)
    assert torch.equal(out.isinf(), ref.isinf()) and out.isfinite().sum(-1)[0] == 1
    assert torch.allclose(out[out.isfinite()].double(), ref[ref.isfinite()])
    for bad in ([0, 1, 1], [1, 1, 1025]):
        with pytest.raises(RuntimeError, match=r"\[1, 1024\]"):
            npu.npu_top_k_top_p(logits, p, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"<= V=50"):
        npu.npu_top_k_top_p(logits[:, :50], p, torch.tensor([1, 1, 60], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_top_k_top_p(logits, p, k.long())


# installation -------------------------------------------------------------------------------------
def test_install_adds_and_uninstall_removes():
    import sys

    if is_installed():
        pytest.skip("an earlier test of this process keeps the emulation installed")
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
    mod = install()
    try:
        import torch_npu

        assert torch_npu is mod and mod.EMULATION and "EMULATED" in mod.__doc__
        assert torch.npu is mod.npu and torch.npu.is_available() and torch.npu.device_count() == 1
        assert torch_npu.EMULATED_DEVICE == torch.device("cpu")
        free, total = torch.npu.mem_get_info()
        assert 0 < free <= total
    finally:
        uninstall()
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
