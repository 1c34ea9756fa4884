"""Qwen3 (dense): RMSNorm over each head of q and k before rope; optional attention bias."""

from __future__ import annotations

from typing import Any

from models import config as cfg
from models.causal_lm import CausalLM
from models.common import DecoderOptions


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(cfg.get(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
