"""bench_moe's floor accounting on a tiny config on the CPU: the experts a decode step routes to
(counted from the step's own router logits) and the bytes each part of the floor reads."""

from __future__ import annotations

import torch

import xhal
from benchmarks import bench_moe
from benchmarks.bench_model import decode_metadata
from xhal.executor import ExecutorConfig, ModelExecutor

TINY = {**bench_moe.CONFIG, "num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "num_experts": 16, "num_experts_per_tok": 4}


def test_routed_experts_and_floor_bytes(monkeypatch) -> None:
    monkeypatch.setattr(bench_moe, "CTX", 64)
    model = bench_moe.build_model(TINY, torch.device("cpu")).float()
    config = ExecutorConfig(dtype=torch.float32, block_size=16, max_num_seqs=4, max_model_len=128,
                            enforce_eager=True)
    executor = ModelExecutor(model, xhal.platforms.get("cpu"), config)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=24))
    ids, pos, meta = decode_metadata(3, 64, torch.device("cpu"))
    ids = ids % TINY["vocab_size"]
    logits = []
    # the router returns its logits, or a Routing with the logits first (the fused path)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0].clone()))
             for layer in model.model.layers]
    counts = bench_moe.routed_experts(model, executor, ids, pos, meta)
    for h in hooks:
        h.remove()
    # independent count: distinct experts among each layer's top-4 router logits
    expected = [int(torch.unique(out.topk(4, dim=-1).indices).numel()) for out in logits]
    assert counts == expected and all(4 <= c <= 12 for c in counts)

    parts = bench_moe.floor_bytes(TINY, 3, counts)
    expert = 3 * 64 * 32 * 2  # gate, up, down of one expert in bf16
    attention = (
        64 * (4 + 2 * 2) * 64 + 4 * 64 * 64 + 2 * 64 + 2 * 64
    ) * 2  # qkv, o, q/k norm, 2 norms
    assert parts == {
        "experts": expert * sum(counts),
        "attention+router": 2 * (attention + 16 * 64 * 2),
        "lm_head+embed": (1000 * 64 + 3 * 64 + 64) * 2,  # LM head, 3 embedding rows, final norm
        "kv": 3
        * 64
        * 2
        * 2
        * 64
        * 2
        * 2,  # batch x ctx x layers x kv heads x head dim x (k, v) x bf16
    }
