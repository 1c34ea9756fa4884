"""The Llama-3-shaped model of the whole-model benchmarks (``bench_model.py`` and the benchmarks
built on it): its shapes (8B, 3.2-1B), random bf16 weights, the bytes one decode step reads, and
the inputs of a decode or prefill step over a simple block layout (``BLOCK`` tokens a block,
``CTX`` tokens of context)."""

from __future__ import annotations

import torch

from models.llama import LlamaForCausalLM
from xhal.interfaces import AttentionMetadata, BatchKind

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SHAPES = {
    "llama3-8b": CONFIG,
    # Llama-3.2-1B: head dim 64, tied embeddings (the LM head reads the whole table every step)
    "llama3.2-1b": {
        **CONFIG,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
}


def head_dim(config: dict) -> int:
    return config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])


def shape_weight_bytes(config: dict, elt: int = 2) -> int:
    """Bytes of every weight of a Llama-shaped ``config`` (the embedding table once when tied to
    the LM head, twice otherwise), computed from its sizes: what ``decode_read_bytes`` takes
    where no model is built (the served figures)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * head_dim(config)
    kv = config["num_key_value_heads"] * head_dim(config)
    layer = h * (q + 2 * kv) + q * h + 3 * inter * h + 2 * h  # qkv, o, gate_up + down, 2 norms
    tables = vocab * h * (1 if config["tie_word_embeddings"] else 2)
    return (config["num_hidden_layers"] * layer + h + tables) * elt


def decode_read_bytes(
    config: dict, weight_bytes: int, batch: int, ctx: int, elt: int = 2
) -> dict[str, int]:
    """Bytes one decode step reads: ``all`` (every weight + KV, the old floor's count) and
    ``honest`` (one embedding row per sequence rather than the table, unless the table is also the
    LM head, which reads all of it; K and V of ``ctx`` tokens per sequence)."""
    kv = (
        batch
        * ctx
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * head_dim(config)
        * 2
        * elt
    )
    table = config["vocab_size"] * config["hidden_size"] * elt
    rows = batch * config["hidden_size"] * elt
    embedding = 0 if config["tie_word_embeddings"] else table - rows
    return {"all": weight_bytes + kv, "honest": weight_bytes - embedding + kv}


BLOCK, CTX = 16, 2048


def random_model(device: torch.device, config: dict = CONFIG) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def decode_metadata(
    batch: int, ctx: int, device, vocab_size: int = CONFIG["vocab_size"]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``batch`` sequences with ``ctx - 1`` cached tokens each, decoding token ``ctx - 1``."""
    per_seq = ctx // BLOCK
    table_ = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    kv = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.ones(batch, dtype=torch.int32)
    slots = (table_[:, -1] * BLOCK + (ctx - 1) % BLOCK).int()
    meta = AttentionMetadata.from_host_lengths(
        BatchKind.DECODE, q, kv, table_.to(device), slots.to(device)
    )
    ids = torch.randint(0, vocab_size, (batch,), dtype=torch.int32, device=device)
    return ids, torch.full((batch,), ctx - 1, dtype=torch.int32, device=device), meta


def prefill_metadata(
    tokens: int, device, vocab_size: int = CONFIG["vocab_size"]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    blocks = -(-tokens // BLOCK)
    n = torch.tensor([tokens], dtype=torch.int32)
    meta = AttentionMetadata.from_host_lengths(
        BatchKind.PREFILL,
        n,
        n.clone(),
        torch.arange(blocks, dtype=torch.int32, device=device)[None],
        torch.arange(tokens, dtype=torch.int32, device=device),
    )
    ids = torch.randint(0, vocab_size, (tokens,), dtype=torch.int32, device=device)
    return ids, torch.arange(tokens, dtype=torch.int32, device=device), meta
