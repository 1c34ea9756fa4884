"""cpu-fast's native kernels (``decode_kernels.c``, ``small_gemm.c``, ``prefill_attention.c``,
the ``vec16.h`` they share):
built once with the C compiler into the cache directory, keyed by the sources, the flags and this
CPU's features, then loaded by ctypes.
Without a compiler (or when ``XHAL_CPU_NATIVE=0``) ``library()`` is None, one log line says why,
and cpu-fast runs its torch path: same results to float32 rounding, more torch calls per layer.

A ctypes call costs about half a microsecond plus a fifth per tensor pointer, against several
microseconds for each torch call it replaces."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from xhal import env

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("decode_kernels.c", "small_gemm.c", "prefill_attention.c")
)
HEADERS = (Path(__file__).with_name("vec16.h"),)  # included by the sources: part of a build's key
# -fopenmp: the source's `omp simd` reductions and the decode attention's threads; the library
# links libgomp.so.1, which resolves to the copy torch has loaded (its pool, its thread count)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "xhal_add_rms_norm": (None, (_P, _P, _P, _F, _I, _I, _P, _P)),
    "xhal_argmax_rows": (None, (_P, _I, _I, _I, _P)),
    "xhal_decode_attention": (
        ctypes.c_int,
        (_P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P, _P, _I,
         _I, _F, _F, _P),
    ),  # fmt: skip
    "xhal_prefill_attention": (
        ctypes.c_int, (_P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P)
    ),
    "xhal_rotary_write": (
        None, (_P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P)
    ),
    "xhal_small_gemm": (None, (_P, _I, _I, _I, _P, _I, _P, _P, _I)),
}

_loaded: ctypes.CDLL | None = None
_tried = False
_suspended = 0  # > 0 inside ``torch_path()``


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` builds for them; a cache dir shared with
    another CPU must not hand it this build)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_key() -> str:
    """What names a build: its sources, flags and this CPU's features (16 hex digits)."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + repr(FLAGS).encode() + _cpu_features().encode()).hexdigest()
    return key[:16]


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        os.replace(out, target)  # atomic: a concurrent process sees the whole file or none


def _load() -> ctypes.CDLL | None:
    if not env.cpu_native():
        logger.info("cpu-fast: native kernels off (XHAL_CPU_NATIVE=0); using the torch path")
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("cpu-fast: no C compiler (gcc or cc) on PATH; using the torch path")
        return None
    target = Path(env.cache_dir()) / "cpu_fast" / f"decode_kernels-{build_key()}.so"
    try:
        if not target.is_file():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("cpu-fast: native kernels did not build (%s); using the torch path", detail)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None when they cannot be had (logged once) or
    inside ``torch_path()``."""
    global _loaded, _tried
    if not _tried:
        _tried = True
        _loaded = _load()
    return None if _suspended else _loaded


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """cpu-fast's torch path inside the block, as without a compiler: for benchmarks and tests
    that compare the two in one process."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1
