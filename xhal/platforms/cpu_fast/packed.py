"""oneDNN-packed copies of a model's widest matrices (the gate / up projection, the LM head) for
small decode batches: MKL's GEMM is compute-bound at 2-32 rows on those shapes (1.5-1.9x slower
there than oneDNN on a weight reordered once; at one row MKL's GEMV on the column-major matrix
is the faster one, so both copies are kept). Costs the packed matrices' bytes once more."""

from __future__ import annotations

import weakref

import torch

ROWS = range(2, 33)  # batch rows where the packed GEMM wins (measured, benchmarks/bench_cpu_vs_hf)
MIN_WIDTH = 4  # pack [N, K] matrices with N >= MIN_WIDTH * K only


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


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
        """Pack ``weight`` if it is a wide float32 matrix; returns whether it was packed."""
        out_features, in_features = weight.shape
        if weight.dtype != torch.float32 or out_features < MIN_WIDTH * in_features:
            return False
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS.stop - 1)
        key = id(weight)
        owner = weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None))
        self._packed[key] = (owner, packed, weight.data_ptr(), weight._version)
        return True

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` by the packed copy, or None when none serves this call."""
        if x.dim() != 2 or x.shape[0] not in ROWS or x.dtype != torch.float32:
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
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


PACKED = PackedWeights()  # the copies cpu-fast's prepare_weights made, for FastCpuOps.linear
