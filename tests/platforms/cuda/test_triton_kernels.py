"""The CUDA backend's Triton kernels against float64 references: the paged KV write (slot -1
skipped), paged attention (decode and prefill batches), fused add + RMSNorm and rotary, and the
host-built FlashInfer page table (gemv: test_triton_gemv.py). Interpreted on CPU when there is no
CUDA device (tests/support/triton_env.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.support.triton_env import DEVICE, NO_RUNTIME_LOOPS, RUNTIME_LOOPS, assert_matches

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from xhal.platforms.cuda.kernels.kv_write import write_kv
from xhal.platforms.cuda.kernels.paged_attention import paged_attention

# kv write --------------------------------------------------------------------------------------


def test_write_kv_skips_slot_minus_one() -> None:
    num_blocks, block_size, kv_heads, head_dim = 3, 4, 2, 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, device=DEVICE)
    v_cache = torch.full(shape, -7.0, device=DEVICE)
    k = torch.randn(5, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(5, kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 11, -1], dtype=torch.int32, device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    k_ref = torch.full(shape, 7.0).view(-1, kv_heads, head_dim)
    v_ref = torch.full(shape, -7.0).view(-1, kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_ref[slot], v_ref[slot] = k[token].cpu(), v[token].cpu()
    assert torch.equal(k_cache.cpu(), k_ref.view(shape))
    assert torch.equal(v_cache.cpu(), v_ref.view(shape))


# paged attention -------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4

needs_runtime_loops = pytest.mark.skipif(
    not RUNTIME_LOOPS, reason=f"paged attention {NO_RUNTIME_LOOPS}"
)


def _paged_case(q_lens: list[int], kv_lens: list[int], pad: int, seed: int = 0):
    """Sequences with random distinct blocks, a random cache, and ``pad`` padding rows."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(math.ceil(n / BLOCK) for n in kv_lens)
    num_blocks = per_seq * len(kv_lens) + 2
    table = torch.randperm(num_blocks, generator=g)[: per_seq * len(kv_lens)].view(
        len(kv_lens), per_seq
    )
    cache_shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    num_tokens = sum(q_lens) + pad
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
    token_seq = [s for s, n in enumerate(q_lens) for _ in range(n)] + [-1] * pad
    q_cu = [0]
    for n in q_lens:
        q_cu.append(q_cu[-1] + n)
    i32 = dict(dtype=torch.int32)
    meta = [torch.tensor(v, **i32) for v in (token_seq, q_cu, kv_lens)]
    return q, k_cache, v_cache, *meta, table.int()


