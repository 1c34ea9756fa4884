"""CUDA C kernels of the CUDA platform, built on the machine that runs them and launched through
the driver API, for what Triton cannot express (TMA bulk copies into a ring of shared-memory
stages, a grid-wide barrier in a persistent launch).

A source (``kernels/*.cu``; it includes no system header, only ours beside it) is compiled with
its ``-D`` shape options into a cubin for this GPU's architecture by NVRTC (the library torch's
CUDA wheels bring), or by ``nvcc`` when no NVRTC is found; the cubin is cached under
``XHAL_CACHE_DIR/cuda_native``, keyed by the source, its headers, the options and the compiler,
so later starts load it without compiling. Launches go through ``cuLaunchKernelEx`` on torch's
current stream, so a CUDA graph being captured records them like any kernel, with the
programmatic-dependent-launch attribute when asked (``xhal/platforms/cuda/pdl.py`` has the rule
such a kernel follows).

``compiler()`` is None, with the reason in ``unavailable()``, where neither compiler is found;
callers then keep their Triton path (one log line)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from xhal import env

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1  # the copies move bits: fp16 and bf16 alike
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [
        ctypes.POINTER(_LaunchConfig),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


def _nvrtc_candidates() -> list[str]:
    found = []
    try:  # torch's own lookup of the NVRTC its CUDA wheel depends on (a private helper)
        from torch.cuda import _utils

        found.append(_utils._get_nvrtc_library()._name)
    except Exception:  # noqa: BLE001 - any failure just means: look elsewhere
        pass
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "*", "lib", "libnvrtc.so*")))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    if name := ctypes.util.find_library("nvrtc"):
        found.append(name)
    return [f for f in found if "builtins" not in os.path.basename(f)]


@functools.cache
def _nvrtc() -> ctypes.CDLL | None:
    for path in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.nvrtcGetCUBIN  # noqa: B018 - CUBIN output needs NVRTC 11.1+
        except (OSError, AttributeError):
            continue
        return lib
    return None


@functools.cache
def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (candidate if os.access(candidate, os.X_OK) else None)


def compiler() -> str | None:
    """``"nvrtc"``, ``"nvcc"`` or None (nothing to build kernels with)."""
    if _nvrtc() is not None:
        return "nvrtc"
    return "nvcc" if _nvcc() is not None else None


def unavailable() -> str | None:
    """Why no native kernel can be built here, or None."""
    if compiler() is None:
        return (
            "neither NVRTC (torch's CUDA wheels bring libnvrtc) nor nvcc was found; "
            "install the CUDA toolkit or set CUDA_HOME"
        )
    return None


def _options(arch: str, defines: dict[str, int], include: Path) -> list[str]:
    return [
        f"-arch={arch}", "-std=c++17", f"-I{include}",
        *(f"-D{k}={v}" for k, v in sorted(defines.items())),
    ]  # fmt: skip


def _compile_nvrtc(source: str, name: str, options: list[str]) -> bytes:
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    res = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if res != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({res})")
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        res = lib.nvrtcCompileProgram(prog, len(options), opts)
        if res != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        image = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, image)
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _compile_nvcc(source: Path, options: list[str]) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernel.cubin"
        subprocess.run(
            [_nvcc(), "-cubin", *options, "-o", str(out), str(source)],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return out.read_bytes()


def cubin(source: Path, arch: str, defines: dict[str, int]) -> bytes:
    """The cubin of ``source`` for ``arch`` (``sm_90``) with ``defines``, from the cache or built
    now (the first build of a shape takes a second or two). Headers it includes are looked up
    beside it; every ``*.cuh`` there is part of the cache key."""
    kind = compiler()
    if kind is None:
        raise RuntimeError(unavailable())
    text = source.read_text()
    headers = [p.read_text() for p in sorted(source.parent.glob("*.cuh"))]
    options = _options(arch, defines, source.parent)
    key = hashlib.sha256("\n".join([text, *headers, *options, kind]).encode()).hexdigest()[:24]
    target = Path(env.cache_dir()) / "cuda_native" / f"{source.stem}-{key}.cubin"
    if target.is_file():
        return target.read_bytes()
    if kind == "nvrtc":
        image = _compile_nvrtc(text, source.name, options)
    else:
        image = _compile_nvcc(source, options)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
        f.write(image)
    os.replace(f.name, target)  # atomic: a concurrent process sees the whole file or none
    return image


def launch_config(
    grid: int,
    block: int,
    shared_mem: int,
    stream: int,
    pdl: bool,
    cluster: int = 1,
    *,
    cluster_attribute: bool = False,
) -> _LaunchConfig:
    """The ``CUlaunchConfig`` of a 1-D launch: with the programmatic-dependent-launch attribute
    when ``pdl``, with a cluster of ``cluster`` CTAs along x when above 1 or when
    ``cluster_attribute`` (the occupancy query counts clusters of 1 only with the attribute set:
    without it an H100 answered 0). The attributes' array is kept on the config."""
    attrs = (_LaunchAttribute * 2)()
    count = 0
    if pdl:
        attrs[count].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[count].value[0] = 1
        count += 1
    if cluster > 1 or cluster_attribute:
        attrs[count].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[count].value[0], attrs[count].value[1], attrs[count].value[2] = cluster, 1, 1
        count += 1
    config = _LaunchConfig(
        grid=(ctypes.c_uint * 3)(grid, 1, 1),
        block=(ctypes.c_uint * 3)(block, 1, 1),
        shared_mem_bytes=shared_mem,
        stream=ctypes.c_void_p(stream),
        attrs=attrs if count else None,
        num_attrs=count,
    )
    config.attributes = attrs
    return config


