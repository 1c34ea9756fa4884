"""Packed copies of a model's float32 matrices, multiplied by the native ``xhal_small_gemm``
(``kernels/small_gemm.c``) for every product of two rows or more. At decode batches MKL's GEMM
and oneDNN's are compute-bound well before the memory is (one thread, CPU time, SmolLM2-135M's
shapes at 8 rows: gate / up 1.27 ms MKL, 0.85 oneDNN on its packed copy, 0.59 ours; the LM head
17.0 / 12.0 / 9.7, where one row's GEMV reads it in 6.2); at a prefill's rows MKL's float32 GEMM
reaches about 60-80 GF/s per core on this CPU (AMD EPYC, Zen 4) where the kernel's register
tiles reach about 90 (SmolLM2's four products at 1,300 rows, one thread: 141 ms MKL, 98 ours),
so every matrix gets a copy in the kernel's tiles; one row keeps MKL's GEMV on the column-major
matrix, the fastest there. Costs the packed matrices' bytes once more. Without the native
kernels (no compiler, ``XHAL_CPU_NATIVE=0``) nothing is packed and MKL serves every product.

Which of the two is faster depends on the CPU: on an Intel Sapphire Rapids (AVX-512, 2 threads)
MKL wins a 1,300-row prefill's products by 9-26% and the small qkv / o products of decode
batches by up to 40%, while the packed copy keeps gate / up, down and the LM head at decode
batches. So the first product of each (rows rounded up to a power of two, N, K, threads) is
timed both ways on its own operands and the faster one serves that bucket from then on, kept on
disk per CPU (``xhal.solutions.tuning_cache``, the autotuning cache; ``XHAL_AUTOTUNE=0``: no
timing, a cached choice or else the packed copy). ``forced()`` and ``disabled()`` pin either."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from xhal import env
from xhal.platforms.cpu_fast.kernels.native import build_key, library

logger = logging.getLogger(__name__)

MIN_ROWS = 2  # rows from which a packed copy serves (one row: MKL's GEMV)
TILE = 32  # output columns per tile of the packed layout (small_gemm.c's TILE)
MIN_ELEMENTS = 1 << 16  # smaller matrices are not packed: their product is all call overhead
# MKL takes a bucket from the packed copy only when it is this much faster (timing noise must
# not flip a tie), each side the quickest of this many rounds of at least this long
MARGIN, ROUNDS, ROUND_SECONDS = 0.97, 5, 1e-3
CHOICE_KEY = "cpu-fast/linear"  # the autotuning cache's entry for these choices

_serving = True  # False inside ``disabled()``
_forced = False  # True inside ``forced()``


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


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Inside the block a packed copy serves every product it can, whatever was measured: for
    tests and benchmarks of the kernel itself."""
    global _forced
    saved, _forced = _forced, True
    try:
        yield
    finally:
        _forced = saved


def bucket(rows: int, width: int, depth: int) -> tuple[int, int, int, int]:
    """The bucket a product's choice is made for: rows rounded up to a power of two, the
    weight's shape, torch's thread count (MKL and the kernel scale differently with it)."""
    return 1 << (rows - 1).bit_length(), width, depth, torch.get_num_threads()


def bucket_name(key: tuple[int, int, int, int]) -> str:
    """A bucket as the autotuning cache names it: ``m<rows>-n<N>-k<K>-t<threads>``."""
    return "m{}-n{}-k{}-t{}".format(*key)


def quickest(*fns: Callable[[], object]) -> list[float]:
    """Seconds per call of each of ``fns``: the quickest of ``ROUNDS`` rounds of at least
    ``ROUND_SECONDS`` each, after one untimed call; the rounds of the callables take turns, so a
    change in the machine's load hits each alike."""
    reps = []
    for fn in fns:
        start = time.perf_counter()
        fn()
        reps.append(max(1, int(ROUND_SECONDS / max(time.perf_counter() - start, 1e-7))))
    best = [float("inf")] * len(fns)
    for _ in range(ROUNDS):
        for i, (fn, n) in enumerate(zip(fns, reps)):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / n)
    return best


def _tuning_cache():
    """This CPU's autotuning cache: its model name, torch's version and the native build (its
    sources, flags and the CPU's features) name it."""
    from xhal.solutions.solution import DeviceInfo
    from xhal.solutions.tuning_cache import TuningCache

    name = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("model name")), "")
        name = line.partition(":")[2].strip() or name
    except OSError:
        pass
    versions = (("torch", torch.__version__), ("xhal-cpu-native", build_key()))
    return TuningCache(DeviceInfo("cpu", name=name, library_versions=versions))


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

    def __init__(self, measure: Callable[..., list[float]] = quickest) -> None:
        self._packed: dict[int, tuple[weakref.ref, torch.Tensor, int, int]] = {}
        self.measure = measure  # seconds per call of each callable (a test's clock replaces it)
        self.choices: dict[tuple, bool] = {}  # bucket -> whether the packed copy serves it
        self._cache = None  # the autotuning cache, opened on the first choice

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

        def product() -> torch.Tensor:
            rows, depth = x.shape
            out = torch.empty(rows, weight.shape[0])
            lib.xhal_small_gemm(
                x.data_ptr(), rows, depth, x.stride(0), packed.data_ptr(), weight.shape[0],
                None if bias is None else bias.data_ptr(), out.data_ptr(), weight.shape[0],
            )  # fmt: skip
            return out

        if not _forced:
            key = bucket(x.shape[0], *weight.shape)
            serves = self.choices.get(key)
            if serves is None:
                serves = self._choose(key, product, lambda: F.linear(x, weight, bias))
            if not serves:
                return None
        return product()

    def _choose(
        self, key: tuple, product: Callable[[], torch.Tensor], mkl: Callable[[], torch.Tensor]
    ) -> bool:
        """Whether the packed copy serves bucket ``key``: as this CPU's cache says, else timed
        against MKL now on the call's own operands (the winner written to the cache), else
        (timing off) the packed copy."""
        if self._cache is None:
            self._cache = _tuning_cache()
        name = bucket_name(key)
        cached = self._cache.get(CHOICE_KEY, name)
        if cached in ("packed", "mkl"):
            serves = cached == "packed"
        elif env.autotune():
            packed_s, mkl_s = self.measure(product, mkl)
            serves = not mkl_s < MARGIN * packed_s
            try:
                self._cache.put(CHOICE_KEY, name, "packed" if serves else "mkl")
            except OSError as e:  # a read-only cache costs a new timing next start, not a step
                logger.warning("cpu-fast: cannot write the tuning cache %s (%s)", e.filename, e)
            logger.info(
                "cpu-fast: %s -> %s (packed %.1f us, MKL %.1f us)",
                name, "packed" if serves else "MKL", packed_s * 1e6, mkl_s * 1e6,
            )  # fmt: skip
        else:
            serves = True
        self.choices[key] = serves
        return serves


PACKED = PackedWeights()  # the copies cpu-fast's prepare_weights made, for FastCpuOps.linear
