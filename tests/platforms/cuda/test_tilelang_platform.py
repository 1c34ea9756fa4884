"""The ``cuda-tilelang`` platform off the GPU: its registration, the one log line and the Triton
solutions it falls back to when TileLang is missing, and the requirement and split rules of its
kernels (the kernels themselves run in the conformance suite on the H200)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch

import xhal
from xhal.interfaces import AttentionSpec

pytest.importorskip("triton", reason="the CUDA platform's fallback solutions are Triton kernels")

from xhal.platforms.cuda import tilelang_platform
from xhal.platforms.cuda.kernels import tilelang_decode, tilelang_norm
from xhal.platforms.cuda.tilelang_attention import unsupported


def test_registered_and_importable_without_tilelang():
    assert "cuda-tilelang" in xhal.platforms.names()
    # importing the platform and its kernels' modules never imports tilelang itself
    assert tilelang_platform.CudaTileLangPlatform.name == "cuda-tilelang"


def test_without_tilelang_runs_triton_and_says_so_once(monkeypatch, caplog):
    from xhal.platforms.cuda import platform as cuda_platform
    from xhal.solutions import DeviceInfo, selection

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # construction only, no launches
    monkeypatch.setattr(
        cuda_platform, "device_info", lambda: DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    )
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tilelang" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(selection, "_importable", lambda module: module in ("triton", "flashinfer"))
    monkeypatch.setattr(tilelang_platform, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=tilelang_platform.__name__):
        first = tilelang_platform.CudaTileLangPlatform()
        second = tilelang_platform.CudaTileLangPlatform()
    lines = [r.getMessage() for r in caplog.records if r.name == tilelang_platform.__name__]
    assert (
        len(lines) == 1
        and "tilelang is not installed" in lines[0]
        and "pip install tilelang==0.1.15" in lines[0]
    )
    spec = AttentionSpec(32, 8, 128, torch.bfloat16, 16)
    for platform in (first, second):
        assert platform.missing is not None
        assert platform.kernels.chosen["fused_add_rms_norm"].name == "triton"  # not TileLang's
        for op in ("paged_decode_attention", "paged_prefill_attention"):
            assert platform.kernels.attention_solution(op, spec).name == "triton"


def test_with_tilelang_its_solutions_are_chosen(monkeypatch):
    from xhal.platforms.cuda import platform as cuda_platform
    from xhal.solutions import DeviceInfo, selection

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        cuda_platform, "device_info", lambda: DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    )
    monkeypatch.setattr(tilelang_platform, "tilelang_missing", lambda: None)
    monkeypatch.setattr(selection, "_importable", lambda module: module in ("triton", "tilelang"))
    platform = tilelang_platform.CudaTileLangPlatform()
    spec = AttentionSpec(32, 8, 128, torch.bfloat16, 16)
    assert platform.kernels.chosen["fused_add_rms_norm"].name == "tilelang"
    assert platform.kernels.attention_solution("paged_decode_attention", spec).name == "tilelang"
    assert platform.kernels.attention_solution("paged_prefill_attention", spec).name == "triton"
    # on plain cuda without FlashInfer, TileLang's decode outranks the Triton kernel
    assert (
        selection.select(
            "paged_decode_attention",
            DeviceInfo("cuda", "H200", (9, 0)),
            dtype=torch.bfloat16,
            head_dim=128,
        ).name
        == "tilelang"
    )


def test_declared_attention_is_what_the_kernel_takes():
    caps = tilelang_platform.CudaTileLangPlatform.capabilities.attention
    for dtype in caps.dtypes:
        for head_dim in caps.head_dims:
            for block in caps.block_sizes:
                for heads, kv_heads in ((8, 8), (8, 2), (32, 4)):
                    assert (
                        unsupported(AttentionSpec(heads, kv_heads, head_dim, dtype, block)) is None
                    )
    assert not caps.sliding_window and not caps.logits_soft_cap


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (AttentionSpec(8, 2, 128, torch.float32, 16), "dtype"),
        (AttentionSpec(8, 2, 64, torch.bfloat16, 16), "head_dim 64"),
        (AttentionSpec(128, 1, 128, torch.bfloat16, 16), "GQA group 128"),
        (AttentionSpec(8, 2, 128, torch.bfloat16, 16, sliding_window=64), "sliding window"),
    ],
)
def test_unsupported_specs_are_named(spec, words):
    assert words in unsupported(spec)


def test_splits_fill_about_two_waves_from_shapes_alone():
    # 132 SMs (H200): 2 * 132 CTAs wanted; 8 kv heads per sequence
    assert tilelang_decode.num_splits(1, 8, 132) == 16  # 33 wanted, capped at 16
    assert tilelang_decode.num_splits(16, 8, 132) == 3  # ceil(264 / 128)
    assert tilelang_decode.num_splits(64, 8, 132) == 1
    assert tilelang_decode.num_splits(0, 8, 132) == 16  # an empty batch still gets a valid count


def test_norm_requirements():
    w = torch.ones(4096, dtype=torch.bfloat16)
    assert tilelang_norm.supports(torch.ones(3, 4096, dtype=torch.bfloat16), w)
    assert not tilelang_norm.supports(
        torch.ones(3, 192, dtype=torch.bfloat16), torch.ones(192, dtype=torch.bfloat16)
    )
    assert not tilelang_norm.supports(torch.ones(3, 4096, dtype=torch.bfloat16), w.float())
    assert not tilelang_norm.supports(
        torch.ones(3, 32768, dtype=torch.bfloat16), torch.ones(32768, dtype=torch.bfloat16)
    )


def test_row_tile_is_the_smallest_that_holds_the_group():
    assert [tilelang_decode.block_rows(g) for g in (1, 4, 16, 17, 64)] == [16, 16, 16, 64, 64]
    with pytest.raises(ValueError, match="up to 64"):
        tilelang_decode.block_rows(65)


@pytest.mark.parametrize("block_h", [32, 16])
def test_forced_row_tile_must_hold_the_group(block_h):
    from xhal.platforms.cuda.tilelang_attention import TileLangAttention

    with pytest.raises(ValueError, match="at least the GQA group 32"):  # before anything compiles
        TileLangAttention(AttentionSpec(64, 2, 128, torch.bfloat16, 16), None, 132, block_h=block_h)


class _RecordingFallback:
    """A stand-in fallback backend that records what it was asked to plan and run."""

    fuses_rotary = False

    def __init__(self) -> None:
        self.planned, self.forwards, self.replays = [], 0, []

    def bind_kv_caches(self, caches) -> None:
        self.caches = caches

    def plan(self, metadata, graph_key=None) -> None:
        self.planned.append((metadata.kind, graph_key))

    def forward(self, layer_id, q, k, v):
        self.forwards += 1
        return torch.full(q.shape, 7.0)

    def before_replay(self, graph_key) -> None:
        self.replays.append(graph_key)


def test_attention_skeleton_routes_and_pads_without_tilelang(monkeypatch):
    """``TileLangAttention`` on the shared ``DecodeOverFallback`` skeleton, its TileLang kernel
    replaced by a float64 stand-in (TileLang is absent here): a decode step writes k / v at the
    slots and calls the kernel with the sequences' rows and contiguous lengths, the bucket's
    padding rows come back zero; a graph key refuses other metadata tensors and its replays
    stay its own; a prefill step is planned and run by the fallback."""
    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import BatchKind, LayerCache
    from xhal.platforms.cuda.tilelang_attention import TileLangAttention

    calls = []

    def stand_in(q, k_cache, v_cache, block_table, kv_lens, scale, out, splits, block_h):
        calls.append((q.shape[0], kv_lens.is_contiguous(), splits, block_h))
        for i, n in enumerate(kv_lens.tolist()):  # float64 attention over the row's pages
            keys = torch.arange(n)
            blocks = block_table[i, keys // 16].long()
            kk = k_cache[blocks, keys % 16].double().repeat_interleave(4, dim=1)  # [n, H, D]
            vv = v_cache[blocks, keys % 16].double().repeat_interleave(4, dim=1)
            s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
            out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv).to(out.dtype)
        return out

    monkeypatch.setattr(tilelang_decode, "compiled", lambda *args: None)
    monkeypatch.setattr(tilelang_decode, "paged_decode", stand_in)
    spec = AttentionSpec(8, 2, 128, torch.bfloat16, 16)
    fallback = _RecordingFallback()
    backend = TileLangAttention(spec, fallback, num_sms=4)
    g = torch.Generator().manual_seed(0)
    shape = (8, 16, 2, 128)
    cache = LayerCache(torch.zeros(shape, dtype=torch.bfloat16),
                       torch.zeros(shape, dtype=torch.bfloat16))  # fmt: skip
    backend.bind_kv_caches([cache])
    assert fallback.caches[0] is cache

    batch = build_batch(BatchKind.DECODE, [Seq(1, 20), Seq(1, 3)], [[5, 2], [7]], 16, "cpu",
                        num_padding=2)  # fmt: skip
    m = batch.metadata
    backend.plan(m, graph_key="b2")
    qkv = torch.randn(4, 12, 128, generator=g).to(torch.bfloat16)  # 2 sequences + 2 padding
    q, k, v = qkv.split([8, 2, 2], dim=1)
    out = backend.forward(0, q, k, v)
    assert calls == [(2, True, tilelang_decode.num_splits(2, 2, 4), 16)]
    # slots: sequence 0 at position 19 (block 2, offset 3), sequence 1 at 2 (block 7, offset 2)
    assert torch.equal(cache.key[2, 3], k[0]) and torch.equal(cache.value[7, 2], v[1])
    want = stand_in(q[:2], cache.key, cache.value, m.block_table, m.kv_seq_lens_host,
                    spec.softmax_scale, torch.empty(2, 8, 128, dtype=torch.bfloat16), 0, 0)
    assert torch.equal(out[:2], want)  # attended after the write, over the sequences' rows
    assert torch.equal(out[2:], torch.zeros(2, 8, 128, dtype=torch.bfloat16))
    assert fallback.forwards == 0
    with pytest.raises(ValueError, match="persistent"):
        backend.plan(build_batch(BatchKind.DECODE, [Seq(1, 20), Seq(1, 3)], [[5, 2], [7]], 16,
                                 "cpu", num_padding=2).metadata, graph_key="b2")  # fmt: skip
    backend.before_replay("b2")
    assert fallback.replays == []  # a decode bucket's replays are the backend's own

    prefill = build_batch(BatchKind.PREFILL, [Seq(3, 3)], [[1]], 16, "cpu").metadata
    backend.plan(prefill, graph_key="p")
    q3, k3, v3 = torch.randn(3, 12, 128).to(torch.bfloat16).split([8, 2, 2], dim=1)
    assert torch.equal(backend.forward(0, q3, k3, v3), torch.full(q3.shape, 7.0))
    backend.before_replay("p")
    assert fallback.planned == [(BatchKind.PREFILL, "p")] and fallback.forwards == 1
    assert fallback.replays == ["p"]


def test_a_bucket_planned_with_its_last_metadata_object_reuses_that_plan(monkeypatch):
    """The executor plans a decode bucket with its one persistent metadata object every step:
    the skeleton then reuses the bucket's plan (no routing, address check or decode plan
    again), a step of the fallback's bucket still reaches the fallback's own plan every time,
    and another object is routed, checked and planned afresh."""
    from conformance_tests.batches import Seq, build_batch
    from xhal.interfaces import BatchKind
    from xhal.platforms.cuda.tilelang_attention import TileLangAttention

    monkeypatch.setattr(tilelang_decode, "compiled", lambda *args: None)
    fallback = _RecordingFallback()
    backend = TileLangAttention(AttentionSpec(8, 2, 128, torch.bfloat16, 16), fallback, 4)
    made, plan_decode = [], backend.plan_decode

    def counted(m, graph_key):
        made.append(graph_key)
        return plan_decode(m, graph_key)

    monkeypatch.setattr(backend, "plan_decode", counted)
    m = build_batch(BatchKind.DECODE, [Seq(1, 20)], [[5, 2]], 16, "cpu", num_padding=1).metadata
    backend.plan(m, graph_key="b2")
    first = backend._decode
    for _ in range(3):
        backend._decode = None
        backend.plan(m, graph_key="b2")
        assert backend._decode is first
    assert made == ["b2"]
    backend.plan(dataclasses.replace(m), graph_key="b2")  # the same tensors, a new object
    assert made == ["b2", "b2"]
    fresh = build_batch(BatchKind.DECODE, [Seq(1, 20)], [[5, 2]], 16, "cpu", num_padding=1)
    with pytest.raises(ValueError, match="persistent"):
        backend.plan(fresh.metadata, graph_key="b2")

    prefill = build_batch(BatchKind.PREFILL, [Seq(3, 3)], [[1]], 16, "cpu").metadata
    for _ in range(2):
        backend.plan(prefill, graph_key="p")
        assert backend._decode is None
    assert fallback.planned == [(BatchKind.PREFILL, "p")] * 2
