"""The torch_npu emulation's attention path: FIA computes the documented numbers and raises on the
argument mistakes the real op rejects, the KV-cache writers fill the slots they are given, and
install/uninstall add and remove the emulated module.

The graph tests live in test_npu_emulation_graphs.py and the DeviceOps in test_npu_emulation_ops.py;
the shared batch builder and float64 attention reference are in npu_emulation_helpers.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.npu_emulation import install, is_installed, uninstall
from tests.support.npu_emulation_helpers import (
    BF16,
    MASK,
    TOL,
    call_fia,
    emulated_npu,
    fia_kwargs,
    flat,
    make_batch,
    max_err,
    reference,
)

npu = emulated_npu  # the fixture, under the name the tests take

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
    out, lse = torch.empty_like(b.q), torch.empty(1)
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


def test_mask_made_in_inference_mode_checked_every_call(npu):
    """A mask made under ``torch.inference_mode`` (an executor built there) has no version
    counter: the mask check runs at every call, so an in-place change is still caught."""
    b = make_batch([12, 30], [12, 40])
    with torch.inference_mode():
        mask = MASK.clone()
        assert max_err(call_fia(npu, b, atten_mask=mask), reference(b)) < TOL
        mask[0, 1] = 0  # no longer the compressed causal mask
        with pytest.raises(RuntimeError, match="compressed causal"):
            call_fia(npu, b, atten_mask=mask)


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
    with pytest.raises(RuntimeError, match="meta function.*Layout TNDX is not supported"):
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
def test_scatter_pa_kv_cache_norm_writes_and_refuses_padding_slots(npu):
    k, v = torch.randn(4, 2, 128).to(BF16), torch.randn(4, 2, 128).to(BF16)
    kc, vc = torch.zeros(3, 128, 2, 128, dtype=BF16), torch.zeros(3, 128, 2, 128, dtype=BF16)
    slots = torch.tensor([5, 7, 300, 128], dtype=torch.int32)
    npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots, cache_mode="Norm")
    assert torch.equal(kc[0, 5], k[0]) and torch.equal(vc[2, 44], v[2])
    assert torch.equal(kc[1, 0], k[3])
    assert int((kc != 0).any(-1).any(-1).sum()) == 4
    # the doc: 'slot_mapping的值范围[0,num_blocks*block_size-1]': a -1 slot is out of range
    with pytest.raises(RuntimeError, match=r"\[0,num_blocks\*block_size-1\]"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, torch.tensor([5, -1, 300, 128]),
                                    cache_mode="Norm")
    with pytest.raises(RuntimeError, match="PA_NZ"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots)  # default cache_mode expects NZ
    # a repeated slot has no defined result unless every write of it carries the same values
    with pytest.raises(RuntimeError, match="repeats a slot"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, torch.tensor([1, 1, 2, 3]), cache_mode="Norm")
    same = torch.tensor([1, 2, 3, 1])
    npu.npu_scatter_pa_kv_cache(k[[0, 1, 2, 0]], v[[0, 1, 2, 0]], kc, vc, same, cache_mode="Norm")
    assert torch.equal(kc[0, 1], k[0])
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_scatter_pa_kv_cache(k.transpose(0, 1).contiguous().transpose(0, 1), v, kc, vc,
                                    slots, cache_mode="Norm")


def test_reshape_and_cache_and_scatter_nd_update(npu):
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kc, vc = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    npu._npu_reshape_and_cache(k, v, kc, vc, torch.tensor([17, -1, 0], dtype=torch.int32))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[0, 0], v[2])
    assert int(kc.ne(0).sum()) == 256
    # the portable fallback: one slot per index row (its doc: indices of at least 2 dims)
    flat_cache = kc.view(32, 2, 64)
    npu.npu_scatter_nd_update_(flat_cache, torch.tensor([[31], [2]]), k[:2])
    assert torch.equal(kc[1, 15], k[0]) and torch.equal(kc[0, 2], k[1])
    with pytest.raises(RuntimeError, match="不支持越界"):
        npu.npu_scatter_nd_update_(flat_cache, torch.tensor([[-1], [2]]), k[:2])


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
