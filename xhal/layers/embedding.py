"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xhal import ops
from xhal.interfaces.forward_context import get_forward_context
from xhal.layers.parallel import TensorParallel
from xhal.layers.weights import check_shape


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split by rows.

    Rank r holds rows ``[r*n, min((r+1)*n, vocab))`` with ``n = ceil(vocab / size)``; the last
    rank's extra rows (when the vocabulary does not split evenly) are zeros. Each rank embeds the
    ids it owns, zeros the others, and the ranks' results are summed.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallel = TensorParallel()
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // tp.size)
        self.vocab_start_index = min(tp.rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        start, end = self.vocab_start_index, self.vocab_end_index
        param.data.zero_()
        param.data[: end - start].copy_(loaded_weight[start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * owned
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return get_forward_context().collective.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to the vocabulary, sharded like ``VocabParallelEmbedding``."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (``tie_word_embeddings``); the shards line up by design."""
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp) != (
            self.num_embeddings,
            self.embedding_dim,
            self.tp,
        ):
            raise ValueError(
                "ParallelLMHead.tie_weights: embedding shape or tensor-parallel differs"
            )
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[S, hidden]`` -> float32 logits ``[S, vocab]`` (gathered over ranks)."""
        logits = ops.linear(hidden, self.weight)  # [S, vocab / tp] (padded)
        if self.tp.size > 1:
            logits = get_forward_context().collective.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use compute_logits(hidden)")
