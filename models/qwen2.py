"""Qwen2 / Qwen2.5: Llama's structure with a bias on q, k and v."""

from __future__ import annotations

from typing import Any

from models.causal_lm import CausalLM
from models.common import DecoderOptions


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
