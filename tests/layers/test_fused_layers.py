"""The fused ops from the model's side: a Llama decoder calls ``add_rms_norm_linear`` and
``silu_and_mul_linear`` (the reference runs them as the plain sequence, so outputs equal a model
built from the unfused ops), and ``layers.Attention`` hands rotary to a backend only when the
backend declares ``fuses_rotary``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
import torch

from benchmarks.bench_model import decode_metadata
from models.llama import LlamaForCausalLM
from xhal import ops, platforms
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces.attention import AttentionBackend
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.layers import Attention, RMSNorm, RotaryEmbedding
from xhal.platforms.cpu_ref.ops import CpuOps

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


class _CountingOps(CpuOps):
    """The reference, counting the fused ops and checking they see what the unfused ops would."""

    def __init__(self) -> None:
        self.calls = {"add_rms_norm_linear": 0, "silu_and_mul_linear": 0}

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        self.calls["add_rms_norm_linear"] += 1
        return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_and_mul_linear(self, x, weight, bias=None):
        self.calls["silu_and_mul_linear"] += 1
        return super().silu_and_mul_linear(x, weight, bias)


def _unfused_forward(
    model, ids: torch.Tensor, positions: torch.Tensor, backends, collective
) -> torch.Tensor:
    """The decoder written with the unfused ops only: the result the fused ops must reproduce."""
    inner, residual = model.model, None
    hidden = inner.embed_tokens(ids)
    with forward_context(ForwardContext(metadata=None, attention=backends, collective=collective)):
        for layer in inner.layers:
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            attn = layer.self_attn
            q, k, v = ops.linear(hidden, attn.qkv_proj.weight).split(
                [attn.q_size, attn.kv_size, attn.kv_size], -1
            )
            q, k = attn.rotary_emb(positions, q, k)
            hidden = ops.linear(attn.attn(q, k, v), attn.o_proj.weight)
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            mlp = layer.mlp
            hidden = ops.linear(
                ops.silu_and_mul(ops.linear(hidden, mlp.gate_up_proj.weight)), mlp.down_proj.weight
            )
        return inner.norm(hidden, residual)[0]


def _random_model(model_class, config: dict):
    """``model_class(config)`` with N(0, 0.2) weights (seeded)."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _eager_executor(model, platform) -> tuple[ModelExecutor, list]:
    """An eager executor of ``model`` on ``platform`` with its caches bound and zeroed (the
    cached prefix every run reads)."""
    cfg = ExecutorConfig(
        dtype=torch.float32, block_size=16, max_num_seqs=2, max_model_len=64, enforce_eager=True
    )
    executor = ModelExecutor(model, platform, cfg)
    caches = executor.allocate_kv_caches(num_blocks=8)
    for cache in caches:
        cache.key.zero_()
        cache.value.zero_()
    executor.bind_kv_caches(caches)
    return executor, caches


def test_llama_calls_the_fused_ops_and_matches_the_unfused_sequence() -> None:
    model = _random_model(LlamaForCausalLM, CONFIG)
    platform = platforms.get("cpu")
    executor, caches = _eager_executor(model, platform)
    ids, pos, meta = decode_metadata(2, 32, "cpu", CONFIG["vocab_size"])
    counting = _CountingOps()
    with ops.using("cpu", counting):
        hidden = executor.execute(ids, pos, meta)
    layers = CONFIG["num_hidden_layers"]
    # the first layer's input norm has no residual yet: every other norm runs fused
    assert counting.calls == {"add_rms_norm_linear": 2 * layers - 1, "silu_and_mul_linear": layers}
    # the same step again, unfused, over caches reset to the same contents
    for cache in caches:
        cache.key.zero_()
        cache.value.zero_()
    backends = {
        i: platform.attention_backend(a.spec(torch.float32, 16))
        for i, a in enumerate(_attention_layers(model))
    }
    for b in backends.values():
        b.bind_kv_caches(caches)
        b.plan(meta)
    expected = _unfused_forward(model, ids, pos, backends, platform.collective(None))
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def _attention_layers(model) -> list[Attention]:
    return sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_id
    )


class _Backend(AttentionBackend):
    def __init__(self, spec, fuses: bool) -> None:
        super().__init__(spec)
        self.fuses_rotary = fuses
        self.calls: list[tuple] = []

    def bind_kv_caches(self, caches: Sequence) -> None: ...

    def plan(self, metadata, graph_key: Hashable | None = None) -> None: ...

    def forward(self, layer_id, q, k, v):
        self.calls.append(("forward", q.clone(), k.clone()))
        return q

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        self.calls.append(("forward_rotary", positions, cos_sin_cache, is_neox))
        return q


def test_attention_hands_rotary_to_a_backend_only_when_it_fuses_it() -> None:
    attn = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2, layer_id=0)
    rotary = RotaryEmbedding(8, 8, 64, 10000.0, is_neox_style=False)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    positions = torch.tensor([0, 5, 9], dtype=torch.int32)
    single = platforms.get("cpu").collective(None)
    fusing, plain = (
        _Backend(attn.spec(torch.float32, 16), True),
        _Backend(attn.spec(torch.float32, 16), False),
    )
    for backend in (fusing, plain):
        with forward_context(
            ForwardContext(metadata=None, attention={0: backend}, collective=single)
        ):
            attn(q, k, v, positions, rotary)
    kind, pos, table, neox = fusing.calls[0]
    assert (
        (kind, neox) == ("forward_rotary", False)
        and pos is positions
        and table is rotary.cos_sin_cache
    )
    kind, q_seen, k_seen = plain.calls[0]
    q_rot, k_rot = ops.rotary_embedding(
        positions, q.view(3, 4, 8), k.view(3, 2, 8), rotary.cos_sin_cache, False
    )
    assert kind == "forward" and torch.equal(q_seen, q_rot) and torch.equal(k_seen, k_rot)


