"""oneDNN-packed copies of a model's float32 matrices for small decode batches: MKL's GEMM on the
column-major matrix is compute-bound at a few rows (oneDNN on a weight reordered once is 1.1-1.6x
faster there), while at one row MKL's GEMV on the column-major matrix is the faster one, so both
copies are kept. Where the packed copy starts to win depends on the shape (one thread, CPU
time, interleaved, SmolLM2-135M's shapes): from 2 rows for the widest matrices (gate / up, the LM
head: 1.5-1.9x at 4-32 rows), from about 6 rows for the others (q/k/v, down: 1.1-1.3x at 8
rows, a tie or slower at 4). Small matrices are left out: on two threads MKL's GEMM on SmolLM2's
576 x 576 o projection was as fast or faster at 8 rows (103-138 against 118-171 us, three
interleaved runs), while q/k/v (960 x 576: 213-233 against 197-209) and down (576 x 1536:
mixed, 1.0-1.1x) gained. Costs the packed matrices' bytes once more."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

MAX_ROWS = 32  # rows up to which a packed copy serves (the packing's batch-size hint)
MIN_WIDTH = 4  # a "wide" matrix [N, K] has N >= MIN_WIDTH * K ...
WIDE_MIN_ROWS = 2  # ... and its packed copy serves from 2 rows
NARROW_MIN_ROWS = 6  # the others' from 6 rows (measured above)
MIN_ELEMENTS = 1 << 19  # matrices smaller than this are not packed (measured above)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


_narrow_min_rows = NARROW_MIN_ROWS  # MAX_ROWS + 1 inside ``wide_only()``


def is_wide(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features >= MIN_WIDTH * in_features


@contextlib.contextmanager
def wide_only() -> Iterator[None]:
    """Inside the block only the wide matrices' copies serve (the narrow ones' MKL path, as
    before they were packed): for benchmarks that compare the two in one process."""
    global _narrow_min_rows
    saved, _narrow_min_rows = _narrow_min_rows, MAX_ROWS + 1
    try:
        yield
    finally:
        _narrow_min_rows = saved


class PackedWeights:
    """Packed copies keyed by the parameter itself (its ``id``, held by a weak reference whose
    callback drops the entry: a weight that dies takes its copy along, and a new tensor at the
    same id is not mistaken for it). Weights are final once packed (``prepare_weights``'
    contract); one changed in place all the same (``_version``) or given new storage
    (``data_ptr``) is no longer served by the stale copy. Writes through ``.data`` bypass the
    version counter: they break the contract undetected."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[weakref.ref, torch.Tensor, int, int, bool]] = {}

    def add(self, weight: torch.Tensor) -> bool:
        """Pack ``weight`` if it is a float32 matrix of at least ``MIN_ELEMENTS``; returns
        whether it was packed."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() < MIN_ELEMENTS:
            return False
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), MAX_ROWS)
        key = id(weight)
        owner = weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None))
        self._packed[key] = (owner, packed, weight.data_ptr(), weight._version, is_wide(weight))
        return True

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` by the packed copy, or None when none serves this call."""
        if x.dim() != 2 or not 1 < x.shape[0] <= MAX_ROWS or x.dtype != torch.float32:
            return None
        entry = self._packed.get(id(weight))
        if entry is None:
            return None
        owner, packed, data_ptr, version, wide = entry
        if owner() is not weight or x.shape[0] < (WIDE_MIN_ROWS if wide else _narrow_min_rows):
            return None
        if weight.data_ptr() != data_ptr or weight._version != version:
            del self._packed[id(weight)]  # changed since it was packed
            return None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


PACKED = PackedWeights()  # the copies cpu-fast's prepare_weights made, for FastCpuOps.linear
