"""Whether a decode graph's 2- to 64-row projection runs on the tensor-core skinny GEMM
(``kernels/skinny_mma.py``) or on cuBLAS: timed on this machine the first time a shape is seen,
the answer kept on disk beside the solutions' autotuning winners.

Neither wins everywhere. On an H100 (docs/h200-results.md, twenty-fifth session) the skinny GEMM's
plan beat cuBLAS by 3-10% on every 8B projection at 16 rows and on the 1B's down projection, and
lost by 7-14% on the 8B's qkv and o at 64 rows and the 1B's qkv and o at 16. A planner that knew
which would need a model of cuBLAS's own kernels; timing both is cheaper and right on any card.

Each is timed as it runs in a decode graph: ``CALLS`` launches captured in one CUDA graph, cycling
through enough copies of the weight to overflow L2 (a step streams its weights from HBM), the
replays back to back, the best of ``TRIALS`` runs. The skinny GEMM must win by ``MARGIN`` to be
chosen: in a whole 8B step at 64 rows it lost more than its isolated timings said (12.1 against
11.6 ms, the isolated projections 5 us a layer slower), so a tie goes to the library."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from xhal import env
from xhal.solutions.tuning_cache import TuningCache

logger = logging.getLogger(__name__)

CALLS = 20
TRIALS = 3
MARGIN = 0.02
_MAX_COPY_BYTES = 512 << 20  # weight copies a timing may allocate beyond the weight itself
SOLUTION_KEY = "linear/skinny-mma-or-cublas"
SKINNY, CUBLAS = "skinny-mma", "cublas"

# (call(weight) -> out, weight) -> seconds a call; the CUDA one below, a fake in tests
Timer = Callable[[Callable[[torch.Tensor], object], torch.Tensor], float]


def _source_digest() -> str:
    source = Path(__file__).parent / "kernels" / "skinny_mma.cu"
    return hashlib.sha256(source.read_bytes()).hexdigest()[:8]


def bucket(m: int, n: int, k: int, dtype: torch.dtype, plan: object) -> str:
    """The cache's name of one choice: the shape, the dtype, the launch shape the planner gave and
    the kernel's source (a new planner or kernel is timed afresh)."""
    fields = "-".join(str(v) for v in dataclasses.astuple(plan))
    dt = str(dtype).removeprefix("torch.")
    return f"m{m}-n{n}-k{k}-{dt}-plan{fields}-src{_source_digest()}"


def cycled_graph_seconds(call: Callable[[torch.Tensor], object], weight: torch.Tensor) -> float:
    """Seconds a call of ``call(w)`` in a CUDA graph of ``CALLS`` calls cycling through copies of
    ``weight`` that together hold at least twice the device's L2."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    nbytes = weight.numel() * weight.element_size()
    extra = min(max(0, -(-2 * l2 // nbytes) - 1), _MAX_COPY_BYTES // nbytes)
    weights = [weight, *(weight.clone() for _ in range(extra))]
    call(weight)  # builds the kernel outside the capture
    torch.cuda.synchronize(weight.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(weights[i % len(weights)])
    graph.replay()
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(TRIALS):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3 / (5 * CALLS))
    del graph, weights
    return best


class SkinnyChoice:
    """``prefers_skinny``: the choice of one shape, from memory, the disk cache, or timing."""

    def __init__(self, cache: TuningCache, timer: Timer = cycled_graph_seconds) -> None:
        self.cache, self._timer = cache, timer
        self.chosen: dict[str, str] = {}  # bucket -> SKINNY or CUBLAS

    def prefers_skinny(
        self,
        name: str,
        skinny: Callable[[torch.Tensor], object],
        cublas: Callable[[torch.Tensor], object],
        weight: torch.Tensor,
    ) -> bool:
        """Whether ``skinny(weight)`` is to replace ``cublas(weight)`` for the bucket ``name``.
        Timing (the first sight on this machine, ``XHAL_AUTOTUNE`` on) runs both; with it off an
        unknown bucket takes cuBLAS. A failure of the skinny GEMM propagates (the caller turns the
        shape off); running out of memory for the weight copies picks cuBLAS for this process."""
        if name in self.chosen:
            return self.chosen[name] == SKINNY
        winner = self.cache.get(SOLUTION_KEY, name)
        if winner not in (SKINNY, CUBLAS):
            if not env.autotune():
                return False
            try:
                times = {SKINNY: self._timer(skinny, weight), CUBLAS: self._timer(cublas, weight)}
            except torch.OutOfMemoryError as e:
                logger.warning("cuda: skinny GEMM untimed for %s (%s): cuBLAS", name, e)
                self.chosen[name] = CUBLAS
                return False
            winner = SKINNY if times[SKINNY] < (1 - MARGIN) * times[CUBLAS] else CUBLAS
            logger.info(
                "cuda: %s -> %s (skinny GEMM %.1f us, cuBLAS %.1f us)",
                name, winner, times[SKINNY] * 1e6, times[CUBLAS] * 1e6,
            )  # fmt: skip
            try:
                self.cache.put(SOLUTION_KEY, name, winner)
            except OSError as e:  # a read-only cache directory costs a retiming next start
                logger.warning("cuda: cannot write %s (%s); set XHAL_CACHE_DIR", self.cache.path, e)
        self.chosen[name] = winner
        return winner == SKINNY
