"""Device-neutral model layers: attention through the forward context, norms, rotary embedding,
activations, the mixture-of-experts layer, and tensor-parallel linear / embedding / LM-head
layers."""

from xhal.layers.activation import SiluAndMul
from xhal.layers.attention import Attention, attention_layers
from xhal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from xhal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from xhal.layers.moe import FusedMoE
from xhal.layers.moe_router import MoeRouter, Routing
from xhal.layers.norm import RMSNorm
from xhal.layers.parallel import TensorParallel
from xhal.layers.qkv import QKVParallelLinear
from xhal.layers.rotary import RotaryEmbedding
from xhal.layers.weights import default_weight_loader

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "FusedMoE",
    "MergedColumnParallelLinear",
    "MoeRouter",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "Routing",
    "SiluAndMul",
    "TensorParallel",
    "VocabParallelEmbedding",
    "attention_layers",
    "default_weight_loader",
]
