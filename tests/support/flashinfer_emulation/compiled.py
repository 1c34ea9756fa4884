"""The emulated compiled side of FlashInfer 0.5.3: the decode kernel (a custom op) and the JIT
modules' ``plan``, which checks each argument of 0.5.3's positional layout and writes the
schedule into the int workspace."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from xhal.platforms.cpu_ref.kernels.paged_attention import attend

# The positional arguments of each module's plan in 0.5.3, as decode.py passes them
# (csrc/batch_prefill.cu BatchPrefillWithKVCachePlan, csrc/batch_decode.cu
# BatchDecodeWithPagedKVCachePlan).
TENSOR_CORE_PLAN = (
    "float_ws", "int_ws", "pinned_ws", "qo_indptr", "indptr", "kv_lens", "total_num_rows", "batch",
    "num_qo_heads", "num_kv_heads", "page_size", "cuda_graph", "head_dim_qk", "head_dim_vo",
    "causal", "window_left", "fixed_split_size", "disable_split_kv", "num_colocated_ctas",
)  # fmt: skip
CUDA_CORE_PLAN = (
    "float_ws", "int_ws", "pinned_ws", "indptr", "batch", "num_qo_heads", "num_kv_heads",
    "page_size", "cuda_graph", "window_left", "logits_soft_cap", "head_dim_qk", "head_dim_vo",
    "q_dtype_tag", "kv_dtype_tag",
)  # fmt: skip


def _registered() -> bool:
    """Whether another copy of this module (imported under another name) registered the op."""
    try:
        return hasattr(torch.ops.xhal_fi_emu, "paged_decode")
    except RuntimeError:
        return False


_lib: torch.library.Library | None = None
if not _registered():
    _lib = torch.library.Library("xhal_fi_emu", "DEF")
    _lib.define(
        "paged_decode(Tensor schedule, Tensor q, Tensor k_cache, Tensor v_cache, Tensor indptr, "
        "Tensor indices, Tensor last_page_len, Tensor(a!) out, int window_left, float soft_cap, "
        "float sm_scale) -> ()"
    )

    @torch.library.impl(_lib, "paged_decode", "CPU")
    def _paged_decode(
        schedule, q, k_cache, v_cache, indptr, indices, last_page_len, out, window_left, soft_cap,
        sm_scale,
    ):  # fmt: skip
        """One query token per sequence. A sequence's page count comes from the plan's schedule
        (the work split), its first page, page ids and last-page length from the live buffers."""
        page_size = k_cache.shape[1]
        planned, starts, last = schedule.tolist(), indptr.tolist(), last_page_len.tolist()
        for r in range(q.shape[0]):
            count = planned[r + 1] - planned[r]
            if count <= 0:
                out[r] = 0
                continue
            pages = indices[starts[r] : starts[r] + count].long()
            kv_len = (count - 1) * page_size + last[r]
            keys = k_cache[pages].flatten(0, 1)[:kv_len]
            values = v_cache[pages].flatten(0, 1)[:kv_len]
            row = attend(q[r : r + 1], keys, values, sm_scale, window_left + 1, soft_cap)
            out[r] = row[0].to(out.dtype)


def schedule_view(int_workspace: torch.Tensor, batch: int) -> torch.Tensor:
    """Where the emulated scheduler leaves its output: the planned page indptr, ``[batch + 1]``."""
    return int_workspace[: 4 * (batch + 1)].view(torch.int32)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"emulated FlashInfer 0.5.3: {what}")


def _check_host_int32(t: object, size: int, name: str) -> None:
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    check(t.device.type == "cpu" and t.dtype == torch.int32, f"{name} must be a host int32 tensor")
    check(t.numel() == size, f"{name} has {t.numel()} values, expected {size}")


@dataclass(frozen=True)
class CompiledModule:
    """Stands for one JIT module (tensor-core decode: the FA2 batch prefill module; CUDA-core: the
    batch decode module), compiled for dtypes, a head dim, and whether a window / soft cap is on."""

    tensor_cores: bool
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    use_window: bool
    use_soft_cap: bool

    def plan(self, *args: object) -> list[int]:
        layout = TENSOR_CORE_PLAN if self.tensor_cores else CUDA_CORE_PLAN
        name = "FA2 prefill" if self.tensor_cores else "batch decode"
        check(
            len(args) == len(layout),
            f"the {name} module's plan takes {len(layout)} arguments, got {len(args)}",
        )
        a = SimpleNamespace(**dict(zip(layout, args)))
        check(
            isinstance(a.batch, int) and a.batch > 0,
            f"batch_size must be a positive int, got {a.batch!r}",
        )
        _check_host_int32(a.indptr, a.batch + 1, "kv indptr")
        check(
            int(a.indptr[0]) == 0 and bool((a.indptr.diff() >= 0).all()),
            "kv indptr must start at 0, never fall",
        )
        for ws in ("float_ws", "int_ws", "pinned_ws"):
            check(getattr(a, ws).dtype == torch.uint8, f"{ws} must be a uint8 workspace")
        check(a.pinned_ws.device.type == "cpu", "the pinned int workspace must be on the host")
        heads = (a.num_qo_heads, a.num_kv_heads, a.page_size)
        check(all(isinstance(x, int) and x > 0 for x in heads), f"heads and page size: {heads}")
        dims = (a.head_dim_qk, a.head_dim_vo)
        check(
            dims == (self.head_dim, self.head_dim),
            f"head dims {dims}, compiled for {self.head_dim}",
        )
        check(isinstance(a.cuda_graph, bool), "enable_cuda_graph must be a bool")
        check(
            isinstance(a.window_left, int) and (a.window_left != -1) == self.use_window,
            "window_left",
        )
        if self.tensor_cores:
            check(
                a.total_num_rows == a.batch, "tensor-core decode plans total_num_rows == batch_size"
            )
            _check_host_int32(a.qo_indptr, a.batch + 1, "qo_indptr")
            check(
                torch.equal(a.qo_indptr, torch.arange(a.batch + 1, dtype=torch.int32)),
                "qo_indptr: 0..batch",
            )
            _check_host_int32(a.kv_lens, a.batch, "kv_len_arr")
            check(a.causal is False, "decode plans causal=False")
            check(a.fixed_split_size == -1 or a.fixed_split_size > 0, "fixed_split_size: -1 or > 0")
            check(isinstance(a.disable_split_kv, bool), "disable_split_kv must be a bool")
            check(isinstance(a.num_colocated_ctas, int), "num_colocated_ctas must be an int")
        else:
            check(
                isinstance(a.logits_soft_cap, float),
                f"logits_soft_cap must be a float: {a.logits_soft_cap!r}",
            )
            check(
                (a.logits_soft_cap > 0) == self.use_soft_cap,
                "logits_soft_cap vs the compiled module",
            )
            for tag, dtype in (("q_dtype_tag", self.q_dtype), ("kv_dtype_tag", self.kv_dtype)):
                t = getattr(a, tag)
                check(
                    isinstance(t, torch.Tensor) and t.numel() == 0 and t.dtype == dtype,
                    f"{tag}: empty {dtype}",
                )
        # 0.5.3's scheduler reads the page indptr alone (PrefillSplitQOKVIndptr), never kv_lens
        schedule_view(a.int_ws, a.batch).copy_(a.indptr)
        return [a.batch, a.page_size, a.num_qo_heads, a.num_kv_heads]


_modules: dict[tuple, CompiledModule] = {}


def compiled_module(*key) -> CompiledModule:
    """The module for ``CompiledModule(*key)``, built once (as FlashInfer loads a JIT module
    once)."""
    if key not in _modules:
        _modules[key] = CompiledModule(*key)
    return _modules[key]
