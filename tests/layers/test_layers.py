"""xhal.layers against transformers' implementations and hand-computed shards."""

from __future__ import annotations

import ast
from collections.abc import Hashable, Sequence

import pytest
import torch
import torch.nn.functional as F

from models.config import rope_parameters
from tests.support.paths import REPO
from xhal import platforms
from xhal.interfaces.attention import AttentionBackend
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.layers import (
    Attention,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    TensorParallel,
    VocabParallelEmbedding,
)

transformers = pytest.importorskip("transformers")

ROOT = REPO
MAX_POSITION = 128
THETA = 10000.0
ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 0.8,
        "truncate": False,
    },
}


@pytest.fixture(autouse=True)
def _cpu_ops() -> None:
    # xhal.ops kernels for a device type exist once a platform of that type is created
    platforms.get("cpu")


def _qk(num_tokens: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, 4, head_dim, generator=g)  # [T, H, D]
    k = torch.randn(num_tokens, 2, head_dim, generator=g)  # [T, Hkv, D]
    positions = torch.randperm(MAX_POSITION, generator=g)[:num_tokens].to(torch.int32)
    return positions, q, k


def _xhal_rope(config, head_dim: int, rotary_dim: int, is_neox: bool = True) -> RotaryEmbedding:
    params = rope_parameters(config)
    return RotaryEmbedding(
        head_dim, rotary_dim, MAX_POSITION, params["rope_theta"], is_neox, params
    )


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rotary_matches_transformers_llama(case: str) -> None:
    from transformers.models.llama import modeling_llama as hf

    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={**ROPE_CASES[case], "rope_theta": THETA},
    )
    positions, q, k = _qk(40, 64)
    cos, sin = hf.LlamaRotaryEmbedding(config)(q, positions.long()[None])  # [1, T, D]
    q_ref, k_ref = hf.apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    q_out, k_out = _xhal_rope(config, 64, 64)(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["default", "yarn"])
def test_partial_rotary_neox_matches_transformers(case: str) -> None:
    from transformers.models.gpt_neox import modeling_gpt_neox as hf

    config = transformers.GPTNeoXConfig(
        hidden_size=256,
        num_attention_heads=4,
        partial_rotary_factor=0.25,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={**ROPE_CASES[case], "rope_theta": THETA},
    )
    positions, q, k = _qk(24, 64, seed=1)
    cos, sin = hf.GPTNeoXRotaryEmbedding(config)(q, positions.long()[None])  # [1, T, 16]
    q_ref, k_ref = hf.apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    rope = _xhal_rope(config, 64, 16)
    q_out, k_out = rope(positions, q.flatten(1), k.flatten(1))  # the [T, H*D] layout too
    torch.testing.assert_close(q_out.view_as(q), q_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_out.view_as(k), k_ref[0], rtol=1e-5, atol=1e-6)


def test_gptj_style_partial_rotary_matches_transformers() -> None:
    from transformers.models.gptj import modeling_gptj as hf

    rotary_dim = 32
    positions, q, k = _qk(24, 64, seed=2)
    sincos = hf.create_sinusoidal_positions(MAX_POSITION, rotary_dim)[positions.long()][None]
    sin, cos = sincos.split(rotary_dim // 2, dim=-1)  # [1, T, R/2] each

    def reference(x: torch.Tensor) -> torch.Tensor:  # x: [T, H, D]
        rotated = hf.apply_rotary_pos_emb(x[None, ..., :rotary_dim], sin, cos)[0]
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)

    rope = RotaryEmbedding(64, rotary_dim, MAX_POSITION, THETA, is_neox_style=False)
    q_out, k_out = rope(positions, q, k)
    torch.testing.assert_close(q_out, reference(q), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_out, reference(k), rtol=1e-5, atol=1e-6)


