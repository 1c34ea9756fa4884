"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with sparse expert layers, top-k
routing renormalized when ``norm_topk_prob``, no shared expert."""

from __future__ import annotations

from typing import Any

from models import config as cfg
from models.causal_lm import CausalLM
from models.common import DecoderOptions
from models.moe import MoeOptions, expert_stacking, num_experts
from models.weights import LLAMA_STACKED, Stacked, StackedExperts


class Qwen3MoeForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(cfg.get(config, "attention_bias", False))
        moe = MoeOptions(
            intermediate_size=cfg.get(config, "moe_intermediate_size"),
            renormalize=bool(cfg.get(config, "norm_topk_prob", False)),
        )
        return DecoderOptions(
            qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, moe=moe
        )

    @classmethod
    def weight_stacking(cls, config: Any) -> tuple[Stacked | StackedExperts, ...]:
        return LLAMA_STACKED + expert_stacking(num_experts(config))
