"""The device-op calls a model's decode and prefill steps make, by shape, read from its
``config.json``: what ``xhal-tune`` runs to warm the autotuning cache ahead of serving."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Workload:
    op: str
    label: str  # "qkv_proj m=16"
    make: Callable[[], tuple]  # the op's positional arguments, on the device


class _Tensors:
    """Random tensors made once per name: a weight serves every batch size."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._made: dict[str, torch.Tensor] = {}
        self._gen = torch.Generator().manual_seed(0)

    def get(self, name: str, *shape: int, scale: float = 1.0) -> torch.Tensor:
        if name not in self._made:
            values = torch.randn(*shape, generator=self._gen) * scale
            self._made[name] = values.to(self.device, self.dtype)
        return self._made[name]


def model_workloads(
    config: dict,
    device: torch.device,
    dtype: torch.dtype,
    batches: Sequence[int],
    tensor_parallel_size: int = 1,
) -> list[Workload]:
    """Per batch size in ``batches`` (the decode graphs' buckets: a projection's call in a
    bucket's graph has that many rows): each projection's linear (column-parallel ones split
    their outputs over the ranks, row-parallel ones their inputs), the norms and the gated
    activation, and the routed experts of a mixture-of-experts model."""
    try:
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or hidden // heads
        inter = config["intermediate_size"]
        vocab = config["vocab_size"]
    except KeyError as e:
        raise ValueError(
            f"config.json lacks {e.args[0]!r}: xhal-tune reads a decoder's shapes from it"
        ) from None
    tp = tensor_parallel_size
    experts = config.get("num_experts") or config.get("num_local_experts")
    moe_inter = config.get("moe_intermediate_size", inter)
    top_k = config.get("num_experts_per_tok", 2)
    t = _Tensors(device, dtype)
    linears = {  # name: (out features, in features) on one rank
        "qkv_proj": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "o_proj": (hidden, heads * head_dim // tp),
        "lm_head": (vocab // tp, hidden),
    }
    if not experts:
        linears |= {"gate_up_proj": (2 * inter // tp, hidden), "down_proj": (hidden, inter // tp)}
    out: list[Workload] = []
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")
    for m in batches:
        for name, (n, k) in linears.items():
            out.append(
                Workload(
                    "linear",
                    f"{name} m={m}",
                    lambda m=m, n=n, k=k, name=name: (
                        t.get(f"x{m}x{k}", m, k),
                        t.get(name, n, k, scale=k**-0.5),
                        None,
                    ),
                )
            )
        out.append(
            Workload(
                "rms_norm",
                f"norm m={m}",
                lambda m=m: (t.get(f"x{m}x{hidden}", m, hidden), t.get("norm", hidden), 1e-6),
            )
        )
        out.append(
            Workload(
                "fused_add_rms_norm",
                f"add+norm m={m}",
                lambda m=m: (
                    t.get(f"x{m}x{hidden}", m, hidden),
                    t.get(f"r{m}x{hidden}", m, hidden),
                    t.get("norm", hidden),
                    1e-6,
                ),
            )
        )
        act = 2 * (moe_inter if experts else inter) // tp
        out.append(
            Workload(
                "silu_and_mul",
                f"silu_and_mul m={m}",
                lambda m=m, act=act: (t.get(f"x{m}x{act}", m, act),),
            )
        )
        if experts:
            out.append(
                Workload(
                    "moe_experts",
                    f"experts m={m}",
                    lambda m=m: _moe_args(t, m, hidden, experts, moe_inter // tp, top_k),
                )
            )
    return out


def _moe_args(t: _Tensors, m: int, hidden: int, experts: int, inter: int, top_k: int) -> tuple:
    ids = torch.stack([torch.randperm(experts, generator=t._gen)[:top_k] for _ in range(m)]).int()
    weights = torch.full((m, top_k), 1.0 / top_k)
    return (
        t.get(f"x{m}x{hidden}", m, hidden),
        t.get("w13", experts, 2 * inter, hidden, scale=hidden**-0.5),
        t.get("w2", experts, hidden, inter, scale=inter**-0.5),
        weights.to(t.device),
        ids.to(t.device),
    )
