"""The ``cuda-tilelang`` platform off the GPU: its registration, the one log line and the Triton
solutions it falls back to when TileLang is missing, and the requirement and split rules of its
kernels (the kernels themselves run in the conformance suite on the H200)."""

from __future__ import annotations

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
        cuda_platform, "_device_info", lambda: DeviceInfo("cuda", "NVIDIA H200", (9, 0))
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
        cuda_platform, "_device_info", lambda: DeviceInfo("cuda", "NVIDIA H200", (9, 0))
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
