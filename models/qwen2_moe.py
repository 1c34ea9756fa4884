"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (bias on q, k, v) with sparse
expert layers plus a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from models import config as cfg
from models.causal_lm import CausalLM
from models.common import DecoderOptions
from models.moe import MoeOptions, expert_stacking, num_experts
from models.weights import LLAMA_STACKED, Stacked, StackedExperts


class Qwen2MoeForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        moe = MoeOptions(
            intermediate_size=cfg.get(config, "moe_intermediate_size"),
            renormalize=bool(cfg.get(config, "norm_topk_prob", False)),
            shared_expert_intermediate_size=cfg.get(config, "shared_expert_intermediate_size", 0)
            or 0,
        )
        return DecoderOptions(qkv_bias=bool(cfg.get(config, "qkv_bias", True)), moe=moe)

    @classmethod
    def weight_stacking(cls, config: Any) -> tuple[Stacked | StackedExperts, ...]:
        return LLAMA_STACKED + expert_stacking(num_experts(config))
