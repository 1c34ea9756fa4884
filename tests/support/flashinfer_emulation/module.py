"""The emulated ``flashinfer`` module: the two wrappers ``xhal.platforms.cuda.attention`` uses, with
FlashInfer 0.5.3's signatures, on CPU tensors. See the package docstring."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xhal.platforms.cpu_ref.kernels.paged_attention import attend

from .compiled import check, compiled_module, schedule_view

__version__ = "0.5.3"

_INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # 0.5.3's int and pinned int workspaces
_DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    return _DTYPES[dtype] if isinstance(dtype, str) else dtype


def _kv_pair(paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, torch.Tensor):  # [pages, 2, page_size, Hkv, D]
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    k, v = paged_kv_cache
    return k, v


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: Sequence | None = None,
    ) -> None:
        check(kv_layout == "NHD", "the emulation implements the NHD layout only")
        check(
            backend in ("auto", "fa2") and jit_args is None, f"no {backend!r} backend or JIT args"
        )
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.zeros(
            _INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device
        )
        self._pin_memory_int_workspace_buffer = torch.zeros(_INT_WORKSPACE_BYTES, dtype=torch.uint8)
        self._use_tensor_cores, self._use_cuda_graph = use_tensor_cores, use_cuda_graph
        buffers = {
            "indptr": paged_kv_indptr_buffer,
            "indices": paged_kv_indices_buffer,
            "last_page_len": paged_kv_last_page_len_buffer,
        }
        if use_cuda_graph:
            for name, t in buffers.items():
                if not torch.is_tensor(t):
                    raise ValueError(
                        f"paged_kv_{name}_buffer should be a torch.Tensor in cudagraph mode"
                    )
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._cached_module = None
        self._plan_info: list[int] | None = None

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
        check(pos_encoding_mode == "NONE", "the emulation implements pos_encoding_mode NONE only")
        batch = len(last_page_len)
        soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        if self._use_cuda_graph:  # 0.5.3 copies into the caller's buffers
            if batch != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode: {batch} vs "
                    f"{self._fixed_batch_size}"
                )
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError(
                    "The size of indices should be less than or equal to the allocated buffer"
                )
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.to(self.device)
            self._paged_kv_indices_buf = indices.to(self.device)
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device)
        if data_type is not None:
            q_data_type, kv_data_type = q_data_type or data_type, kv_data_type or data_type
        self._q_dtype = _dtype(q_data_type)
        self._kv_dtype = _dtype(kv_data_type) or self._q_dtype
        key = (self._q_dtype, self._kv_dtype, head_dim, window_left != -1, soft_cap > 0)
        self._cached_module = compiled_module(self._use_tensor_cores, *key)
        workspaces = (
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer,
        )
        indptr_host, last_host = indptr.to("cpu"), last_page_len.to("cpu")
        heads = (num_qo_heads, num_kv_heads, page_size, self._use_cuda_graph)
        if self._use_tensor_cores:
            kv_lens = (indptr_host.diff() - 1).clamp(min=0) * page_size + last_host
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
            split = -1 if fixed_split_size is None else fixed_split_size
            self._plan_info = self._cached_module.plan(
                *workspaces, qo_indptr, indptr_host, kv_lens.int(), batch, batch, *heads,
                head_dim, head_dim, False, window_left, split, disable_split_kv, 0,
            )  # fmt: skip
        else:
            tags = (torch.empty(0, dtype=self._q_dtype), torch.empty(0, dtype=self._kv_dtype))
            self._plan_info = self._cached_module.plan(
                *workspaces,
                indptr_host,
                batch,
                *heads,
                window_left,
                soft_cap,
                head_dim,
                head_dim,
                *tags,
            )
        self._window_left, self._soft_cap, self._sm_scale = window_left, soft_cap, sm_scale

    def run(
        self, q: torch.Tensor, paged_kv_cache, *args, out: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        check(not args and not kwargs, "the emulation's run takes q, the cache and out only")
        check(self._plan_info is not None, "run before plan")
        batch, page_size, num_qo_heads, num_kv_heads = self._plan_info
        head_dim = self._cached_module.head_dim
        k_cache, v_cache = _kv_pair(paged_kv_cache)
        if (q.dtype, k_cache.dtype) != (self._q_dtype, self._kv_dtype):
            raise ValueError(
                f"q / kv dtypes {q.dtype} / {k_cache.dtype}: planned {self._q_dtype} / "
                f"{self._kv_dtype}"
            )
        check(
            tuple(q.shape) == (batch, num_qo_heads, head_dim),
            f"q is {tuple(q.shape)}: not the planned shape",
        )
        check(
            tuple(k_cache.shape[1:]) == (page_size, num_kv_heads, head_dim),
            "the cache's pages: not as planned",
        )
        out = torch.empty_like(q) if out is None else out
        scale = self._sm_scale if self._sm_scale is not None else head_dim**-0.5
        torch.ops.xhal_fi_emu.paged_decode(
            schedule_view(self._int_workspace_buffer, batch), q, k_cache, v_cache,
            self._paged_kv_indptr_buf,
            self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, out, self._window_left,
            self._soft_cap, float(scale),
        )  # fmt: skip
        return out


class BatchPrefillWithPagedKVCacheWrapper:
    """Eager only: ``run`` reads the page table that ``plan`` kept on the host."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        backend: str = "auto",
    ) -> None:
        check(kv_layout == "NHD", "the emulation implements the NHD layout only")
        check(not use_cuda_graph, "the emulation's prefill runs eagerly")
        check(backend in ("auto", "fa2", "fa3"), f"unknown prefill backend {backend!r}")
        self._plan: dict | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
    ) -> None:
        tables = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        check(all(t.dtype == torch.int32 for t in tables), "the page table must be int32")
        check(causal, "the emulation implements causal prefill only (all xhal asks for)")
        check(
            pos_encoding_mode == "NONE" and head_dim_vo in (None, head_dim_qk),
            "plain attention only",
        )
        q_dtype = _dtype(q_data_type)
        self._plan = {
            "qo": qo_indptr.tolist(),
            "indptr": paged_kv_indptr.tolist(),
            "indices": paged_kv_indices.clone(),
            "last": paged_kv_last_page_len.tolist(),
            "shape": (num_qo_heads, head_dim_qk),
            "page_size": page_size,
            "scale": sm_scale if sm_scale is not None else head_dim_qk**-0.5,
            "window": window_left + 1,
            "soft_cap": logits_soft_cap or 0.0,
            "dtypes": (q_dtype, _dtype(kv_data_type) or q_dtype),
        }

    def run(
        self, q: torch.Tensor, paged_kv_cache, *args, out: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        check(not args and not kwargs, "the emulation's run takes q, the cache and out only")
        p = self._plan
        check(p is not None, "run before plan")
        k_cache, v_cache = _kv_pair(paged_kv_cache)
        if (q.dtype, k_cache.dtype) != p["dtypes"]:
            raise ValueError(f"q / kv dtypes {q.dtype} / {k_cache.dtype}: planned {p['dtypes']}")
        check(
            q.shape[0] == p["qo"][-1] and tuple(q.shape[1:]) == p["shape"],
            "q's shape: not as planned",
        )
        check(k_cache.shape[1] == p["page_size"], "page size: not as planned")
        out = torch.empty_like(q) if out is None else out
        for i in range(len(p["qo"]) - 1):
            start, end = p["qo"][i], p["qo"][i + 1]
            pages = p["indices"][p["indptr"][i] : p["indptr"][i + 1]].long()
            kv_len = (len(pages) - 1) * p["page_size"] + p["last"][i]
            keys, values = (
                k_cache[pages].flatten(0, 1)[:kv_len],
                v_cache[pages].flatten(0, 1)[:kv_len],
            )
            if end > start:
                rows = attend(q[start:end], keys, values, p["scale"], p["window"], p["soft_cap"])
                out[start:end] = rows.to(q.dtype)
        return out