def test_rotary_table_stays_float32_when_the_model_is_cast() -> None:
    rope = RotaryEmbedding(64, 64, 4096, 500000.0)
    table = rope.cos_sin_cache.clone()
    model = torch.nn.Sequential(rope, torch.nn.Linear(4, 4)).to(torch.bfloat16)
    assert model[1].weight.dtype == torch.bfloat16
    assert rope.cos_sin_cache.dtype == torch.float32 and torch.equal(rope.cos_sin_cache, table)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="'dynamic'.*supported"):
        RotaryEmbedding(
            64, 64, MAX_POSITION, THETA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        )


def test_rms_norm_plain_and_fused() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    weight = torch.randn(32, generator=g)
    ref = LlamaRMSNorm(32, eps=1e-5)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(weight)
        norm.weight.copy_(weight)
    torch.testing.assert_close(norm(x), ref(x))
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, ref(x + residual))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


# Tensor-parallel weight loading -----------------------------------------------------------------


def _loaded(layer, **weights_and_shards):
    for name, (tensor, shard_id) in weights_and_shards.items():
        param = getattr(layer, name.split("__")[0])
        if shard_id is None:
            layer.weight_loader(param, tensor)
        else:
            layer.weight_loader(param, tensor, shard_id)
    return layer


@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_keep_their_halves(rank: int) -> None:
    tp = TensorParallel(rank, 2)
    w, b = torch.randn(8, 6), torch.randn(8)
    col = _loaded(ColumnParallelLinear(6, 8, bias=True, tp=tp), weight=(w, None), bias=(b, None))
    assert torch.equal(col.weight, w[rank * 4 : (rank + 1) * 4])
    assert torch.equal(col.bias, b[rank * 4 : (rank + 1) * 4])

    w, b = torch.randn(6, 8), torch.randn(6)
    row = _loaded(RowParallelLinear(8, 6, bias=True, tp=tp), weight=(w, None), bias=(b, None))
    assert torch.equal(row.weight, w[:, rank * 4 : (rank + 1) * 4])
    assert torch.equal(row.bias, b)  # the bias is added once, after the reduction


@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_and_merged_keep_their_halves(rank: int) -> None:
    tp = TensorParallel(rank, 2)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)  # 4 heads, 2 KV heads, D=2
    layer = QKVParallelLinear(8, 2, 4, 2, tp=tp)
    for shard_id, tensor in zip("qkv", (q, k, v)):
        layer.weight_loader(layer.weight, tensor, shard_id)
    expected = torch.cat(
        [q[rank * 4 : rank * 4 + 4], k[rank * 2 : rank * 2 + 2], v[rank * 2 : rank * 2 + 2]]
    )
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    assert torch.equal(layer.weight, expected)

    fused = QKVParallelLinear(8, 2, 4, 2, tp=tp)  # a checkpoint with qkv already fused
    fused.weight_loader(fused.weight, torch.cat([q, k, v]))
    assert torch.equal(fused.weight, expected)

    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    merged = MergedColumnParallelLinear(4, [6, 6], tp=tp)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert torch.equal(
        merged.weight, torch.cat([gate[rank * 3 : rank * 3 + 3], up[rank * 3 : rank * 3 + 3]])
    )


def test_qkv_replicates_kv_heads_when_ranks_outnumber_them() -> None:
    k = torch.randn(4, 8)  # 2 KV heads of size 2
    for rank in range(4):
        layer = QKVParallelLinear(8, 2, 4, 2, tp=TensorParallel(rank, 4))
        layer.weight_loader(layer.weight, k, "k")
        head = rank // 2  # ranks 0, 1 share KV head 0; ranks 2, 3 share head 1
        assert torch.equal(
            layer.weight[layer.q_size : layer.q_size + 2], k[head * 2 : head * 2 + 2]
        )


def _partials(make, forward, size: int = 2) -> list[torch.Tensor]:
    """Each rank's result with the collective as identity: the per-rank partial results."""
    single = platforms.get("cpu").collective(None)
    outs = []
    with forward_context(ForwardContext(metadata=None, attention={}, collective=single)):
        for rank in range(size):
            outs.append(forward(make(TensorParallel(rank, size))))
    return outs


