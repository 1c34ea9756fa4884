"""Paged KV-cache writers, in vllm-ascend's order of preference; the rules quoted are from the
ops' official documentation (docs/npu-ops.md).

Each writes k, v ``[T, Hkv, D]`` into caches ``[num_blocks, block_size, Hkv, D]`` (the HND
writer: ``[num_blocks, Hkv, block_size, D]``) at
``slot_mapping`` (int32 ``[T]``), leaving rows with slot -1 unwritten, with device ops only
(graph-safe). Neither documented op skips -1: ``npu_scatter_pa_kv_cache`` takes slots in
"[0, num_blocks*block_size-1]" and ``npu_scatter_nd_update_`` "不支持越界" (no out-of-range index).
So a -1 row is redirected to repeat the first real row's write (same slot, same values: a repeat
whose every write is equal leaves one defined result); with no real row, slot 0 is rewritten with
what it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from xhal.interfaces.cache import LayerCache

KvWriter = Callable[[ModuleType, torch.Tensor, torch.Tensor, LayerCache, torch.Tensor], None]


def _redirect_padding(
    slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, k, v) with every -1 row replaced by a repeat of a real write, device ops only."""
    num_tokens = slots.shape[0]
    valid = slots >= 0
    any_valid = valid.any()
    first = valid.to(torch.int32).argmax()  # the first real row (0 when there is none)
    rows = torch.where(valid, torch.arange(num_tokens, device=slots.device), first)
    new_slots = torch.where(any_valid, slots.index_select(0, rows), 0).to(slots.dtype)
    out = []
    for new, cache_tensor in ((k, cache.key), (v, cache.value)):
        picked = new.index_select(0, rows)  # [T, Hkv, D]
        slot0 = cache_tensor[0, 0].unsqueeze(0).expand_as(picked)  # what slot 0 holds
        out.append(torch.where(any_valid, picked, slot0).contiguous())
    return new_slots.contiguous(), out[0], out[1]


def scatter_pa(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    # cache_mode "Norm" is the ND cache ('当传None或'Norm'时，仅支持ND内存排布格式'); the default
    # "PA_NZ" takes NZ. The doc: '输入参数不支持非连续'
    slots, k, v = _redirect_padding(slots, k, v, cache)
    npu.npu_scatter_pa_kv_cache(k, v, cache.key, cache.value, slots, cache_mode="Norm")


def reshape_and_cache(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    # ATB (needs NNAL's libatb.so); the wheel documents it nowhere, so padding is redirected here
    # too rather than trusting ATB to skip negative slots
    slots, k, v = _redirect_padding(slots, k, v, cache)
    npu._npu_reshape_and_cache(k, v, cache.key, cache.value, slots)


def scatter_nd(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    """The portable fallback: ``npu_scatter_nd_update_`` on the cache flattened to one row per
    slot, as vllm-ascend's ``sfa_v1.py`` does."""
    slots, k, v = _redirect_padding(slots, k, v, cache)
    index = slots.long().view(-1, 1)  # [T, 1]
    for new, cache_tensor in ((k, cache.key), (v, cache.value)):
        flat = cache_tensor.view(-1, new.shape[-2] * new.shape[-1])  # [num_slots, Hkv*D]
        npu.npu_scatter_nd_update_(flat, index, new.reshape(new.shape[0], -1))


def scatter_nd_hnd(
    npu: ModuleType, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor
) -> None:
    """The writer of the HND cache ``[num_blocks, num_kv_heads, block_size, head_dim]`` (FIA's
    ``(blocknum, KV_N, blocksize, D)``), which ``npu_scatter_pa_kv_cache`` has no scenario for
    (its ND scenario is ``[num_blocks, block_size, num_head, head_size]``): one
    ``npu_scatter_nd_update_`` per tensor at index triples ``(block, head, offset)``."""
    slots, k, v = _redirect_padding_hnd(slots, k, v, cache)
    num_tokens, num_kv_heads = k.shape[0], k.shape[1]
    block_size = cache.key.shape[2]
    heads = torch.arange(num_kv_heads, device=slots.device).view(1, -1)  # [1, Hkv]
    s = slots.long().view(-1, 1)  # [T, 1]
    index = torch.stack(
        [(s // block_size).expand(-1, num_kv_heads), heads.expand(num_tokens, -1),
         (s % block_size).expand(-1, num_kv_heads)], dim=-1
    )  # [T, Hkv, 3]
    for new, cache_tensor in ((k, cache.key), (v, cache.value)):
        npu.npu_scatter_nd_update_(cache_tensor, index, new)


def _redirect_padding_hnd(
    slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # what slot 0 holds, in HND: cache[0, :, 0] is [Hkv, D]
    hnd = LayerCache(cache.key.transpose(1, 2), cache.value.transpose(1, 2))  # a view as NHD
    return _redirect_padding(slots, k, v, hnd)


KV_WRITERS: dict[str, KvWriter] = {
    "scatter_pa": scatter_pa,
    "reshape_and_cache": reshape_and_cache,
    "scatter_nd": scatter_nd,
    "scatter_nd_hnd": scatter_nd_hnd,
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
