"""The fused q/k/v projection, sharded by attention heads."""

from __future__ import annotations

import torch
from torch import nn

from xhal.layers.linear import ColumnParallelLinear
from xhal.layers.parallel import TensorParallel
from xhal.layers.weights import check_shape, copy_shard


class QKVParallelLinear(ColumnParallelLinear):
    """``qkv_proj``: each rank holds ``[its q heads | its k heads | its v heads]``.

    Query heads split evenly over ranks. KV heads split too while there are at least as many as
    ranks; with fewer, each KV head is replicated on ``size / total_num_kv_heads`` consecutive
    ranks (as in vLLM). ``shard_id`` is ``"q"``, ``"k"`` or ``"v"`` (``None``: a fused tensor).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        tp: TensorParallel = TensorParallel(),
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        num_heads = tp.divide(total_num_heads, "num_attention_heads")
        if tp.size >= total_num_kv_heads:
            if tp.size % total_num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp.size} must be a multiple of "
                    f"num_key_value_heads={total_num_kv_heads} to replicate KV heads"
                )
            num_kv_heads, replicas = 1, tp.size // total_num_kv_heads
        else:
            num_kv_heads, replicas = tp.divide(total_num_kv_heads, "num_key_value_heads"), 1
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * total_num_kv_heads) * head_size,
            bias,
            tp=tp,
            output_size_per_partition=(num_heads + 2 * num_kv_heads) * head_size,
        )
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads  # per rank
        self.num_kv_head_replicas = replicas
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size  # per rank

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        hs, tail = self.head_size, tuple(param.shape[1:])
        if shard_id is None:  # a fused checkpoint tensor: load it as q, k, v
            check_shape(loaded_weight, (self.output_size, *tail), "QKVParallelLinear")
            kv = self.total_num_kv_heads * hs
            sizes = [self.total_num_heads * hs, kv, kv]
            for sid, part in zip("qkv", loaded_weight.split(sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            full, n, offset, src_rank = self.total_num_heads * hs, self.q_size, 0, self.tp.rank
        elif shard_id in ("k", "v"):
            full, n = self.total_num_kv_heads * hs, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            src_rank = self.tp.rank // self.num_kv_head_replicas
        else:
            raise ValueError(
                f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}"
            )
        check_shape(loaded_weight, (full, *tail), f"QKVParallelLinear[{shard_id}]")
        copy_shard(param, loaded_weight, 0, src_rank * n, n, dst_start=offset)
