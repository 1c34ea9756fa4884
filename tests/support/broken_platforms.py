"""Deliberately broken platforms: the conformance suite must fail each of them.

Import this module as a plugin (``XHAL_PLUGINS=tests.support.broken_platforms`` or
``xhal-conformance --plugin tests.support.broken_platforms``). Each platform is the CPU reference
with exactly one bug of the kind a backend author really writes; everything else is the reference,
so the family that owns the broken contract is the one expected to fail:

- ``broken-causal`` (attention): no causal mask among a sequence's new tokens.
- ``broken-kv-slot`` (attention): the KV write ignores the block table (contiguous varlen layout).
- ``broken-collective`` (collective): ``all_reduce`` sums into a copy, returns the local tensor.
- ``broken-graph`` (graph): replay drops the fresh results, so outputs keep capture-time values.
- ``broken-qk-norm`` (fused): the one-launch q/k norm scales k's heads by q's norm weight.
- ``broken-gated-mlp`` (fused): the gated MLP block takes up as the gate and the gate as up.
- ``broken-qk-norm-order`` (attention): a backend that fuses Qwen3's q/k norm into its decode
  attention rotates q and k first and norms them after.

The bugs that only the way serving calls a backend shows are in ``tests.support.broken_serving``,
which this module imports so that one plugin registers every broken platform.

The broken attention math lives in custom ops of a test namespace (``xhal_broken``), like the
reference's kernels, so that a captured graph records each as one device call and no other
contract (graph safety, host syncs) breaks along with the one under test.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from xhal import ops, platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.metadata import BatchKind
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.platforms.cpu_ref.collective import GlooCollective
from xhal.platforms.cpu_ref.graph import CpuGraphRunner
from xhal.platforms.cpu_ref.kernels.paged_attention import gather_sequence
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform

# Kernels -------------------------------------------------------------------------------------

_lib = torch.library.Library("xhal_broken", "DEF")
_lib.define(
    "paged_attention_no_causal(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_cu_seq_lens, "
    "Tensor kv_seq_lens, Tensor block_table, float scale, int sliding_window, float soft_cap) "
    "-> Tensor"
)
_lib.define(
    "write_kv_varlen(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor q_cu_seq_lens, Tensor kv_seq_lens, Tensor slot_mapping) -> ()"
)


@torch.library.impl(_lib, "paged_attention_no_causal", "CPU")
def paged_attention_no_causal(
    q, k_cache, v_cache, q_cu_seq_lens, kv_seq_lens, block_table, scale, sliding_window, soft_cap
):
    # The reference kernel minus `k_pos <= q_pos`: the author reasoned "decode has one query, so it
    # sees everything", which is right for decode and wrong for every prefill chunk longer than 1.
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    q_cu, kv_lens = q_cu_seq_lens.tolist(), kv_seq_lens.tolist()
    for i, kv_len in enumerate(kv_lens):
        start, end = q_cu[i], q_cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        keys = gather_sequence(k_cache, block_table[i], kv_len).float()  # [L, Hkv, D]
        values = gather_sequence(v_cache, block_table[i], kv_len).float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [H, Lq, L]
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        k_pos = torch.arange(kv_len).unsqueeze(0)
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)  # BUG: no causal mask
        if sliding_window > 0:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


@torch.library.register_fake("xhal_broken::paged_attention_no_causal")
def _(q, k_cache, v_cache, q_cu_seq_lens, kv_seq_lens, block_table, scale, window, soft_cap):
    return torch.empty_like(q)


@torch.library.impl(_lib, "write_kv_varlen", "CPU")
def write_kv_varlen(k, v, k_cache, v_cache, q_cu_seq_lens, kv_seq_lens, slot_mapping) -> None:
    # Ported from a varlen (non-paged) kernel: sequence i's KV position p goes to flat slot
    # kv_cu_seq_lens[i] + p, as if every sequence's blocks were contiguous and in order. Right
    # whenever the block table happens to be the identity, wrong for any real (permuted) one.
    # slot_mapping is still honoured as the padding mask, so -1 rows stay unwritten.
    block_size = k_cache.shape[1]
    q_cu, kv_lens, slots = q_cu_seq_lens.tolist(), kv_seq_lens.tolist(), slot_mapping.tolist()
    kv_start = 0
    for i, kv_len in enumerate(kv_lens):
        start, end = q_cu[i], q_cu[i + 1]
        first_pos = kv_len - (end - start)
        for t in range(start, end):
            if slots[t] < 0:
                continue
            slot = kv_start + first_pos + (t - start)  # BUG: should be slots[t]
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]
        kv_start += kv_len


# Attention backends ----------------------------------------------------------------------------


class _NoCausalAttention(CpuAttention):
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("forward called before plan(metadata)")
        cache, plan, spec = self._caches[layer_id], self._plan, self.spec
        torch.ops.xhal_cpu_ref.write_kv(k, v, cache.key, cache.value, plan.slot_mapping)
        return torch.ops.xhal_broken.paged_attention_no_causal(
            q,
            cache.key,
            cache.value,
            plan.q_cu_seq_lens,
            plan.kv_seq_lens,
            plan.block_table,
            spec.softmax_scale,
            spec.sliding_window or 0,
            spec.logits_soft_cap or 0.0,
        )


class _VarlenWriteAttention(CpuAttention):
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("forward called before plan(metadata)")
        cache, plan, spec = self._caches[layer_id], self._plan, self.spec
        torch.ops.xhal_broken.write_kv_varlen(
            k, v, cache.key, cache.value, plan.q_cu_seq_lens, plan.kv_seq_lens, plan.slot_mapping
        )
        # the read side is the reference's, block table and all
        return torch.ops.xhal_cpu_ref.paged_attention(
            q,
            cache.key,
            cache.value,
            plan.q_cu_seq_lens,
            plan.kv_seq_lens,
            plan.block_table,
            spec.softmax_scale,
            spec.sliding_window or 0,
            spec.logits_soft_cap or 0.0,
        )


# Collective ------------------------------------------------------------------------------------


class _LocalAllReduceCollective(GlooCollective):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # The author cloned to keep the caller's tensor intact, then returned the wrong one: the
        # sum lands in `out` and the local tensor goes back. Right only with world_size == 1.
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return x  # BUG: should be `out`


# Graph runner ----------------------------------------------------------------------------------


class _StaleGraphRunner(CpuGraphRunner):
    def replay(self, key: Hashable) -> Any:
        if key not in self._graphs:
            raise KeyError(f"no graph captured for key {key!r}")
        graph = self._graphs[key]
        with torch.no_grad():
            for op in graph.ops:
                # BUG: the fresh results are dropped instead of copied into the tensors captured as
                # outputs, so every op downstream (and the caller) reads the values of capture
                # time: replay keeps returning what the inputs held when the graph was captured.
                op.func(*op.args, **op.kwargs)
        return graph.outputs


# Platforms -------------------------------------------------------------------------------------


class BrokenCausalPlatform(CpuPlatform):
    name = "broken-causal"

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        return _NoCausalAttention(spec)


class BrokenKvSlotPlatform(CpuPlatform):
    name = "broken-kv-slot"

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        return _VarlenWriteAttention(spec)


class BrokenCollectivePlatform(CpuPlatform):
    name = "broken-collective"

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        base = super().collective(group)
        # a single-rank world is the identity either way; the bug shows only across processes
        return _LocalAllReduceCollective(base.group) if isinstance(base, GlooCollective) else base


class BrokenGraphPlatform(CpuPlatform):
    name = "broken-graph"

    def graph_runner(self) -> CpuGraphRunner:
        return _StaleGraphRunner()


class _OneWeightQkNormOps(CpuOps):
    def qk_rms_norm(self, q, k, q_weight, k_weight, eps):
        # BUG: one weight pointer for every head of the launch, q's
        return super().qk_rms_norm(q, k, q_weight, q_weight, eps)


class BrokenQkNormPlatform(CpuPlatform):
    name = "broken-qk-norm"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _OneWeightQkNormOps()


class _SwappedGateUpOps(CpuOps):
    def add_rms_norm_gated_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight,
                               gate_up_bias=None, down_bias=None):  # fmt: skip
        gate_up, summed = self.add_rms_norm_linear(
            x, residual, norm_weight, eps, gate_up_weight, gate_up_bias
        )
        # BUG: the halves the other way round (the author's checkpoint stored up's rows first)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.silu_and_mul_linear(torch.cat([up, gate], -1), down_weight, down_bias), summed


class BrokenGatedMlpPlatform(CpuPlatform):
    name = "broken-gated-mlp"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _SwappedGateUpOps()


class _NormAfterRotaryAttention(CpuAttention):
    """Says ``fuses_qk_norm`` for decode steps, as a split-KV kernel with the norm inside does."""

    def plan(self, metadata, graph_key: Hashable | None = None) -> None:
        super().plan(metadata, graph_key)
        self.fuses_qk_norm = metadata.kind == BatchKind.DECODE

    def forward_qk_norm(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight,
                        k_weight, eps):  # fmt: skip
        # BUG: the rotary first, the norm after (the author reasoned "rotation keeps the RMS",
        # true of the RMS, false of the per-channel weight applied with it)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        num_tokens = q.shape[0]
        q, k = ops.qk_rms_norm(
            q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), q_weight, k_weight, eps
        )
        return self.forward(layer_id, q.view(v.shape[0], -1, v.shape[2]),
                            k.view(v.shape), v)  # fmt: skip


class BrokenQkNormOrderPlatform(CpuPlatform):
    name = "broken-qk-norm-order"

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        return _NormAfterRotaryAttention(spec)


BROKEN_PLATFORMS = (
    BrokenCausalPlatform,
    BrokenKvSlotPlatform,
    BrokenCollectivePlatform,
    BrokenGraphPlatform,
    BrokenQkNormPlatform,
    BrokenGatedMlpPlatform,
    BrokenQkNormOrderPlatform,
)
for _cls in BROKEN_PLATFORMS:
    platforms.register(_cls.name, _cls)

# the bugs that show only the way serving calls a backend live next door; register them too
from tests.support import broken_serving  # noqa: E402, F401  (imported for its registrations, after ours)
