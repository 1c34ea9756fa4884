"""Paged KV-cache writers, in vllm-ascend's order of preference (npu.md sections 1.2 and 1.5).

Each writes k, v ``[T, Hkv, D]`` into caches ``[num_blocks, block_size, Hkv, D]`` at
``slot_mapping`` (int32 ``[T]``), leaving rows with slot -1 unwritten, with device ops only
(graph-safe).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from xhal.interfaces.cache import LayerCache

KvWriter = Callable[[ModuleType, torch.Tensor, torch.Tensor, LayerCache, torch.Tensor], None]


def scatter_pa(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    # "Norm" is the ND cache; the default "PA_NZ" expects NZ. Contiguous inputs, as vllm-ascend
    # passes them; -1 slots are skipped (section 1.1, PR #11713)
    npu.npu_scatter_pa_kv_cache(
        k.contiguous(), v.contiguous(), cache.key, cache.value, slots, cache_mode="Norm"
    )


def reshape_and_cache(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    # ATB (needs NNAL's libatb.so); negative slots are skipped (section 1.2)
    npu._npu_reshape_and_cache(k.contiguous(), v.contiguous(), cache.key, cache.value, slots)


def scatter_nd(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    """The portable fallback: ``npu_scatter_nd_update_`` on the cache flattened to one row per slot
    (section 1.2, ``sfa_v1.py``). A general scatter skips nothing, so a -1 row is redirected to
    repeat the first real row's write (same slot, same value); with no real row, slot 0 is
    rewritten with what it holds."""
    num_tokens = slots.shape[0]
    valid = slots >= 0
    any_valid = valid.any()
    first = valid.to(torch.int32).argmax()  # the first real row (0 when there is none)
    rows = torch.where(valid, torch.arange(num_tokens, device=slots.device), first)
    index = torch.where(any_valid, slots.index_select(0, rows), 0).long().view(-1, 1)  # [T, 1]
    for new, cache_tensor in ((k, cache.key), (v, cache.value)):
        flat = cache_tensor.view(-1, new.shape[-2] * new.shape[-1])  # [num_slots, Hkv*D]
        updates = new.reshape(num_tokens, -1).index_select(0, rows)
        updates = torch.where(any_valid, updates, flat[:1].expand_as(updates))
        npu.npu_scatter_nd_update_(flat, index, updates)


KV_WRITERS: dict[str, KvWriter] = {
    "scatter_pa": scatter_pa,
    "reshape_and_cache": reshape_and_cache,
    "scatter_nd": scatter_nd,
}
_OPS = {
    "scatter_pa": "npu_scatter_pa_kv_cache",
    "reshape_and_cache": "_npu_reshape_and_cache",
    "scatter_nd": "npu_scatter_nd_update_",
}


def pick_kv_writer(npu: ModuleType) -> str:
    """The first writer whose op this torch_npu has (older releases lack the newer ops)."""
    for name, op in _OPS.items():
        if getattr(npu, op, None) is not None:
            return name
    raise RuntimeError(
        "this torch_npu has none of npu_scatter_pa_kv_cache, _npu_reshape_and_cache, "
        "npu_scatter_nd_update_: upgrade torch-npu (docs/npu.md)"
    )