def test_sharded_forwards_recombine_to_the_full_layer() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g)
    full = F.linear(x, w)

    def col(tp):
        return _loaded(ColumnParallelLinear(8, 6, tp=tp), weight=(w, None))

    # each shard's GEMM may sum in another order than the full one: a float32 tolerance
    sharded = torch.cat([col(TensorParallel(r, 2))(x) for r in range(2)], dim=-1)
    assert torch.allclose(sharded, full, rtol=1e-5, atol=1e-6)

    def row(tp):
        return _loaded(RowParallelLinear(8, 6, input_is_parallel=False, tp=tp), weight=(w, None))

    assert torch.allclose(sum(_partials(row, lambda m: m(x))), full, atol=1e-6)

    table, ids = torch.randn(5, 4), torch.tensor([0, 4, 2, 3], dtype=torch.int32)  # 5 rows, 2 ranks

    def emb(tp):
        return _loaded(VocabParallelEmbedding(5, 4, tp=tp), weight=(table, None))

    assert emb(TensorParallel(1, 2)).weight[2].abs().sum() == 0  # the padding row of the last rank
    assert torch.equal(sum(_partials(emb, lambda m: m(ids))), table[ids.long()])

    def head(tp):
        return _loaded(ParallelLMHead(5, 4, tp=tp), weight=(table, None))

    hidden = torch.randn(2, 4)
    local = _partials(head, lambda m: F.linear(hidden, m.weight))
    logits = torch.cat(local, dim=-1)[:, :5]
    torch.testing.assert_close(logits, hidden @ table.T)
    assert head(TensorParallel(0, 1)).compute_logits(hidden).dtype == torch.float32


def test_weight_loader_rejects_a_wrong_full_shape() -> None:
    layer = ColumnParallelLinear(6, 8, tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"shape \(4, 6\), expected \(8, 6\)"):
        layer.weight_loader(layer.weight, torch.randn(4, 6))


def test_tensor_parallel_validates() -> None:
    with pytest.raises(ValueError):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(4, 6, tp=TensorParallel(0, 4))


# Attention ------------------------------------------------------------------------------------


class _Recorder(AttentionBackend):
    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.calls: list[tuple[int, tuple, tuple]] = []

    def bind_kv_caches(self, caches: Sequence) -> None: ...

    def plan(self, metadata, graph_key: Hashable | None = None) -> None: ...

    def forward(self, layer_id, q, k, v):
        self.calls.append((layer_id, tuple(q.shape), tuple(k.shape)))
        return q * 2


def test_attention_reaches_the_backend_through_the_context() -> None:
    attn = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2, layer_id=3)
    spec = attn.spec(torch.float32, block_size=16)
    assert (spec.num_heads, spec.num_kv_heads, spec.softmax_scale) == (4, 2, 0.5)
    backend = _Recorder(spec)
    q, kv = torch.randn(5, 32), torch.randn(5, 16)
    with pytest.raises(RuntimeError, match="no forward context"):
        attn(q, kv, kv)
    single = platforms.get("cpu").collective(None)
    with forward_context(ForwardContext(metadata=None, attention={3: backend}, collective=single)):
        out = attn(q, kv, kv)
    assert backend.calls == [(3, (5, 4, 8), (5, 2, 8))]
    assert torch.equal(out, q * 2) and out.shape == (5, 32)


def test_layers_and_models_import_nothing_device_specific() -> None:
    forbidden = ("torch.cuda", "torch.npu", "torch_npu", "flashinfer", "triton", "tilelang")
    for folder in ("xhal/layers", "models"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                bad = [n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden)]
                assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
            assert "torch.cuda" not in path.read_text(), f"{path.relative_to(ROOT)} uses torch.cuda"
