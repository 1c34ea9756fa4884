"""Tiny random Hugging Face checkpoints, built with transformers on the spot (no downloads).

Every builder writes a directory ``save_pretrained(safe_serialization=True)`` would write and
returns its path. Weights are re-drawn from a seeded generator with a larger scale than
transformers' init (std 0.1, norm weights around 1, non-zero biases) so that attention patterns,
biases and norms all matter and a numerical bug cannot hide in near-uniform softmaxes.

Reused by the model, align, executor and server tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# head_dim 64 by default; the CPU reference serves any head dim (see llama_head_dim_16)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(arch: str, overrides: dict[str, Any]):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "mixtral": MixtralConfig,
        "qwen2": Qwen2Config,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
    }
    return classes[arch](**{**TINY, **overrides})


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


def build_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = False,
    **config_overrides: Any,
) -> Path:
    """A float32 checkpoint of ``arch`` (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
    qwen3_moe) with ``TINY`` sizes
    changed by ``config_overrides``; sharded with an index when ``max_shard_size`` is given."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = _config(arch, config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer:
        build_tokenizer(path, config.vocab_size)
    return path


def llama_gqa(path: str | Path, **kw: Any) -> Path:
    """Llama with GQA (4 heads, 2 KV heads) and llama3 rope scaling."""
    return build_checkpoint(path, "llama", rope_parameters=dict(LLAMA3_ROPE), **kw)


def llama_tied(path: str | Path, **kw: Any) -> Path:
    """Llama 3.2-style: tied input/output embeddings (no lm_head tensor in the checkpoint)."""
    return build_checkpoint(path, "llama", seed=1, tie_word_embeddings=True, **kw)


def llama_sharded(path: str | Path, **kw: Any) -> Path:
    """Llama saved in many safetensors shards with model.safetensors.index.json."""
    return build_checkpoint(path, "llama", seed=2, max_shard_size="100KB", **kw)


def qwen2(path: str | Path, **kw: Any) -> Path:
    """Qwen2: bias on q, k and v; tied embeddings like the small Qwen2.5 models."""
    return build_checkpoint(path, "qwen2", seed=3, tie_word_embeddings=True, **kw)


def qwen3(path: str | Path, **kw: Any) -> Path:
    """Qwen3: per-head RMSNorm on q and k."""
    return build_checkpoint(path, "qwen3", seed=4, **kw)


def mistral_sliding(path: str | Path, **kw: Any) -> Path:
    """Mistral with a sliding window shorter than the test prompts."""
    return build_checkpoint(path, "mistral", seed=5, sliding_window=8, **kw)


def llama_head_dim_16(path: str | Path, **kw: Any) -> Path:
    """Llama with head dim 16 (4 heads of 16 in a hidden size of 64): a size no kernel library
    lists, which the CPU reference must still serve."""
    return build_checkpoint(path, "llama", seed=6, head_dim=16, **kw)


# 8 experts of which a token of a 37-token prompt picks 2 or 3: some experts get many tokens, and
# the routed sets differ token by token
TINY_MOE = {"num_experts": 8, "moe_intermediate_size": 32}


def qwen3_moe(path: str | Path, **kw: Any) -> Path:
    """Qwen3-MoE: top-3 of 8 experts renormalized (norm_topk_prob), per-head q/k norm."""
    return build_checkpoint(
        path, "qwen3_moe", seed=6, num_experts_per_tok=3, norm_topk_prob=True,
        **{**TINY_MOE, **kw},
    )


def mixtral(path: str | Path, **kw: Any) -> Path:
    """Mixtral: top-2 of 8 experts, renormalized; checkpoint names block_sparse_moe / w1 w2 w3."""
    return build_checkpoint(
        path, "mixtral", seed=7, num_local_experts=8, num_experts_per_tok=2, **kw
    )


def qwen2_moe(path: str | Path, **kw: Any) -> Path:
    """Qwen2-MoE: top-2 of 8 experts, not renormalized, plus a sigmoid-gated shared expert;
    layer 1 is a dense MLP (mlp_only_layers)."""
    return build_checkpoint(
        path, "qwen2_moe", seed=8, num_experts_per_tok=2, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], **{**TINY_MOE, **kw},
    )


MOE_BUILDERS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "qwen2_moe": qwen2_moe}


BUILDERS = {
    "llama_head_dim_16": llama_head_dim_16,
    "llama_gqa": llama_gqa,
    "llama_tied": llama_tied,
    "llama_sharded": llama_sharded,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mistral_sliding": mistral_sliding,
    **MOE_BUILDERS,
}

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a small model runs on any device through one layer of abstraction",
    "hello world this is a tiny tokenizer trained on the spot",
    "numbers one two three four five six seven eight nine ten",
]


def build_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer trained on a few sentences (ids < ``vocab_size``), saved next to
    the checkpoint so ``AutoTokenizer.from_pretrained(path)`` works."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))
    return Path(path)