class Kernel:
    """One ``extern "C"`` kernel of a loaded cubin on one device."""

    def __init__(self, image: bytes, name: str, device: torch.device, shared_mem: int) -> None:
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # the device's primary context is current
            drv = _driver()
            self._module = ctypes.c_void_p()
            _check(drv.cuModuleLoadData(ctypes.byref(self._module), image), "cuModuleLoadData")
            self._fn = ctypes.c_void_p()
            _check(
                drv.cuModuleGetFunction(ctypes.byref(self._fn), self._module, name.encode()),
                f"cuModuleGetFunction({name})",
            )
            _check(
                drv.cuFuncSetAttribute(
                    self._fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem
                ),
                "cuFuncSetAttribute(max dynamic shared memory)",
            )
        self.device, self.shared_mem = device, shared_mem

    def max_active_clusters(self, cluster: int, block: int) -> int:
        """How many clusters of ``cluster`` CTAs of ``block`` threads (and this kernel's shared
        memory) the device holds at once (``cuOccupancyMaxActiveClusters``)."""
        config = launch_config(
            cluster, block, self.shared_mem, 0, False, cluster, cluster_attribute=True
        )
        count = ctypes.c_int()
        with torch.cuda.device(self.device):
            _check(
                _driver().cuOccupancyMaxActiveClusters(
                    ctypes.byref(count), self._fn, ctypes.byref(config)
                ),
                "cuOccupancyMaxActiveClusters",
            )
        return count.value

    def launch(
        self, grid: int, block: int, args: Sequence[ctypes._CData], pdl: bool, cluster: int = 1
    ) -> None:
        """Launch on torch's current stream; ``args`` are the kernel's parameters as ctypes
        values in order (``c_void_p`` for a pointer, a ``TensorMap`` by value). ``cluster``:
        CTAs a thread-block cluster (along x; ``grid`` a multiple of it)."""
        params = (ctypes.c_void_p * len(args))(
            *(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args)
        )
        stream = torch.cuda.current_stream().cuda_stream
        config = launch_config(grid, block, self.shared_mem, stream, pdl, cluster)
        _check(
            _driver().cuLaunchKernelEx(ctypes.byref(config), self._fn, params, None),
            "cuLaunchKernelEx",
        )


class TensorMap(ctypes.Structure):
    """A TMA tensor map (``CUtensorMap``: 128 opaque bytes on 64), passed to a kernel by value.
    ctypes aligns a structure to 8 bytes at most, so ``tensor_map`` places it in a larger buffer
    the map keeps alive."""

    _fields_ = [("words", ctypes.c_uint64 * 16)]


def tensor_map(t: torch.Tensor, box_rows: int, box_cols: int = 64) -> TensorMap:
    """The tensor map of a 2-D fp16 / bf16 tensor (unit column stride, row stride and start on
    16 bytes) that TMA copies in boxes of ``box_rows`` x ``box_cols`` (``box_cols`` * 2 bytes at
    most 128) into shared memory with the 128-byte swizzle (16-byte chunk c of row r lands at
    chunk c ^ (r % 8) of its 128-byte row, from a 1024-byte aligned tile); rows and columns past
    the tensor's read as zeros."""
    rows, cols = t.shape
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size())
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    buffer = ctypes.create_string_buffer(ctypes.sizeof(TensorMap) + 64)
    out = TensorMap.from_address((ctypes.addressof(buffer) + 63) & ~63)
    out.buffer = buffer
    _check(
        _driver().cuTensorMapEncodeTiled(
            ctypes.byref(out), _CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, ctypes.c_void_p(t.data_ptr()),
            dims, strides, box, unit, 0, _CU_TENSOR_MAP_SWIZZLE_128B,
            _CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 0,
        ),
        "cuTensorMapEncodeTiled",
    )  # fmt: skip
    return out


