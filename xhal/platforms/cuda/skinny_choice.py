"""Whether a decode graph's 2- to 64-row projection runs on the tensor-core skinny GEMM
(``kernels/skinny_mma.py``), and with which launch shape, or on cuBLAS: timed on this machine the
first time a shape is seen, the answer kept on disk beside the solutions' autotuning winners.

Neither wins everywhere. On an H100 (docs/h200-results.md, twenty-fifth session) the skinny GEMM's
plan beat cuBLAS by 3-10% on every 8B projection at 16 rows and on the 1B's down projection, and
lost by 7-14% on the 8B's qkv and o at 64 rows and the 1B's qkv and o at 16; on the 8B's down at
64 the plan lost by 23% where a cluster of two CTAs tied. A planner that knew would need a model
of cuBLAS's kernels and of cluster scheduling; timing a few shapes (``SkinnyMma.choices``) and
cuBLAS is cheaper and right on any card.

Each is timed as it runs in a decode graph: ``CALLS`` launches captured in one CUDA graph, cycling
through enough copies of the weight to overflow L2 (a step streams its weights from HBM), the
replays back to back, the best of ``TRIALS`` runs. The skinny GEMM must win by ``MARGIN`` to be
chosen: in a whole 8B step at 64 rows it lost more than its isolated timings said (12.1 against
11.6 ms, the isolated projections 5 us a layer slower), so a tie goes to the library."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from xhal import env
from xhal.solutions.tuning_cache import TuningCache

logger = logging.getLogger(__name__)

# the row counts worth a timing: the default decode graph buckets up to 64 (ExecutorConfig's
# 1, 2, 4, 8, then steps of 16). A graph's warm-up is the only eager call whose choice a step
# keeps (eager calls after it run cuBLAS), so other row counts, an eager prefill of 5 or 23
# tokens or a custom bucket, take cuBLAS untimed rather than stall a request on first sight.
TIMED_ROWS = (2, 4, 8, 16, 32, 48, 64)
CALLS = 20
TRIALS = 3
MARGIN = 0.02
_MAX_COPY_BYTES = 512 << 20  # weight copies a timing may allocate beyond the weight itself
# under the key of the solution whose calls make the choice (Solution.times_itself)
SOLUTION_KEY = "linear=triton/skinny-mma-or-cublas"
CUBLAS = "cublas"

# (call(weight) -> out, weight) -> seconds a call; the CUDA one below, a fake in tests
Timer = Callable[[Callable[[torch.Tensor], object], torch.Tensor], float]


@functools.cache
def _source_digest() -> str:
    source = Path(__file__).parent / "kernels" / "skinny_mma.cu"
    return hashlib.sha256(source.read_bytes()).hexdigest()[:8]


def bucket(m: int, n: int, k: int, dtype: torch.dtype) -> str:
    """The cache's name of one choice: the shape, the dtype and the kernel's source (a changed
    kernel is timed afresh; a changed planner is, where its shapes are not the cached winner)."""
    dt = str(dtype).removeprefix("torch.")
    return f"m{m}-n{n}-k{k}-{dt}-src{_source_digest()}"


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
    """``choose``: the winner for one shape, from memory, the disk cache, or timing."""

    def __init__(self, cache: TuningCache, timer: Timer = cycled_graph_seconds) -> None:
        self.cache, self._timer = cache, timer
        self.chosen: dict[str, str] = {}  # bucket -> a launch shape's label, or CUBLAS

    def choose(
        self,
        name: str,
        shapes: dict[str, Callable[[torch.Tensor], object]],
        cublas: Callable[[torch.Tensor], object],
        weight: torch.Tensor,
    ) -> str:
        """Which of the skinny GEMM's launch ``shapes`` (label -> call) or ``CUBLAS`` runs the
        bucket ``name``: the fastest shape where it beats cuBLAS by ``MARGIN``, else cuBLAS.
        Timing (the first sight on this machine, ``XHAL_AUTOTUNE`` on) runs them all; with it
        off an unknown bucket takes cuBLAS. A failure of the skinny GEMM propagates (the caller
        turns the shape off); running out of memory for the weight copies takes cuBLAS for this
        process."""
        if name in self.chosen:
            return self.chosen[name]
        winner = self.cache.get(SOLUTION_KEY, name)
        if winner != CUBLAS and winner not in shapes:  # unknown, or a shape the plan left
            if not env.autotune():
                return CUBLAS
            try:
                times = {label: self._timer(call, weight) for label, call in shapes.items()}
                times[CUBLAS] = self._timer(cublas, weight)
            except torch.OutOfMemoryError as e:
                logger.warning("cuda: skinny GEMM untimed for %s (%s): cuBLAS", name, e)
                self.chosen[name] = CUBLAS
                return CUBLAS
            best = min((label for label in times if label != CUBLAS), key=times.__getitem__)
            winner = best if times[best] < (1 - MARGIN) * times[CUBLAS] else CUBLAS
            logger.info(
                "cuda: %s -> %s (%s)",
                name, winner, ", ".join(f"{label} {t * 1e6:.1f} us" for label, t in times.items()),
            )  # fmt: skip
            try:
                self.cache.put(SOLUTION_KEY, name, winner)
            except OSError as e:  # a read-only cache directory costs a retiming next start
                logger.warning("cuda: cannot write %s (%s); set XHAL_CACHE_DIR", self.cache.path, e)
        self.chosen[name] = winner
        return winner
