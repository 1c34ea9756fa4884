"""Packed copies of a model's float32 matrices, multiplied by the native ``xhal_small_gemm``
(``kernels/small_gemm.c``) for every product of two rows or more. At decode batches MKL's GEMM
and oneDNN's are compute-bound well before the memory is (one thread, CPU time, SmolLM2-135M's
shapes at 8 rows: gate / up 1.27 ms MKL, 0.85 oneDNN on its packed copy, 0.59 ours; the LM head
17.0 / 12.0 / 9.7, where one row's GEMV reads it in 6.2); at a prefill's rows MKL's float32 GEMM
reaches about 60-80 GF/s per core on this CPU (AMD EPYC, Zen 4) where the kernel's register
tiles reach about 90 (SmolLM2's four products at 1,300 rows, one thread: 141 ms MKL, 98 ours),
so every matrix gets a copy in the kernel's tiles; one row keeps MKL's GEMV on the column-major
matrix, the fastest there. Costs the packed matrices' bytes once more. Without the native
kernels (no compiler, ``XHAL_CPU_NATIVE=0``) nothing is packed and MKL serves every product."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from xhal.platforms.cpu_fast.kernels.native import library

MIN_ROWS = 2  # rows from which a packed copy serves (one row: MKL's GEMV)
TILE = 32  # output columns per tile of the packed layout (small_gemm.c's TILE)
MIN_ELEMENTS = 1 << 16  # smaller matrices are not packed: their product is all call overhead

_serving = True  # False inside ``disabled()``


def available() -> bool:
    return library() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block no packed copy serves (MKL for every product): for benchmarks that
    compare the two in one process."""
    global _serving
    saved, _serving = _serving, False
    try:
        yield
    finally:
        _serving = saved


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (any strides) -> ``[ceil(N / TILE), K, TILE]`` contiguous: tile t, row
    k holds ``weight[TILE t : TILE (t + 1), k]``, zeros past N."""
    width, depth = weight.shape
    tiles = -(-width // TILE)
    padded = weight.new_zeros(tiles * TILE, depth)
    padded[:width] = weight
    return padded.view(tiles, TILE, depth).transpose(1, 2).contiguous()


class PackedWeights:
    """Packed copies keyed by the parameter itself (its ``id``, held by a weak reference whose
    callback drops the entry: a weight that dies takes its copy along, and a new tensor at the
    same id is not mistaken for it). Weights are final once packed (``prepare_weights``'
    contract); one changed in place all the same (``_version``) or given new storage
    (``data_ptr``) is no longer served by the stale copy. Writes through ``.data`` bypass the
    version counter: they break the contract undetected."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[weakref.ref, torch.Tensor, int, int]] = {}

    def add(self, weight: torch.Tensor) -> bool:
        """Pack ``weight`` if it is a float32 matrix of at least ``MIN_ELEMENTS`` and the native
        kernels are built; returns whether it was packed."""
        if (
            weight.dtype != torch.float32
            or weight.dim() != 2
            or weight.numel() < MIN_ELEMENTS
            or not available()
        ):
            return False
        packed = pack(weight.detach())
        key = id(weight)
        owner = weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None))
        self._packed[key] = (owner, packed, weight.data_ptr(), weight._version)
        return True

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` by the packed copy, or None when none serves this call."""
        if (
            not _serving
            or x.dim() != 2
            or x.shape[0] < MIN_ROWS
            or x.dtype != torch.float32
            or x.stride(1) != 1
            or x.shape[1] != weight.shape[-1]  # F.linear raises its own error
        ):
            return None
        entry = self._packed.get(id(weight))
        if entry is None:
            return None
        owner, packed, data_ptr, version = entry
        if owner() is not weight:
            return None
        if weight.data_ptr() != data_ptr or weight._version != version:
            del self._packed[id(weight)]  # changed since it was packed
            return None
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        lib = library()
        if lib is None:  # inside native.torch_path()
            return None
        rows, depth = x.shape
        width = weight.shape[0]
        out = torch.empty(rows, width)
        lib.xhal_small_gemm(
            x.data_ptr(), rows, depth, x.stride(0), packed.data_ptr(), width,
            None if bias is None else bias.data_ptr(), out.data_ptr(), width,
        )  # fmt: skip
        return out


PACKED = PackedWeights()  # the copies cpu-fast's prepare_weights made, for FastCpuOps.linear
