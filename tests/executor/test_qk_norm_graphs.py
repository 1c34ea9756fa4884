"""What the decode graphs capture for Qwen3's q/k norms: the split-KV backend's routing (which
buckets its decode kernel takes, ``decode_fuses_qk_norm`` from ``XHAL_CUDA_FUSED_QK_NORM``) with
its Triton launch replaced by the reference's ops, captured by the CPU graph runner over a dense
Qwen3 and a Qwen3-MoE checkpoint. The buckets the kernel takes run the fused path (no
``qk_rms_norm`` of the layer's), the bucket past its ``max_seqs`` (FlashInfer's side at the MoE
shape's GQA 8, ``splitkv_seqs``) the layer's norm and the fallback; either way the replayed logits
equal the eager reference's."""

from __future__ import annotations

import random

import pytest
import torch

import xhal
from models.loader import load_model
from tests.support.paged_host import PagedHost
from xhal import ops
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform

pytest.importorskip("triton")  # splitkv_attention imports the kernel module
from xhal.platforms.cuda.splitkv_attention import SplitKVDecodeAttention  # noqa: E402

BUCKETS = (1, 2, 4)
MAX_SEQS = 4  # buckets of 4 and more on the fallback, as GQA 8's bucket of 64 on FlashInfer


class _RotaryFallback(CpuAttention):
    """The fallback, fusing rotary (as FlashInfer's and the Triton backend's do on a GPU)."""

    fuses_rotary = True

    def __init__(self, spec, calls: list) -> None:
        super().__init__(spec)
        self.calls = calls

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        self.calls.append(("fallback", layer_id))
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        return self.forward(layer_id, q, k, v)


class _EmulatedSplitKV(SplitKVDecodeAttention):
    """The split-KV backend with its decode launch as the reference's ops (norm, rotary, the
    KV write and attention: what the fused launch computes)."""

    def __init__(self, spec, calls: list) -> None:
        super().__init__(spec, _RotaryFallback(spec, calls), num_sms=4, max_seqs=MAX_SEQS)
        self.oracle, self.calls = CpuAttention(spec), calls

    def bind_kv_caches(self, caches) -> None:
        super().bind_kv_caches(caches)
        self.oracle.bind_kv_caches(caches)

    def plan_decode(self, m, graph_key):
        self.oracle.plan(m, graph_key)
        return super().plan_decode(m, graph_key)

    def decode_rotary(self, plan, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        self.calls.append(("rotary", layer_id))
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        return self.oracle.forward(layer_id, q, k, v)

    def decode_qk_norm(self, plan, layer_id, q, k, v, positions, cos_sin_cache, is_neox,
                       q_weight, k_weight, eps):  # fmt: skip
        self.calls.append(("fused", layer_id))
        t = q.shape[0]
        q, k = CpuOps().qk_rms_norm(q.reshape(t, -1), k.reshape(t, -1), q_weight, k_weight, eps)
        q, k = ops.rotary_embedding(
            positions, q.view(v.shape[0], -1, v.shape[2]), k.view(v.shape), cos_sin_cache, is_neox
        )
        return self.oracle.forward(layer_id, q, k, v)


class _Platform(CpuPlatform):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def attention_backend(self, spec):
        return _EmulatedSplitKV(spec, self.calls)


class _CountingOps(CpuOps):
    def __init__(self) -> None:
        self.qk_norms = 0

    def qk_rms_norm(self, q, k, q_weight, k_weight, eps):
        self.qk_norms += 1
        return super().qk_rms_norm(q, k, q_weight, k_weight, eps)


def _executor(path, platform, enforce_eager: bool) -> tuple[ModelExecutor, PagedHost]:
    model = load_model(path, dtype=torch.float32, progress=False)
    config = ExecutorConfig(
        dtype=torch.float32, block_size=16, max_num_seqs=4, max_model_len=128,
        enforce_eager=enforce_eager, decode_graph_sizes=BUCKETS, piecewise_token_sizes=(),
    )  # fmt: skip
    executor = ModelExecutor(model, platform, config)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=32))
    return executor, PagedHost(32, 16, seed=3)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "norm-apart"])
@pytest.mark.parametrize("checkpoint", ["qwen3", "qwen3_moe"])
def test_decode_buckets_capture_the_fused_qk_norm(checkpoint_factory, monkeypatch, checkpoint,
                                                  fused) -> None:  # fmt: skip
    monkeypatch.setenv("XHAL_CUDA_FUSED_QK_NORM", "1" if fused else "0")
    path = checkpoint_factory(checkpoint)
    platform = _Platform()
    graph, graph_host = _executor(path, platform, enforce_eager=False)
    eager, eager_host = _executor(path, xhal.platforms.get("cpu"), enforce_eager=True)
    num_layers = len(graph.model.model.layers)
    counting = _CountingOps()
    with ops.using("cpu", counting):
        graph.capture_graphs(progress=False)
    per_bucket = [platform.calls[i * num_layers : (i + 1) * num_layers] for i in range(3)]
    assert len(platform.calls) == 3 * num_layers, platform.calls
    for bucket, calls in zip(sorted(BUCKETS, reverse=True), per_bucket):  # largest first
        kind = ("fused" if fused else "rotary") if bucket < MAX_SEQS else "fallback"
        assert calls == [(kind, i) for i in range(num_layers)], (bucket, calls)
    # the layer's qk_rms_norm ran in every layer of the buckets the launch did not norm in, and
    # there only: twice each, as ``capture_all`` captures a bucket and replays it once (the CPU
    # runner re-runs the recorded op)
    assert counting.qk_norms == 2 * num_layers * (1 if fused else 3)
    rng = random.Random(0)
    prompts = [[rng.randrange(50) for _ in range(5 + 6 * s)] for s in range(4)]
    for executor, host in ((graph, graph_host), (eager, eager_host)):
        executor.execute(*host.step([(s, p) for s, p in enumerate(prompts)]))
    for step, active in enumerate(([0, 1], [0, 1, 2, 3], [2], [1, 3])):  # buckets 2, 4, 1, 2
        chunks = [(s, [10 + 3 * step + s]) for s in active]
        got = graph.compute_logits(graph.execute(*graph_host.step(chunks)))
        want = eager.compute_logits(eager.execute(*eager_host.step(chunks)))
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, f"decode step {step} (batch {len(active)}): graph logits off by {err}"
