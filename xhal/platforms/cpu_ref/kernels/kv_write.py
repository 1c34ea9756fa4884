"""Reference paged KV write, as a custom op so that a captured "graph" records it as one device
call that reads ``slot_mapping`` when it runs."""

from __future__ import annotations

import torch

# a fragment: paged_attention.py adds its op to the same namespace
_lib = torch.library.Library("xhal_cpu_ref", "FRAGMENT")
_lib.define(
    "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> "
    "()"
)


@torch.library.impl(_lib, "write_kv", "CPU")
def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    # k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding token: never written
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]
