"""The causal-LM wrapper every decoder-only model shares: ``model`` + ``lm_head`` and the
executor-facing contract (forward, compute_logits, load_weights)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from models import config as cfg
from models.common import DecoderModel, DecoderOptions
from models.weights import LLAMA_STACKED, Stacked, StackedExperts, load_named_weights
from xhal.layers import ParallelLMHead, TensorParallel


class CausalLM(nn.Module):
    """A decoder-only causal LM in the Hugging Face module layout.

    Contract (what ``ModelExecutor`` relies on): ``forward`` runs only inside a forward context
    and maps int32 ``input_ids`` / ``positions`` ``[T]`` to hidden states ``[T, hidden]``;
    ``compute_logits`` maps ``[S, hidden]`` to float32 ``[S, vocab]``; ``model.layers`` holds the
    decoder layers and their ``Attention`` layers have layer ids ``0..L-1``. The model holds
    structure and weights only: no cache, plan, graph or request state.
    """

    # checkpoint-name substrings that are not weights (rotary buffers some exports include)
    skip_weights: ClassVar[tuple[str, ...]] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(self, config: Any, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.model = DecoderModel(config, self.decoder_options(config), tp)
        self.lm_head = ParallelLMHead(
            cfg.get(config, "vocab_size"), cfg.get(config, "hidden_size"), tp
        )
        self.tie_word_embeddings = bool(cfg.get(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        """The model family's choices (biases, q/k norm); overridden per model."""
        return DecoderOptions()

    @classmethod
    def weight_stacking(cls, config: Any) -> tuple[Stacked | StackedExperts, ...]:
        """How checkpoint tensors fuse into parameters; MoE models add their experts'."""
        return LLAMA_STACKED

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int32 ``input_ids`` and ``positions`` ``[T]`` (or ``input_embedding`` ``[T, hidden]``
        instead of ids) -> hidden states ``[T, hidden]`` after the final norm."""
        return self.model(input_ids, positions, input_embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[S, hidden]`` -> float32 logits ``[S, vocab]``, gathered over tensor-parallel ranks."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full Hugging Face checkpoint tensors (each rank keeps its shards). Raises
        ``WeightsMismatchError`` naming any missing or unexpected tensor."""
        skip = self.skip_weights + (("lm_head.weight",) if self.tie_word_embeddings else ())
        load_named_weights(self, weights, self.weight_stacking(self.config), skip)