def _attention_ref(q, k_cache, v_cache, token_seq, q_cu, kv_lens, table, scale, soft_cap, window):
    """Each token attends causally (bottom-right aligned) to its sequence's keys, gathered
    position by position through the block table; padding rows stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for t, seq in enumerate(token_seq.tolist()):
        if seq < 0:
            continue
        q_start, q_len = q_cu[seq].item(), (q_cu[seq + 1] - q_cu[seq]).item()
        kv_len = kv_lens[seq].item()
        pos = kv_len - q_len + (t - q_start)
        n = torch.arange(kv_len)
        blocks = table[seq, n // BLOCK].long()
        keys = k_cache[blocks, n % BLOCK].double()  # [kv_len, Hkv, D]
        values = v_cache[blocks, n % BLOCK].double()
        visible = n <= pos
        if window > 0:
            visible &= pos - n < window
        for h in range(HEADS):
            s = keys[:, h // group] @ q[t, h].double() * scale
            if soft_cap > 0:
                s = soft_cap * torch.tanh(s / soft_cap)
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=0)
            out[t, h] = p @ values[:, h // group]
    return out


def _run_paged(case, scale: float, soft_cap: float, window: int) -> None:
    q, k_cache, v_cache, token_seq, q_cu, kv_lens, table = case
    dev = [t.to(DEVICE) for t in case]
    out = torch.zeros_like(dev[0])
    paged_attention(*dev, scale, soft_cap, window, out)
    ref = _attention_ref(
        q, k_cache, v_cache, token_seq, q_cu, kv_lens, table, scale, soft_cap, window
    )
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)


@needs_runtime_loops
@pytest.mark.parametrize("soft_cap, window", [(0.0, 0), (5.0, 3)])
def test_paged_attention_decode(soft_cap: float, window: int) -> None:
    case = _paged_case(q_lens=[1, 1, 1], kv_lens=[5, 1, 9], pad=1)
    _run_paged(case, HEAD_DIM**-0.5, soft_cap, window)


@needs_runtime_loops
def test_paged_attention_prefill() -> None:
    # a fresh prompt, a chunk continuing a cached prefix, and a padding row
    case = _paged_case(q_lens=[6, 3], kv_lens=[6, 10], pad=1, seed=1)
    _run_paged(case, HEAD_DIM**-0.5, 0.0, 0)


# fused add + RMSNorm, rotary -------------------------------------------------------------------

from conformance_tests import ops_reference as ops_ref  # noqa: E402  (section-local imports)
from xhal.platforms.cuda.kernels.norm import fused_add_rms_norm  # noqa: E402  (section-local)
from xhal.platforms.cuda.kernels.rotary import rotary_embedding  # noqa: E402  (section-local)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, eps", [((3, 100), 1e-6), ((2, 2, 64), 0.5), ((1, 4096), 1e-5)])
def test_fused_add_rms_norm(shape: tuple[int, ...], eps: float, dtype: torch.dtype) -> None:
    x, residual = _randn(*shape, dtype=dtype, seed=0), _randn(*shape, dtype=dtype, seed=1)
    w = 1.0 + _randn(shape[-1], dtype=dtype, seed=2, scale=0.1)
    before = (x.clone(), residual.clone())
    normed, summed = fused_add_rms_norm(x, residual, w, eps)
    want_normed, want_summed = ops_ref.fused_add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), eps)
    assert_matches(summed, want_summed, dtype)
    assert_matches(normed, want_normed, dtype)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_fused_add_rms_norm_strided_rows() -> None:
    wide = _randn(3, 256, dtype=torch.float32, seed=0)
    x, residual = wide[:, :128], wide[:, 128:]  # rows 256 apart
    w = _randn(128, dtype=torch.float32, seed=1)
    normed, summed = fused_add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_summed = ops_ref.fused_add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), 1e-6)
    assert_matches(normed, want_normed, torch.float32)
    assert_matches(summed, want_summed, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (64, 32), (80, 48)])
def test_rotary_embedding(
    head_dim: int, rotary_dim: int, is_neox: bool, dtype: torch.dtype
) -> None:
    heads, kv_heads, tokens = 4, 2, 5
    # q and k as slices of one fused qkv projection, as the model hands them over
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 7, 300, 1, 4095], dtype=torch.int32, device=DEVICE)
    cache = ops_ref.rope_cache(4096, rotary_dim).to(DEVICE)
    q_out, k_out = rotary_embedding(positions, q, k, cache, is_neox)
    assert_matches(
        q_out, ops_ref.rotary_embedding(positions.cpu(), q.cpu(), cache.cpu(), is_neox), dtype
    )
    assert_matches(
        k_out, ops_ref.rotary_embedding(positions.cpu(), k.cpu(), cache.cpu(), is_neox), dtype
    )
    assert torch.equal(qkv, _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=0))


# FlashInfer's page table, built on the host -----------------------------------------------------


@pytest.mark.parametrize("host_pages", [False, True], ids=["device_gather", "host_built"])
def test_paged_index_builder(host_pages: bool) -> None:
    """CSR page table of a mixed batch: indptr, last-page lengths, page ids per row and the flat
    block-table positions they are gathered from."""
    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import BatchKind
    from xhal.platforms.cuda.flashinfer_page_table import PagedIndexBuilder

    bs = 16
    seqs = [Seq(1, 17), Seq(5, 5), Seq(3, 35), Seq(1, 1, padding=True)]
    rows = [[7, 2], [9], [4, 0, 11], []]
    batch = build_batch(BatchKind.MIXED, seqs, rows, bs, torch.device("cpu"), paged_kv=host_pages)
    m = batch.metadata
    builder = PagedIndexBuilder(bs, pin=False)
    idx = builder.build(m)
    assert idx.qo_indptr.tolist() == [0, 1, 6, 9, 10] and idx.num_real_tokens == 10
    assert idx.indptr.tolist() == [0, 2, 3, 6, 7] and idx.num_pages == 7
    assert idx.last_page_len.tolist() == [1, 5, 3, 1]
    # the dummy row reads one page: the first entry of its block-table row, which the suite fills
    # with a stale but valid id (as the executor leaves it); the host-built arrays give block 0
    dummy = 0 if host_pages else int(m.block_table[3, 0])
    assert builder.page_ids(m, idx).tolist() == [7, 2, 9, 4, 0, 11, dummy]
    if host_pages:
        assert idx.positions is None
    else:  # flat block-table positions: row * width + page
        width = m.block_table.shape[1]
        assert idx.positions.tolist() == [
            0,
            1,
            width,
            2 * width,
            2 * width + 1,
            2 * width + 2,
            3 * width,
        ]


def test_paged_index_builder_stages_the_hosts_csr_arrays() -> None:
    """Host-built ``paged_kv_*_host`` arrays are staged as given, not rebuilt from the lengths:
    the builder hands FlashInfer exactly what the host put there."""
    import dataclasses

    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import BatchKind
    from xhal.platforms.cuda.flashinfer_page_table import PagedIndexBuilder

    bs = 16
    batch = build_batch(
        BatchKind.DECODE,
        [Seq(1, 17), Seq(1, 40)],
        [[7, 2], [4, 0, 11]],
        bs,
        torch.device("cpu"),
        paged_kv=True,
    )
    m = batch.metadata
    assert m.paged_kv_indptr_host.tolist() == [
        0,
        2,
        5,
    ] and m.paged_kv_last_page_len_host.tolist() == [1, 8]
    # a host whose last pages are full (say it reserved them) says so, and is believed
    m = dataclasses.replace(
        m, paged_kv_last_page_len_host=torch.tensor([16, 16], dtype=torch.int32)
    )
    idx = PagedIndexBuilder(bs, pin=False).build(m)
    assert idx.indptr.tolist() == [0, 2, 5] and idx.last_page_len.tolist() == [16, 16]


def test_page_positions_follow_the_table_strides() -> None:
    """A graph bucket gathers page ids from its block table as laid out in memory: positions in
    a column-major table view name the same entries as in a row-major one."""
    from xhal.platforms.cuda.flashinfer_page_table import page_positions

    table = torch.tensor([[7, 2, 0], [9, 0, 0], [4, 1, 11]], dtype=torch.int32)
    pages = np.array([2, 1, 3], dtype=np.int32)
    indptr = np.array([0, 2, 3, 6], dtype=np.int32)
    for view in (table, table.t().contiguous().t()):
        out = np.empty(6, dtype=np.int32)
        page_positions(pages, indptr, *view.stride(), out=out)
        flat = view.as_strided((view.numel(),), (1,))
        assert flat[torch.from_numpy(out).long()].tolist() == [7, 2, 9, 4, 1, 11]


def test_flashinfer_activations_only_get_inputs_they_take() -> None:
    """Odd widths (22 -> 11 channels, found failing on the H200) go to the torch path."""
    from xhal.platforms.cuda.ops import FlashInferOps

    fits = FlashInferOps._fi_activation_fits
    assert fits(torch.zeros(3, 2 * 4096, dtype=torch.bfloat16))
    assert not fits(torch.zeros(1, 22, dtype=torch.bfloat16))
    assert not fits(torch.zeros(3, 2 * 64, dtype=torch.float32))
    assert not fits(
        torch.zeros(3, 2 * 4096 + 16, dtype=torch.float16)[:, 8:]
    )  # strided, misaligned


def test_cuda_linear_uses_gemv_only_once_eagerly_then_in_captures(monkeypatch) -> None:
    from xhal.platforms.cuda import ops as cuda_ops

    calls = []
    real_gemv = cuda_ops.gemv.gemv
    monkeypatch.setattr(cuda_ops.gemv, "gemv", lambda *a: calls.append("gemv") or real_gemv(*a))
    capturing = [False]
    monkeypatch.setattr(cuda_ops.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    linear = cuda_ops.CudaOps().linear
    x, w, w2 = (
        _randn(1, 64, dtype=torch.float32, seed=0),
        _randn(32, 64, dtype=torch.float32, seed=1),
        _randn(16, 64, dtype=torch.float32, seed=2),
    )
    want = x.double() @ w.double().T
    capturing[0] = True
    assert_matches(linear(x, w), want, torch.float32)  # never launched: cuBLAS under capture
    assert calls == []
    capturing[0] = False
    for expected in (["gemv"], ["gemv"]):  # first eager call loads it; later eager ones: cuBLAS
        assert_matches(linear(x, w), want, torch.float32)
        assert calls == expected
    capturing[0] = True
    assert_matches(linear(x, w), want, torch.float32)
    linear(x, w2)  # another shape, never launched eagerly
    linear(torch.cat([x, x]), w)  # two rows: past gemv_max_rows
    assert calls == ["gemv", "gemv"]


def test_cuda_gemv_rows_from_the_environment(monkeypatch) -> None:
    from xhal.platforms.cuda import ops as cuda_ops

    monkeypatch.setenv("XHAL_CUDA_GEMV_MAX_ROWS", "64")
    assert cuda_ops.CudaOps().gemv_max_rows == 64
    monkeypatch.delenv("XHAL_CUDA_GEMV_MAX_ROWS")
    assert cuda_ops.CudaOps().gemv_max_rows == 1
    for bad in ("65", "-1", "many"):
        monkeypatch.setenv("XHAL_CUDA_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="XHAL_CUDA_GEMV_MAX_ROWS"):
            cuda_ops.CudaOps()


def test_triton_graph_plan_reads_the_persistent_metadata() -> None:
    """A graph bucket's plan binds the persistent metadata itself, rebuilds token_seq only when
    query lengths change, and refuses other tensors."""
    from benchmarks.host_timing import DeviceCalls
    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import AttentionSpec, BatchKind
    from xhal.platforms.cuda.triton_attention import TritonAttention

    def step(kv_lens: list[int]):
        seqs = [Seq(1, n) for n in kv_lens] + [Seq(1, 1, padding=True)]
        rows = [[3, 5], [1], []]
        return build_batch(
            BatchKind.DECODE, seqs, rows, 16, torch.device("cpu"), max_blocks=2
        ).metadata

    backend = TritonAttention(AttentionSpec(4, 1, 64, torch.float32, 16))
    first = step([17, 4])
    backend.plan(first, graph_key="b")
    assert (
        backend._plan.token_seq.tolist() == [0, 1, 2]
        and backend._plan.slot_mapping is first.slot_mapping
    )
    nxt = step([18, 5])  # staged into the first step's tensors, as the executor does
    fields = (
        "q_cu_seq_lens",
        "kv_cu_seq_lens",
        "q_seq_lens",
        "kv_seq_lens",
        "block_table",
        "slot_mapping",
    )
    for name in fields:
        getattr(first, name).copy_(getattr(nxt, name))
    with DeviceCalls() as calls:
        backend.plan(
            dataclasses.replace(nxt, **{n: getattr(first, n) for n in fields}), graph_key="b"
        )
    assert calls.ops == []  # nothing queued on the device
    with pytest.raises(ValueError, match="persistent"):
        backend.plan(nxt, graph_key="b")