class _NormBackend(_Backend):
    """Says ``fuses_qk_norm`` as told (a decode step on a fusing kernel, or not)."""

    def __init__(self, spec, fuses_qk_norm: bool) -> None:
        super().__init__(spec, True)
        self.fuses_qk_norm = fuses_qk_norm

    def forward_qk_norm(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight,
                        k_weight, eps):  # fmt: skip
        self.calls.append(("forward_qk_norm", q.clone(), k.clone(), q_weight, k_weight, eps))
        return q


def test_attention_hands_the_qk_norm_to_a_backend_only_when_it_fuses_it() -> None:
    """Exactly one of the two: a backend that says ``fuses_qk_norm`` gets q and k unnormed with
    both weights and eps; otherwise the layer norms them with ``qk_rms_norm`` and the backend
    sees the normed values (then rotated by it, as ``fuses_rotary`` says)."""
    attn = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2, layer_id=0)
    rotary = RotaryEmbedding(8, 8, 64, 10000.0)
    q_norm, k_norm = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(-1.0, 1.0)
    qkv = torch.randn(3, 64)
    q, k, v = qkv.split([32, 16, 16], dim=-1)
    positions = torch.tensor([0, 5, 9], dtype=torch.int32)
    single = platforms.get("cpu").collective(None)
    spec = attn.spec(torch.float32, 16)
    fusing, plain = _NormBackend(spec, True), _NormBackend(spec, False)
    for backend in (fusing, plain):
        ctx = ForwardContext(metadata=None, attention={0: backend}, collective=single)
        with forward_context(ctx):
            attn(q, k, v, positions, rotary, q_norm, k_norm)
    ((kind, q_seen, k_seen, qw, kw, eps),) = fusing.calls
    assert kind == "forward_qk_norm" and qw is q_norm.weight and kw is k_norm.weight
    assert eps == 1e-6
    assert torch.equal(q_seen, q.reshape(3, 4, 8)) and torch.equal(k_seen, k.reshape(3, 2, 8))
    ((kind, pos, table, neox),) = plain.calls  # normed here, rotated in the backend's write
    assert kind == "forward_rotary" and pos is positions and neox
    with pytest.raises(ValueError, match="q_norm and k_norm together"):
        with forward_context(ForwardContext(None, {0: plain}, single)):
            attn(q, k, v, positions, rotary, q_norm, None)


def test_attention_without_a_fusing_backend_norms_with_qk_rms_norm_once() -> None:
    attn = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2, layer_id=0)
    q_norm, k_norm = RMSNorm(8, 1e-5), RMSNorm(8, 1e-5)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(-1.0, 1.0)
    q, k, v = torch.randn(2, 32), torch.randn(2, 16), torch.randn(2, 16)
    backend = _NormBackend(attn.spec(torch.float32, 16), False)
    backend.fuses_rotary = False
    counting = _QkNormCounting()
    with ops.using("cpu", counting), forward_context(
        ForwardContext(None, {0: backend}, platforms.get("cpu").collective(None))
    ):
        attn(q, k, v, None, None, q_norm, k_norm)  # no rotary: norm, then forward
    assert counting.calls == 1
    (kind, q_seen, k_seen) = backend.calls[0]
    q_want, k_want = CpuOps().qk_rms_norm(q, k, q_norm.weight, k_norm.weight, 1e-5)
    assert kind == "forward" and torch.equal(q_seen, q_want.view(2, 4, 8))
    assert torch.equal(k_seen, k_want.view(2, 2, 8))


class _QkNormCounting(CpuOps):
    def __init__(self) -> None:
        self.calls = 0

    def qk_rms_norm(self, q, k, q_weight, k_weight, eps):
        self.calls += 1
        return super().qk_rms_norm(q, k, q_weight, k_weight, eps)


def _decode_on(block_platform, architecture: str) -> tuple[list[torch.Tensor], int, int]:
    """A decode step of a random model on the reference and on ``block_platform``: both
    outputs, the block calls the latter's backends got, and the model's layer count."""
    from models.registry import get_model_class

    config = dict(CONFIG, architectures=[architecture], head_dim=16)
    model = _random_model(get_model_class(architecture), config)
    ids, pos, meta = decode_metadata(2, 32, "cpu", config["vocab_size"])
    outputs, backends = [], []
    for platform in (platforms.get("cpu"), block_platform):
        executor, _ = _eager_executor(model, platform)
        outputs.append(executor.execute(ids, pos, meta))
        backends.append(executor.backends)
    calls = sum(b.block_calls for b in backends[1])
    return outputs, calls, config["num_hidden_layers"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_backend_that_fuses_the_block_gets_every_layer_but_the_first(architecture) -> None:
    """With a backend that says ``fuses_block`` for decode steps, each decoder layer with a
    residual hands it its whole attention block (norm, qkv, q/k norm for Qwen3, rotary,
    attention, o) and gets the output the reference's own sequence gives."""
    from tests.support.block_attention import SequenceBlockPlatform

    outputs, calls, layers = _decode_on(SequenceBlockPlatform(), architecture)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
    assert calls == layers - 1


def test_a_declined_block_runs_the_layers_own_sequence() -> None:
    """A backend that says ``fuses_block`` may still decline a call (``forward_block`` returns
    None): the layer then runs its unfused path, with the reference's output."""
    from tests.support.block_attention import DecliningBlockPlatform

    outputs, calls, layers = _decode_on(DecliningBlockPlatform(), "Qwen3ForCausalLM")
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    assert calls == layers - 1
