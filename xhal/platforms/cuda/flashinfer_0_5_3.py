"""The one private FlashInfer call we make, bound to FlashInfer 0.5.3: the compiled decode
module's ``plan`` (the scheduler) with the positional arguments the 0.5.3 decode wrapper's
``plan`` passes when ``use_cuda_graph=True``. Calling it directly skips the wrapper's Python,
which re-derives on every call what is fixed for a captured bucket.

Any other FlashInfer version takes the public ``wrapper.plan`` instead (``VERSIONS``); when a
release changes this layout, write a sibling module for it rather than editing this one."""

from __future__ import annotations

import torch

from xhal.interfaces.attention import AttentionSpec

VERSIONS = ("0.5.3",)  # FlashInfer versions whose wrapper internals this module was checked against


def binds(flashinfer_module: object) -> bool:
    """Whether the installed FlashInfer is one this module's private call was checked against."""
    return getattr(flashinfer_module, "__version__", "") in VERSIONS


def schedule_decode(
    wrapper: object,
    qo_indptr_host: torch.Tensor,
    indptr: torch.Tensor,
    kv_seq_lens_host: torch.Tensor,
    batch: int,
    spec: AttentionSpec,
    window_left: int,
    logits_soft_cap: float | None,
    dtype_tag: torch.Tensor,
) -> None:
    """Rerun the scheduler of a ``use_cuda_graph=True`` decode wrapper for new page counts; the
    captured kernels read its output from the wrapper's int workspace."""
    w = wrapper
    buffers = (
        w._float_workspace_buffer,
        w._int_workspace_buffer,
        w._pin_memory_int_workspace_buffer,
    )
    if w.use_tensor_cores:  # the FA2 prefill module's plan
        w._plan_info = w._cached_module.plan(
            *buffers, qo_indptr_host, indptr, kv_seq_lens_host, batch, batch,
            spec.num_heads, spec.num_kv_heads, spec.block_size, True, spec.head_dim, spec.head_dim,
            False, window_left, -1, False, 0,
        )  # fmt: skip
    else:  # the CUDA-core decode module's plan, which reads the dtypes off two tensors
        w._plan_info = w._cached_module.plan(
            *buffers, indptr, batch, spec.num_heads, spec.num_kv_heads, spec.block_size, True,
            window_left, logits_soft_cap or 0.0, spec.head_dim, spec.head_dim, dtype_tag, dtype_tag,
        )  # fmt: skip
