"""A skinny GEMM for 1 to 64 rows on the tensor cores: ``skinny_mma.cu`` (what it computes and
how), built by ``native.py``. Its place is a decode batch's projections (issue 12's batch-64
step), where cuBLAS streams the 8B shape's qkv, o and down weights at 0.66-0.76 of the read
ceiling.

``plan`` picks the launch shape of (rows, N, K): a cluster of ``ks`` CTAs (1 to 8) a block of
``bn`` weight rows, each CTA one of ``ks`` ranges of K, at most one CTA an SM, and no more clusters
than the device holds at once (``native.cluster_fit``: a cluster's CTAs share a GPC; on an H100
the launches of 16 clusters of 8 or 32 of 4 took about twice as long as one wave would, the mark
of clusters left for a second wave, docs/h200-results.md, twenty-third session). Among the
shapes that fit (``candidates``) and keep at least three quarters of the SMs busy, the one whose
CTA moves the fewest bytes (``cost``) wins; ties go to the wider block (less of x through L2),
then the smaller cluster.

``shape(..., wgmma=True)`` is the wgmma build of a shape (sm_90a): benchmarks time it, ``plan``
does not pick it.

Shapes it takes (``supports``, then ``SkinnyMma.plan``): fp16 / bf16, K and the row strides
multiples of 8 elements, a contiguous weight, no bias; sm_90+. ``CudaOps`` sends it a 2- to
64-row linear where a timing on the machine found it faster than cuBLAS (``skinny_choice.py``;
``XHAL_CUDA_SKINNY_MMA=1`` wherever it takes the shape). On an H100 its one-wave plans matched
float64 as closely as cuBLAS, beat it on every 8B projection at 16 rows and lost on the 8B's qkv
and o at 64 (docs/h200-results.md, twenty-fifth session).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from xhal.platforms.cuda import native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("skinny_mma.cu")
MAX_ROWS = 64
MAX_CLUSTER = 8  # the portable cluster size
_MAX_STAGES = 8
_ALIGN = 1024  # the kernel rounds its shared memory up to 1 KB (the swizzle is by address)
# (weight rows a warp, most warps): a warp's accumulators are WR x 64 fp32 at 64 rows
_WARP_SHAPES = ((64, 8), (32, 12), (16, 16))


@dataclass(frozen=True)
class Plan:
    """A launch shape: input rows of the tile, weight rows a warp, warps, CTAs a cluster, ring
    stages, shared memory (bytes)."""

    mt: int
    wr: int
    warps: int
    ks: int
    stages: int
    shared_mem: int
    wgmma: bool = False  # wgmma on sm_90a (wr 16, warps in fours) in place of mma.sync

    @property
    def label(self) -> str:
        """Weight rows a warp x warps, CTAs a cluster, ring stages (the benchmarks' names)."""
        tag = f"{self.wr}x{self.warps} ks{self.ks} s{self.stages}"
        return f"wgmma {tag}" if self.wgmma else tag

    @property
    def bn(self) -> int:
        """Weight rows a cluster."""
        return self.wr * self.warps

    def blocks(self, n: int) -> int:
        """Clusters a launch against ``n`` weight rows."""
        return -(-n // self.bn)

    def ctas(self, n: int) -> int:
        return self.blocks(n) * self.ks

    def defines(self, dtype: torch.dtype, pdl: bool) -> dict[str, int]:
        return {
            "DTYPE_BF16": int(dtype == torch.bfloat16), "MT": self.mt, "WR": self.wr,
            "WARPS": self.warps, "KS": self.ks, "STAGES": self.stages, "USE_PDL": int(pdl),
            "WGMMA": int(self.wgmma),
        }  # fmt: skip


def shape(mt: int, wr: int, warps: int, ks: int, k: int, max_shared_mem: int,
          stages: int | None = None, wgmma: bool = False) -> Plan | None:  # fmt: skip
    """The plan of one launch shape (``stages``: as many as fit, at most 8, when None), or None
    where it breaks the kernel's rules or its ring would hold under two stages."""
    bn = wr * warps
    boxes = -(-bn // 256)
    steps = -(-k // 64) // ks
    if mt % 16 or not 16 <= mt <= MAX_ROWS or wr % 16 or bn % 32 or bn % boxes:
        return None
    if wgmma and (wr != 16 or warps % 4 or warps > 32):
        return None
    if (bn // boxes) % 8 or bn // 4 < ks or ks > MAX_CLUSTER or steps < 1:
        return None
    stage = (bn + mt) * 128
    part = mt * (bn + 4) * 4
    fit = (max_shared_mem - _ALIGN - 8 * _MAX_STAGES) // stage
    stages = min(_MAX_STAGES, fit, steps) if stages is None else stages
    if stages < min(2, steps) or stages > fit:
        return None
    shared = _ALIGN + max(stages * stage, part) + 8 * stages
    return Plan(mt, wr, warps, ks, stages, shared, wgmma)


# what a byte of the partial sum read from another CTA of the cluster costs against a byte of
# weight: the sum runs after the stream, so nothing hides it. Fitted to the H100 run of the
# twenty-third session (docs/h200-results.md), 8B qkv at 64 rows over 96 CTAs: 48 clusters of 2,
# 24 of 4 and 12 of 8 (blocks of 128, 256 and 512 rows, the same weight bytes a CTA) reached
# 0.757, 0.74-0.75 and 0.68 of the read ceiling, which a weight of 1.8-2.3 reproduces
EPILOGUE_WEIGHT = 2.0


def cost(p: Plan, k: int) -> float:
    """The bytes a CTA of ``p`` moves against a K of ``k``, in weight bytes: its weight slice; its
    x slice at half weight (from L2); the cluster's partial sums it reads from its peers (fp32, its
    share of the columns from the other ``ks - 1`` CTAs) at ``EPILOGUE_WEIGHT``."""
    steps = -(-(-(-k // 64)) // p.ks)  # its 64-column chunks
    stream = (p.bn + 0.5 * p.mt) * steps * 128
    return stream + EPILOGUE_WEIGHT * p.mt * p.bn * 4 * (p.ks - 1) / p.ks


def candidates(m: int, n: int, k: int, num_sms: int, max_shared_mem: int,
               clusters: tuple[int, ...] | None = None) -> list[Plan]:  # fmt: skip
    """Every launch shape for ``m`` input rows against an ``[n, k]`` weight that runs one CTA an
    SM in one wave, best first (module doc). ``clusters[size - 1]``: how many clusters of
    ``size`` whole-SM CTAs the device holds at once (``native.cluster_fit``); None assumes GPCs
    that waste no SM (``num_sms // size``)."""
    if not 1 <= m <= MAX_ROWS:
        return []
    mt = 16 * -(-m // 16)
    fit = clusters or tuple(num_sms // size for size in range(1, MAX_CLUSTER + 1))
    found = []
    for wr, most in _WARP_SHAPES:
        for warps in range(4, most + 1):  # a warp on each of the SM's four schedulers
            for ks in range(1, MAX_CLUSTER + 1):
                p = shape(mt, wr, warps, ks, k, max_shared_mem)
                if p is not None and p.ctas(n) <= num_sms and p.blocks(n) <= fit[ks - 1]:
                    found.append(p)
    # launches that leave over a quarter of the SMs idle last (the bytes a CTA moves say nothing
    # of the HBM bandwidth the idle SMs would have drawn)
    return sorted(found, key=lambda p: (p.ctas(n) < 0.75 * num_sms, cost(p, k), -p.bn, p.ks))


@functools.cache
def plan(m: int, n: int, k: int, num_sms: int, max_shared_mem: int,
         clusters: tuple[int, ...] | None = None) -> Plan | None:  # fmt: skip
    """The launch shape for ``m`` input rows against an ``[n, k]`` weight: the first of
    ``candidates``, or None."""
    found = candidates(m, n, k, num_sms, max_shared_mem, clusters)
    return found[0] if found else None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands on a device whose GPCs waste no SM (the caller
    falls back otherwise; ``SkinnyMma.plan`` may still find no shape on the device itself)."""
    if not native.takes_rows(x, MAX_ROWS) or x.stride(1) != 1 or x.stride(0) % 8:
        return False
    k = x.shape[1]
    if weight.dtype != x.dtype or weight.device != x.device or weight.dim() != 2:
        return False
    if weight.shape[1] != k or k % 8 or not weight.is_contiguous():
        return False
    if x.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    props = torch.cuda.get_device_properties(x.device)
    smem = native.max_shared_mem(x.device)
    return plan(x.shape[0], weight.shape[0], k, props.multi_processor_count, smem) is not None


class SkinnyMma:
    """The launches of one device, its kernels by shape, the weights' tensor maps by address."""

    def __init__(self, device: torch.device) -> None:
        self._kernels = native.KernelCache(SOURCE, "skinny_mma", device)
        self._wgmma_kernels = native.KernelCache(SOURCE, "skinny_mma", device, suffix="a")
        self._weight_maps: dict[tuple, native.TensorMap] = {}
        try:  # clusters of 1..8 whole-SM CTAs the device holds at once
            self.clusters: tuple[int, ...] | None = native.cluster_fit(device)
        except RuntimeError as e:
            logger.warning("cuda: skinny GEMM plans as if no GPC wasted an SM: %s", e)
            self.clusters = None

    def plan(self, m: int, n: int, k: int) -> Plan | None:
        """The launch shape on this device (its GPCs' sizes counted), or None."""
        kernels = self._kernels
        return plan(m, n, k, kernels.num_sms, kernels.max_shared_mem, self.clusters)

    def choices(self, m: int, n: int, k: int) -> list[Plan]:
        """The launch shapes worth timing on this device: the plan, then the best of clusters of
        two and of one CTA where they differ from it (on an H100 the 2-CTA shapes were the
        fastest of every 64-row sweep, where the plan's cost took larger clusters;
        docs/h200-results.md, twenty-fifth session)."""
        kernels = self._kernels
        found = candidates(m, n, k, kernels.num_sms, kernels.max_shared_mem, self.clusters)
        picked = found[:1]
        for ks in (2, 1):
            best = next((p for p in found if p.ks == ks), None)
            if best is not None and best not in picked:
                picked.append(best)
        return picked

    def _weight_map(self, weight: torch.Tensor, box_rows: int) -> native.TensorMap:
        key = (weight.data_ptr(), *weight.shape, box_rows)
        if key not in self._weight_maps:
            self._weight_maps[key] = native.tensor_map(weight, box_rows)
        return self._weight_maps[key]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, use_pdl: bool,
                 p: Plan | None = None) -> torch.Tensor:  # fmt: skip
        """``x @ weight.T`` with the launch shape ``p`` (``plan``'s, or a benchmark's from
        ``shape``), else ``plan``'s; ``supports`` said yes for these operands."""
        m, k = x.shape
        n = weight.shape[0]
        p = p or self.plan(m, n, k)
        kernels = self._wgmma_kernels if p.wgmma else self._kernels
        kernel = kernels.get(p.defines(x.dtype, use_pdl), p.shared_mem)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        boxes = -(-p.bn // 256)
        args = [
            self._weight_map(weight, p.bn // boxes), native.tensor_map(x, p.mt),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_uint(n), ctypes.c_uint(m),
            ctypes.c_uint(-(-k // 64)), ctypes.c_longlong(out.stride(0)),
        ]  # fmt: skip
        kernel.launch(p.ctas(n), p.warps * 32, args, use_pdl, cluster=p.ks)
        return out
