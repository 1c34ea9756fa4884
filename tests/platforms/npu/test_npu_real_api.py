"""The torch_npu emulation against the real torch-npu wheel (its schemas, meta functions and
official documentation; ``tests/support/npu_emulation/wheel.py`` pins and fetches it):

- every torch_npu op the NPU backend can call is in the wheel and is emulated under that schema;
- planted mistakes are refused with the official rule: a wrong keyword, a tensor where the schema
  has ``SymInt[]``, a layout the constraints forbid, a length list in the wrong convention;
- the open questions of the NPU backend, each settled by a documentation clause (docs/npu-ops.md).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.npu_emulation import registry
from tests.support.npu_emulation.real_meta import meta_functions
from tests.support.npu_emulation.real_schema import real_schema
from tests.support.npu_emulation_helpers import (
    BF16,
    TOL,
    call_fia,
    emulated_npu,  # noqa: F401  (fixture)
    fia_kwargs,
    flat,
    make_batch,
    max_err,
    reference,
)
from tests.support.paths import REPO
from xhal.interfaces.cache import LayerCache
from xhal.platforms.npu.kernels import kv_write

NPU_SRC = REPO / "xhal" / "platforms" / "npu"


@pytest.fixture
def npu(emulated_npu):  # noqa: F811
    return emulated_npu


def backend_ops() -> set[str]:
    """Every ``torch_npu`` op named in ``xhal/platforms/npu`` (called as ``npu.<op>`` or listed by
    name)."""
    names: set[str] = set()
    for path in NPU_SRC.rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\bnpu\.(_?npu_\w+)", text))
        names |= set(re.findall(r"\"(_?npu_\w+)\"", text))
    return names


def test_every_backend_op_is_in_the_wheel_and_emulated_under_its_schema(npu):
    ops = backend_ops()
    assert {
        "npu_fused_infer_attention_score",
        "npu_scatter_pa_kv_cache",
        "npu_mrope",
        "_npu_reshape_and_cache",
        "_npu_rotary_embedding",
    } <= ops, ops
    for name in sorted(ops):
        schema = real_schema(name)  # KeyError names an op the wheel does not have
        emulated = getattr(npu, name)
        assert isinstance(emulated, registry.RealOp), name
        assert str(emulated.schema) == str(torch._C.parse_schema(schema)), name
        assert emulated.op._schema.name == f"{registry.NAMESPACE}::{name}"
    assert real_schema("npu_fused_infer_attention_score.out").startswith(
        "npu_fused_infer_attention_score.out("
    )
    # the aten-style ops have a meta function in the wheel; the two ATB ops have none
    with_meta = {n for n in ops if n in meta_functions()}
    assert ops - with_meta == {
        "_npu_reshape_and_cache",
        "_npu_rotary_embedding",
        "_npu_fused_infer_attention_score_get_max_workspace",
    }


def test_every_torch_npu_name_the_backend_uses_is_exported_by_the_wheel(npu):
    """``torch.npu.<name>`` in xhal/platforms/npu is in the ``__all__`` of the wheel's
    torch_npu/npu, and the emulated namespace has it."""
    import ast

    from tests.support.npu_emulation.wheel import wheel_files

    tree = ast.parse(wheel_files().npu_init.read_text(encoding="utf-8"))
    exported = {
        elt.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        for elt in node.value.elts
    }
    used = set()
    for path in [*NPU_SRC.rglob("*.py"), NPU_SRC.parent / "common" / "graph.py"]:
        used |= set(re.findall(r"\btorch\.npu\.(\w+)", path.read_text()))
    assert {"graph_task_update_begin", "ExternalEvent", "NPUGraph"} <= used, used
    assert used <= exported, used - exported
    assert all(hasattr(torch.npu, name) for name in used)


# teeth: planted calls refused with the official rule
# ------------------------------------------------
def test_wrong_keyword_name_is_refused(npu):
    b = make_batch([3], [3])
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale_value'"):
        call_fia(npu, b, scale_value=0.1)  # the pre-2.x name; the schema says `float scale`


def test_tensor_for_symint_list_is_refused(npu):
    b = make_batch([3, 1], [3, 9])
    with pytest.raises(
        TypeError,
        match=r"'actual_seq_lengths_kv' must be tuple of ints, not "
        r"Tensor.*SymInt\[\]",
    ):
        call_fia(npu, b, actual_seq_lengths_kv=torch.tensor(b.kv_lens, dtype=torch.int32))
    with pytest.raises(TypeError, match="tuple of ints, not a list holding Tensor"):
        call_fia(npu, b, actual_seq_lengths=[torch.tensor(3), torch.tensor(4)])


def test_forbidden_cache_layout_is_refused(npu):
    # (blocknum, blocksize, H) with KV_N * D > 65535 is refused "受硬件指令约束"; the same cache
    # as (blocknum, KV_N, blocksize, D) is accepted
    b = make_batch([2], [2], heads=256, kv_heads=256, head_dim=512, seed=1)
    with pytest.raises(RuntimeError, match=r"KV_N\*D超过65535"):
        call_fia(npu, b)
    bnnbsd = [c.transpose(1, 2).contiguous() for c in (b.k, b.v)]
    out, _ = npu.npu_fused_infer_attention_score(b.q, *bnnbsd, **fia_kwargs(b))
    assert max_err(out, reference(b)) < TOL
    # the host's [nb, bs, Hkv, D] cache, not viewed, is neither documented layout
    small = make_batch([3], [3])
    with pytest.raises(RuntimeError, match="两种格式"):
        npu.npu_fused_infer_attention_score(small.q, small.k, small.v, **fia_kwargs(small))


def test_length_lists_in_the_wrong_convention_are_refused(npu):
    b = make_batch([5, 3], [5, 40])
    with pytest.raises(RuntimeError, match="当前Batch与之前所有Batch的seqlen和"):
        call_fia(npu, b, actual_seq_lengths=[5, 3])  # per-sequence q lengths under TND
    c = make_batch([1, 1], [100, 200])
    with pytest.raises(RuntimeError, match="代表每个Batch的实际长度"):
        call_fia(npu, c, actual_seq_lengths_kv=[100, 300 + 128])  # cumulative kv lengths


def test_meta_function_refusals_surface(npu):
    b = make_batch([3], [3])
    with pytest.raises(RuntimeError, match="meta function.*numHeads should be greater than 0"):
        call_fia(npu, b, num_heads=0)


# the open questions, settled by the documentation
# ----------------------------------------------------
@pytest.mark.parametrize("window", [1, 16, 33])
def test_band_pre_tokens_counts_the_keys_before_the_query(npu, window):
    """pre_tokens '表示attention需要和前几个Token计算关联': W keys including the query itself are
    pre_tokens = W - 1 (the backend's value); pre_tokens = W (vllm-ascend's) is W + 1 keys."""
    b = make_batch([50, 20], [50, 180])
    exact = call_fia(npu, b, sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
    assert max_err(exact, reference(b, window=window)) < TOL
    wider = call_fia(npu, b, sparse_mode=4, pre_tokens=window, next_tokens=0)
    assert max_err(wider, reference(b, window=window + 1)) < TOL
    assert max_err(wider, reference(b, window=window)) > 5 * TOL


def test_decode_batch_ignores_the_band_so_the_dummy_sequence_is_needed(npu):
    """'Q_S为1且不带rope输入时该参数无效' (sparse_mode) and 'Q_S为1时该参数无效' (pre_tokens):
    with every query of length 1 the band is not applied; one 2-token sequence more brings it
    back."""
    d = make_batch([1, 1], [90, 200])
    full = call_fia(npu, d, sparse_mode=4, pre_tokens=15, next_tokens=0)
    assert max_err(full, reference(d)) < TOL and max_err(full, reference(d, window=16)) > 5 * TOL
    with_dummy = make_batch([1, 1, 2], [90, 200, 2])
    out = call_fia(npu, with_dummy, sparse_mode=4, pre_tokens=15, next_tokens=0)
    assert max_err(out[:2], reference(with_dummy, window=16)[:2]) < TOL


@pytest.mark.parametrize(("q_lens", "block_size", "ok"), [
    ([4, 1], 128, True), ([4, 1], 256, True), ([4, 1], 512, True), ([4, 1], 64, False),
    ([4, 1], 640, False), ([1, 1], 16, True), ([1, 1], 48, True), ([1, 1], 24, False),
    ([1, 1], 1024, False),
])  # fmt: skip
def test_block_size_rules_per_mode(npu, q_lens, block_size, ok):
    """Q_S > 1: '最小为128, 最大为512, 且要求是128的倍数'; Q_S = 1 (fp16/bf16): '非0值，且最大不超过
    512, ... 需要16对齐'."""
    b = make_batch(q_lens, [40, 40], block_size=block_size)
    if ok:
        assert max_err(call_fia(npu, b), reference(b)) < TOL
    else:
        with pytest.raises(RuntimeError, match="block_size"):
            call_fia(npu, b)


