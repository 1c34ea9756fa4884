"""The tensor-core skinny GEMM's host side, off the GPU (``kernels/skinny_mma.py``): the launch
shapes ``plan`` picks fill the SMs without passing them, fit the shared memory and keep the
kernel's rules; the tensor map and cluster launch structures have the driver's layout; the source
compiles for sm_90 (its wgmma build for sm_90a) without spills and requests nothing but weights
before its PDL wait. The
kernel runs only on the GPU: ``benchmarks/bench_skinny_mma.py`` checks it against float64 and
times it, and the conformance ops family runs ``linear`` through it with
``XHAL_CUDA_SKINNY_MMA=1``."""

from __future__ import annotations

import ctypes

import pytest

from tests.platforms.cuda.test_native_kernels import (
    H100_SHARED,
    compile_sm90,
    global_reads_before_the_wait,
    needs_nvcc_and_cuobjdump,
)
from xhal.platforms.cuda import native
from xhal.platforms.cuda.kernels import skinny_mma

SMS = 132
# clusters of 1..8 whole-SM CTAs held at once by 8 GPCs of 18, 18, 18, 18, 16, 16, 14, 14 SMs: a
# layout that fits what an H100 showed (16 clusters of 8 and 32 of 4 ran in two waves, 12 of 8
# and 24 of 4 in one; docs/h200-results.md, twenty-third session)
UNEVEN = tuple(sum(g // size for g in (18, 18, 18, 18, 16, 16, 14, 14)) for size in range(1, 9))
# Llama-3-8B and Llama-3.2-1B projections: qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # fmt: skip


@pytest.mark.parametrize("clusters", [None, UNEVEN], ids=["even GPCs", "uneven GPCs"])
@pytest.mark.parametrize("m", [1, 2, 16, 17, 48, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_plans_fill_the_sms_in_one_wave_and_fit_the_shared_memory(m, n, k, clusters) -> None:
    p = skinny_mma.plan(m, n, k, SMS, H100_SHARED, clusters)
    assert p is not None
    assert p.mt >= m and p.mt % 16 == 0
    assert 0.75 * SMS <= p.ctas(n) <= SMS
    assert p.blocks(n) <= (clusters or [SMS // size for size in range(1, 9)])[p.ks - 1]
    assert p.warps >= 4 and p.bn % 32 == 0 and p.bn // 4 >= p.ks
    assert 2 <= p.stages <= 8 and p.ks <= skinny_mma.MAX_CLUSTER
    stage = (p.bn + p.mt) * 128
    ring, part = p.stages * stage, p.mt * (p.bn + 4) * 4
    assert p.shared_mem == 1024 + max(ring, part) + 8 * p.stages <= H100_SHARED


def test_plan_refuses_what_the_kernel_cannot_take() -> None:
    assert skinny_mma.plan(65, 4096, 4096, SMS, H100_SHARED) is None  # past MAX_ROWS
    assert skinny_mma.plan(0, 4096, 4096, SMS, H100_SHARED) is None
    # more weight rows than one CTA an SM can cover with one block each (an LM head)
    assert skinny_mma.plan(64, 128256, 4096, SMS, H100_SHARED) is None
    assert skinny_mma.shape(64, 32, 4, 16, 4096, H100_SHARED) is None  # past the cluster
    assert skinny_mma.shape(24, 32, 4, 1, 4096, H100_SHARED) is None  # rows of n8 pairs
    assert skinny_mma.shape(64, 64, 8, 1, 4096, 64 * 1024) is None  # not two stages


def test_a_cta_pays_for_the_partial_sums_it_reads_from_its_cluster() -> None:
    # 8B qkv at 64 rows over 96 CTAs, the three launches the H100 timed (twenty-third session):
    # each CTA streams the same weight bytes, and the wider the cluster the more of the partial
    # sums it reads after its stream (0.757, 0.74-0.75, 0.68 of the read ceiling)
    n, k = 6144, 4096
    two, four, eight = (skinny_mma.shape(64, 32, warps, ks, k, H100_SHARED)
                        for warps, ks in ((4, 2), (8, 4), (16, 8)))  # fmt: skip
    assert [p.ctas(n) for p in (two, four, eight)] == [96, 96, 96]
    costs = [skinny_mma.cost(p, k) for p in (two, four, eight)]
    assert costs[0] <= costs[1] < costs[2]
    # what a CTA streams is its weight slice and half its x slice; the sum adds the rest
    assert costs[0] == (128 + 32) * 32 * 128 + skinny_mma.EPILOGUE_WEIGHT * 64 * 128 * 4 / 2


def test_the_plan_weighs_x_through_l2_against_the_clusters_sum() -> None:
    # 8B o at 64 rows on GPCs that waste no SM: 64 blocks of 64 rows x K/2, 32 of 128 x K/4 and
    # 16 of 256 x K/8 all fill 128 SMs; the narrow block reads most x, the wide one most partials
    p = skinny_mma.plan(64, 4096, 4096, SMS, H100_SHARED)
    assert (p.bn, p.ks) == (128, 4)
    narrow = skinny_mma.shape(64, 16, 4, 2, 4096, H100_SHARED)
    wide = skinny_mma.shape(64, 64, 4, 8, 4096, H100_SHARED)
    costs = [skinny_mma.cost(q, 4096) for q in (p, narrow, wide)]
    assert costs[0] < min(costs[1:])


def test_a_launch_that_leaves_a_quarter_of_the_sms_idle_ranks_last() -> None:
    ranked = skinny_mma.candidates(64, 3072, 2048, SMS, H100_SHARED, UNEVEN)  # 1B qkv
    busy = [p.ctas(3072) >= 0.75 * SMS for p in ranked]
    assert busy[0] and busy == sorted(busy, reverse=True)
    # among the busy ones, the fewest bytes a CTA first
    costs = [skinny_mma.cost(p, 2048) for p, b in zip(ranked, busy) if b]
    assert costs == sorted(costs)


def test_a_plan_takes_no_more_clusters_than_the_gpcs_hold() -> None:
    # the same o on uneven GPCs: 16 clusters of 8 would leave two for a second wave
    p = skinny_mma.plan(64, 4096, 4096, SMS, H100_SHARED, UNEVEN)
    assert p.blocks(4096) <= UNEVEN[p.ks - 1] and (p.bn, p.ks) != (256, 8)
    ranked = skinny_mma.candidates(64, 4096, 4096, SMS, H100_SHARED, UNEVEN)
    assert ranked[0] == p and all(q.blocks(4096) <= UNEVEN[q.ks - 1] for q in ranked)
    # a cluster of any size up to 8: K and the columns split as evenly as whole chunks allow
    assert {q.ks for q in ranked} >= {3, 5, 6, 7}
    assert skinny_mma.candidates(65, 4096, 4096, SMS, H100_SHARED) == []


def test_tensor_maps_and_cluster_launches_have_the_driver_layout() -> None:
    assert ctypes.sizeof(native.TensorMap) == 128  # CU_TENSOR_MAP_NUM_QWORDS * 8
    config = native.launch_config(128, 256, 1024, 0, pdl=True, cluster=8)
    assert config.num_attrs == 2
    raw = ctypes.string_at(ctypes.addressof(config.attrs.contents), 2 * 72)
    assert int.from_bytes(raw[0:4], "little") == 6  # programmatic stream serialization
    assert int.from_bytes(raw[8:12], "little") == 1
    assert int.from_bytes(raw[72:76], "little") == 4  # cluster dimension, 72 bytes on
    assert [int.from_bytes(raw[80 + 4 * i : 84 + 4 * i], "little") for i in range(3)] == [8, 1, 1]
    assert native.launch_config(1, 32, 0, 0, pdl=False).num_attrs == 0
    alone = native.launch_config(1, 32, 0, 0, pdl=False, cluster=2)
    assert alone.num_attrs == 1 and alone.attrs[0].id == 4


def test_the_cluster_query_asks_the_driver_for_the_launch_it_describes(monkeypatch) -> None:
    import contextlib

    import torch

    asked = {}

    class Driver:
        def cuOccupancyMaxActiveClusters(self, count, fn, config):  # noqa: N802 - the driver's
            c = config._obj
            attr = c.attrs[0]
            asked.update(fn=fn, grid=list(c.grid), block=list(c.block), smem=c.shared_mem_bytes,
                         attrs=c.num_attrs, id=attr.id, dims=list(attr.value[:3]))  # fmt: skip
            count._obj.value = 14
            return 0

    monkeypatch.setattr(native, "_driver", lambda: Driver())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    kernel = object.__new__(native.Kernel)
    kernel._fn, kernel.device, kernel.shared_mem = "fn", "cuda:0", 200 * 1024
    assert kernel.max_active_clusters(8, 128) == 14
    assert asked == {
        "fn": "fn", "grid": [8, 1, 1], "block": [128, 1, 1], "smem": 200 * 1024, "attrs": 1,
        "id": 4, "dims": [8, 1, 1],
    }  # fmt: skip
    # a cluster of one is asked with the attribute too (without it an H100 answered 0)
    kernel.max_active_clusters(1, 128)
    assert asked["attrs"] == 1 and asked["id"] == 4 and asked["dims"] == [1, 1, 1]


@needs_nvcc_and_cuobjdump
def test_the_probe_compiles_for_sm90(tmp_path) -> None:
    compile_sm90(skinny_mma.SOURCE.with_name("probe.cu"), {}, tmp_path, warnings=False)


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("m,n,k,clusters", [
    (64, 6144, 4096, None), (64, 4096, 14336, None), (16, 2048, 2048, None),
    (48, 28672, 4096, None), (64, 2048, 8192, None),
    (64, 4096, 14336, UNEVEN), (64, 6144, 4096, UNEVEN),  # clusters of 7 and 8 (uneven shares)
])  # fmt: skip
def test_kernel_compiles_for_sm90_without_spills(m, n, k, clusters, bf16, tmp_path) -> None:
    import torch

    p = skinny_mma.plan(m, n, k, SMS, H100_SHARED, clusters)
    dtype = torch.bfloat16 if bf16 else torch.float16
    cubin = compile_sm90(skinny_mma.SOURCE, p.defines(dtype, True), tmp_path, warnings=False)
    assert global_reads_before_the_wait(cubin) == []


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize("mt,warps,ks", [(16, 16, 8), (32, 8, 4), (48, 24, 8), (64, 16, 8)])
def test_wgmma_build_compiles_for_sm90a_without_spills(mt, warps, ks, tmp_path) -> None:
    import torch

    p = skinny_mma.shape(mt, 16, warps, ks, 4096, H100_SHARED, wgmma=True)
    assert p is not None and p.wgmma
    defines = p.defines(torch.bfloat16, True)
    cubin = compile_sm90(skinny_mma.SOURCE, defines, tmp_path, warnings=False, arch="sm_90a")
    assert global_reads_before_the_wait(cubin) == []


def test_wgmma_shapes_are_warpgroups_of_16_row_warps() -> None:
    assert skinny_mma.shape(64, 32, 8, 8, 4096, H100_SHARED, wgmma=True) is None
    assert skinny_mma.shape(64, 16, 6, 8, 4096, H100_SHARED, wgmma=True) is None
    assert skinny_mma.shape(64, 16, 16, 8, 4096, H100_SHARED, wgmma=True).bn == 256


def test_the_switch_is_auto_by_default_and_strict(monkeypatch) -> None:
    from xhal import env

    monkeypatch.delenv("XHAL_CUDA_SKINNY_MMA", raising=False)
    assert env.cuda_skinny_mma() == "auto"
    for raw, mode in (("1", "on"), ("on", "on"), ("0", "off"), ("no", "off"), (" Auto ", "auto")):
        monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", raw)
        assert env.cuda_skinny_mma() == mode
    monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", "sometimes")
    with pytest.raises(ValueError, match="XHAL_CUDA_SKINNY_MMA"):
        env.cuda_skinny_mma()


def test_cuda_ops_keeps_cublas_for_what_the_kernel_does_not_take(monkeypatch) -> None:
    import torch

    from xhal.platforms.cuda.ops import CudaOps

    monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", "1")
    ops = CudaOps()
    x, w = torch.randn(16, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    assert not skinny_mma.supports(x, w)  # not a CUDA tensor
    assert ops._skinny_mma(x, w, None) is None
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)


def test_a_launch_the_driver_refuses_falls_back_to_cublas_for_good(monkeypatch, caplog) -> None:
    import torch

    from xhal.platforms.cuda.ops import CudaOps

    class Refusing:
        calls = 0

        def plan(self, m, n, k):
            return skinny_mma.plan(m, n, k, SMS, H100_SHARED)

        def __call__(self, x, weight, use_pdl, p):
            Refusing.calls += 1
            raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_CLUSTER_OUT_OF_RESOURCES")

    monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", "1")
    monkeypatch.setattr(skinny_mma, "supports", lambda x, w: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch
    ops = CudaOps()
    monkeypatch.setattr(ops, "_native", lambda device, family: Refusing())
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert "skinny GEMM off" in caplog.text
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert Refusing.calls == 1  # the shape is not tried again
