"""Mixtral (8x7B, 8x22B): Mistral's attention with every MLP a top-2 mixture of experts,
renormalized. Checkpoints name the block ``block_sparse_moe`` and the experts' matrices
``w1`` (gate), ``w3`` (up), ``w2`` (down); the module is ``mlp``, as in transformers 5."""

from __future__ import annotations

from typing import Any

from models import config as cfg
from models.causal_lm import CausalLM
from models.common import DecoderOptions
from models.moe import MoeOptions, expert_stacking, num_experts
from models.weights import LLAMA_STACKED, Stacked, StackedExperts


class MixtralForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        moe = MoeOptions(intermediate_size=cfg.get(config, "intermediate_size"), renormalize=True)
        return DecoderOptions(moe=moe)

    @classmethod
    def weight_stacking(cls, config: Any) -> tuple[Stacked | StackedExperts, ...]:
        router = Stacked(".mlp.gate.", ".block_sparse_moe.gate.", None)
        experts = expert_stacking(num_experts(config), ("w1", "w3", "w2"), ".block_sparse_moe")
        return (*LLAMA_STACKED, router, *experts)