def test_padding_slots_never_reach_scatter_pa(npu):
    """'slot_mapping的值范围[0,num_blocks*block_size-1]': the op is not given -1; the backend's
    writer repeats a real write in their place, and the -1 rows stay unwritten."""
    k, v = torch.randn(4, 2, 128).to(BF16), torch.randn(4, 2, 128).to(BF16)
    cache = LayerCache(
        torch.zeros(3, 128, 2, 128, dtype=BF16), torch.zeros(3, 128, 2, 128, dtype=BF16)
    )
    for writer in ("scatter_pa", "reshape_and_cache", "scatter_nd"):
        cache.key.zero_(), cache.value.zero_()
        slots = torch.tensor([-1, 5, -1, 300], dtype=torch.int32)
        kv_write.KV_WRITERS[writer](npu, k, v, cache, slots)
        assert torch.equal(cache.key[0, 5], k[1]) and torch.equal(cache.value[2, 44], v[3])
        assert int((cache.key != 0).any(-1).any(-1).sum()) == 2, writer
        cache.key.zero_()
        kv_write.KV_WRITERS[writer](npu, k, v, cache, torch.full((4,), -1, dtype=torch.int32))
        assert int((cache.key != 0).sum()) == 0, writer  # no real row: slot 0 keeps its values