def takes_rows(x: torch.Tensor, max_rows: int) -> bool:
    """Whether ``x`` is what the native decode kernels read as their input: 1 to ``max_rows``
    fp16 / bf16 rows of a CUDA tensor on sm_90+ (TMA bulk copies, programmatic dependent
    launch)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= max_rows
        and x.dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def chunk_aligned(rows: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> bool:
    """Whether every row of ``rows`` starts on 16 bytes with unit column stride, and every
    tensor starts on 16 bytes: the kernels read 16-byte chunks."""
    if any(t.stride(1) != 1 or t.stride(0) % 8 for t in rows):
        return False
    return not any(t.data_ptr() % 16 for t in (*rows, *others))


def max_shared_mem(device: torch.device) -> int:
    """The dynamic shared memory one CTA may opt into on ``device`` (227 KB on sm_90)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024


_RESERVED_PER_CTA = 1024  # shared memory the hardware keeps per resident CTA (sm_80, sm_90)


def beside_share(max_shared_mem: int) -> int:
    """The shared memory a CTA may take so that a CTA of the next kernel taking as much fits on
    the same SM: half of an SM's (the per-CTA opt-in ``max_shared_mem`` plus the reserve), less
    each CTA's reserve (113 KB on sm_90). The stream kernels take this under
    ``env.cuda_overlap``."""
    return (max_shared_mem + _RESERVED_PER_CTA) // 2 - _RESERVED_PER_CTA


def ring_stages(
    max_shared_mem: int, fixed: int, stage1: int, stage2: int, depth: int, max_stages: int = 8
) -> tuple[int, int, int] | None:
    """How many stages of two phases' widths (bytes) one ring holds beside ``fixed`` bytes and
    the 8-byte mbarriers of ``max_stages`` of each, at most ``max_stages`` each: ``(stages1,
    stages2, shared memory used)``, or None when either would be under ``depth``. The
    persistent kernels' phases take turns in one ring (mlp_block.cu, moe_block.cu)."""
    ring = max_shared_mem - fixed - 8 * 2 * max_stages
    s1, s2 = min(max_stages, ring // stage1), min(max_stages, ring // stage2)
    if s1 < depth or s2 < depth:
        return None
    return s1, s2, fixed + max(s1 * stage1, s2 * stage2) + 8 * (s1 + s2)


class KernelCache:
    """One source's kernel on one device, built once per set of ``-D`` defines (a shape). A
    build cannot happen under CUDA graph capture: callers build a shape with an eager call
    first (their warm-up; ``CudaOps._graph_kernel`` is that rule)."""

    def __init__(self, source: Path, entry: str, device: torch.device, suffix: str = "") -> None:
        """``suffix``: ``"a"`` builds for the architecture-specific target (``sm_90a``: wgmma)."""
        self.source, self.entry, self.device = source, entry, device
        major, minor = torch.cuda.get_device_capability(device)
        self.arch = f"sm_{major}{minor}{suffix}"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_shared_mem = max_shared_mem(device)
        self._kernels: dict[tuple, Kernel] = {}

    def get(self, defines: dict[str, int], shared_mem: int) -> Kernel:
        key = tuple(sorted(defines.items()))
        if key not in self._kernels:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.source.name}: a shape's kernel is built by an eager call before capture"
                )
            image = cubin(self.source, self.arch, defines)
            self._kernels[key] = Kernel(image, self.entry, self.device, shared_mem)
        return self._kernels[key]


@functools.cache
def _cluster_fit(index: int) -> tuple[int, ...]:
    device = torch.device("cuda", index)
    probe = KernelCache(Path(__file__).with_name("kernels") / "probe.cu", "probe", device)
    kernel = probe.get({}, max_shared_mem(device))
    return tuple(kernel.max_active_clusters(size, 128) for size in range(1, 9))


def cluster_fit(device: torch.device) -> tuple[int, ...]:
    """How many thread-block clusters of 1, 2, ..., 8 CTAs ``device`` holds at once when each
    CTA takes a whole SM (entry ``size - 1``). A cluster's CTAs share one GPC, and GPCs differ in
    size (an SXM H100's 132 SMs sit in 8 of them), so this can be below ``SMs // size``; a
    launch of more clusters runs the rest in a second wave. Asked of the driver once a device,
    on a kernel that does nothing with the largest shared memory a CTA may take; sm_90+."""
    device = torch.device(device)
    return _cluster_fit(torch.cuda.current_device() if device.index is None else device.index)
