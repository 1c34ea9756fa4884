"""The decoder blocks Llama-family models share: rope attention, gated MLP, decoder layer, model.

Model files pick options (q/k/v bias, per-head q/k norm) through ``DecoderOptions``; the module
structure and parameter names are the Hugging Face ones, with q/k/v and gate/up fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import config as cfg
from models.moe import MoeOptions, SparseMoeBlock, is_sparse_layer
from xhal.interfaces import AttentionBlock
from xhal.layers import (
    Attention,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    moe: MoeOptions | None = None  # sparse layers' experts (the config says which layers)


def build_rotary(config: Any) -> RotaryEmbedding:
    params = cfg.rope_parameters(config)
    head_dim = cfg.head_dim(config)
    return RotaryEmbedding(
        head_size=head_dim,
        rotary_dim=int(head_dim * params.get("partial_rotary_factor", 1.0)),
        max_position=cfg.get(config, "max_position_embeddings"),
        base=params["rope_theta"],
        is_neox_style=True,
        rope_scaling=params,
    )


class RopeAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        options: DecoderOptions,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        hidden_size, self.head_dim = cfg.get(config, "hidden_size"), cfg.head_dim(config)
        num_heads = cfg.get(config, "num_attention_heads")
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, num_heads, cfg.num_kv_heads(config), options.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden_size, bias=options.o_bias, tp=tp
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if options.qk_norm:
            eps = cfg.get(config, "rms_norm_eps")
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # one module shared by every layer
        # a backend may run the whole block (norm, qkv, attention, o) in one call: bias-free only
        self.block_fusable = not (options.qkv_bias or options.o_bias)
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_id=layer_id,
            sliding_window=cfg.sliding_window(config, layer_id),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def forward_normed(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        project: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(positions, norm(hidden, residual)[0]), hidden + residual)``: the residual add,
        the input norm and the whole attention, in one backend call when the step's backend runs
        the block (``AttentionBackend.forward_block``), else as the fused norm + qkv projection,
        then ``attend`` (also when the backend declines the call). ``project=False``: the
        attention's output before o, never through the block (which runs o)."""
        if project and self.runs_block():
            fused = self.attn.forward_block(self.block_weights(norm), hidden, residual, positions)
            if fused is not None:
                return self.o_proj.reduce_partial(fused[0]), fused[1]
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        return self.attend(positions, qkv, project), residual

    def runs_block(self) -> bool:
        """Whether this step's backend may run the whole block (norm, qkv, attention, o)."""
        return self.block_fusable and self.attn.fuses_block()

    def block_weights(self, norm: RMSNorm) -> AttentionBlock:
        """This layer's weights as ``forward_block`` takes them (made at each call: cheap, and
        never stale after the model or its rotary table moves)."""
        qk_norm = {}
        if self.q_norm is not None:
            qk_norm = dict(
                q_norm_weight=self.q_norm.weight,
                k_norm_weight=self.k_norm.weight,
                qk_norm_eps=self.q_norm.eps,
            )
        return AttentionBlock(
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            qkv_weight=self.qkv_proj.weight,
            o_weight=self.o_proj.weight,
            cos_sin_cache=self.rotary_emb.cos_sin_cache,
            is_neox=self.rotary_emb.is_neox_style,
            **qk_norm,
        )

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, project: bool = True
    ) -> torch.Tensor:
        """Everything after the qkv projection (which the decoder layer may fuse with its norm);
        ``project=False`` stops before o, for a layer that runs o fused with what follows."""
        # qkv: [T, (H + 2 Hkv) * D] for this rank's heads
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Qwen3's per-head q/k norms go with them: the attention layer runs them (one op) or
        # hands them to a backend that fuses them into its decode attention
        out = self.attn(q, k, v, positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out) if project else out  # out: [T, H*D]


class GatedMLP(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, tp: TensorParallel) -> None:
        super().__init__()
        hidden_size, intermediate = (
            cfg.get(config, "hidden_size"),
            cfg.get(config, "intermediate_size"),
        )
        act = cfg.get(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by GatedMLP; supported: 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate, intermediate], bias=options.mlp_bias, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate, hidden_size, bias=options.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The SiLU gate and the down projection, one fused op: gate_up ``[T, 2 I / tp]``."""
        return self.down_proj.forward_silu_and_mul(gate_up)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x, residual)[0]), x + residual)`` as one op: the residual add, the
        post-attention norm, gate_up, the SiLU gate and down (one launch where a platform has
        one)."""
        return self.down_proj.forward_gated_block(x, residual, norm, self.gate_up_proj)


class DecoderLayer(nn.Module):
    """Pre-norm block. Returns ``(hidden, residual)``; the layer's output in the Hugging Face sense
    (the residual stream after it) is ``hidden + residual``, summed by the next layer's norm."""

    def __init__(
        self,
        config: Any,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        options: DecoderOptions,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        eps = cfg.get(config, "rms_norm_eps")
        self.self_attn = RopeAttention(config, layer_id, rotary_emb, options, tp)
        if options.moe is not None and is_sparse_layer(config, layer_id):
            self.mlp: nn.Module = SparseMoeBlock(config, options.moe, tp)
        else:
            self.mlp = GatedMLP(config, options, tp)
        self.input_layernorm = RMSNorm(cfg.get(config, "hidden_size"), eps)
        self.post_attention_layernorm = RMSNorm(cfg.get(config, "hidden_size"), eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm runs fused into what follows it (DeviceOps.add_rms_norm_linear, or a
        # backend's whole attention block: the plain sequence on the reference, one kernel where
        # a platform has one); a sparse block's router takes o in with it
        project = not self._o_into_router()
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
            qkv = self.self_attn.qkv_proj(hidden)
            hidden = self.self_attn.attend(positions, qkv, project)
        else:
            hidden, residual = self.self_attn.forward_normed(
                positions, hidden, residual, self.input_layernorm, project
            )
        # dense or sparse, the MLP block takes the post-attention add + norm in with it
        if project:
            return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)
        return self.mlp.forward_projected(
            hidden, self.self_attn.o_proj.weight, residual, self.post_attention_layernorm
        )

    def _o_into_router(self) -> bool:
        """Whether the attention's o projection runs in the sparse block's router op
        (``DeviceOps.linear_add_rms_norm_moe_route``): on one rank (o's all-reduce would sit
        between them), without an o bias, and unless the step's backend runs the attention
        block with its o."""
        o_proj = self.self_attn.o_proj
        return (
            isinstance(self.mlp, SparseMoeBlock)
            and o_proj.tp.size == 1
            and o_proj.bias is None
            and not self.self_attn.runs_block()
        )


class DecoderModel(nn.Module):
    """``model.`` of a causal LM: embeddings, decoder layers, final norm."""

    def __init__(self, config: Any, options: DecoderOptions, tp: TensorParallel) -> None:
        super().__init__()
        hidden_size = cfg.get(config, "hidden_size")
        self.embed_tokens = VocabParallelEmbedding(cfg.get(config, "vocab_size"), hidden_size, tp)
        self.rotary_emb = build_rotary(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary_emb, options, tp)
            for i in range(cfg.get(config, "num_hidden_layers"))
        )
        self.norm = RMSNorm(hidden_size, cfg.get(config, "rms_norm_eps"))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if input_embedding is None else input_embedding
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # no decoder layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]  # [T, hidden]