def test_add_rms_norm_normalizes_the_float32_sum(npu):
    """2.14.0 documents no npu_add_rms_norm; the emulation normalizes the float32 sum and returns
    it rounded (the meta function: x_out in x1's dtype). Checked against float64."""
    g = torch.Generator().manual_seed(3)
    x1 = (torch.randn(8, 256, generator=g) * 100).to(BF16)
    x2 = torch.randn(8, 256, generator=g).to(BF16)
    w = torch.randn(256, generator=g).to(BF16)
    y, rstd, summed = npu.npu_add_rms_norm(x1, x2, w, 1e-6)
    s = x1.double() + x2.double()
    ref = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert summed.dtype == BF16 and rstd.dtype == torch.float32 and rstd.shape == (8, 1)
    assert max_err(y, ref) <= max_err(ref.to(BF16), ref) * 1.01 + 1e-6


def test_mrope_takes_a_float32_cache_with_bf16_query(npu):
    """cosSinCache '数据类型支持BFLOAT16、FLOAT16、FLOAT32', stated apart from the query's dtypes
    (where same-dtype rules exist the doc says so, as for npu_rms_norm's gamma)."""
    pos = torch.tensor([3, 0, 7], dtype=torch.int64)
    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(8, dtype=torch.float64)[:, None] * inv
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    q, k = torch.randn(3, 2 * 64).to(BF16), torch.randn(3, 64).to(BF16)
    q_out, _ = npu.npu_mrope(pos, q, k, cache.float(), 64)
    x1, x2 = q.double().view(3, 2, 64).chunk(2, -1)
    c, s = (t[pos][:, None] for t in (ang.cos(), ang.sin()))
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert max_err(q_out.view(3, 2, 64), ref) < 3e-2
    with pytest.raises(RuntimeError, match="FLOAT32"):
        npu.npu_mrope(pos, q, k, cache, 64)  # float64 is none of the three


def test_kv_layouts_give_the_same_attention(npu):
    """TND takes '(blocknum, blocksize, H)和(blocknum, KV_N, blocksize, D)两种格式'; the doc
    recommends the latter for speed. Same numbers from both."""
    b = make_batch([7, 1, 30], [7, 90, 160])
    bnnbsd = [c.transpose(1, 2).contiguous() for c in (b.k, b.v)]
    out, _ = npu.npu_fused_infer_attention_score(b.q, *bnnbsd, **fia_kwargs(b))
    assert torch.equal(out, call_fia(npu, b))
    assert max_err(out, reference(b)) < TOL


def test_counts_bound_calls_and_meta_checks(npu):
    before = registry.COUNTS["npu_fused_infer_attention_score"].copy()
    b = make_batch([3], [3])
    npu.npu_fused_infer_attention_score(b.q, flat(b.k), flat(b.v), **fia_kwargs(b))
    after = registry.COUNTS["npu_fused_infer_attention_score"]
    assert after["bound"] == before["bound"] + 1 and after["meta"] == before["meta"] + 1


def test_out_overload_takes_the_documented_lse_buffer(npu):
    """softmaxLse '数据类型支持float32' and, without softmax_lse_flag,
    '输出shape为[1]的值为0的Tensor'."""
    b = make_batch([3, 1], [3, 9])
    kw = fia_kwargs(b)
    out, lse = torch.empty_like(b.q), torch.full((1,), 7.0)
    npu.npu_fused_infer_attention_score.out(b.q, flat(b.k), flat(b.v), out=[out, lse], **kw)
    assert max_err(out, reference(b)) < TOL and lse.item() == 0
    with pytest.raises(RuntimeError, match="float32"):
        npu.npu_fused_infer_attention_score.out(
            b.q, flat(b.k), flat(b.v), out=[out, torch.empty(1, dtype=BF16)], **kw
        )
    with pytest.raises(TypeError, match="'out' must be a list of 2 tensors"):
        npu.npu_fused_infer_attention_score.out(b.q, flat(b.k), flat(b.v), out=out, **kw)
