"""Llama 2 / 3 / 3.1 / 3.2 and Mistral (dense)."""

from __future__ import annotations

from typing import Any

from models import config as cfg
from models.causal_lm import CausalLM
from models.common import DecoderOptions


class LlamaForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(cfg.get(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get(config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's dense models: Llama's structure, with the config's sliding window (if any)."""
