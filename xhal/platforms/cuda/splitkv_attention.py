"""Decode steps on the single-launch split-KV Triton kernel (``kernels/splitkv_decode.py``),
every other step on the backend it wraps.

Used twice: the Triton backend (``cuda-triton``, and ``cuda`` without FlashInfer) runs every
decode step here, and the ``triton-splitkv`` solution of ``cuda`` runs the decode steps of
``min_seqs`` up to ``max_seqs`` sequences here and the others on FlashInfer (the rule and its
figures are in ``solutions.py``). Prefill, chunked prefill and mixed steps always go to the
wrapped backend.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.cuda.decode_over_fallback import DecodeOverFallback, DecodePlan
from xhal.platforms.cuda.kernels import splitkv_decode as kernel


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the split-KV kernel cannot serve ``spec``, or None when it can."""
    if spec.group_size > kernel.MAX_GROUP:
        return f"GQA group {spec.group_size} (at most {kernel.MAX_GROUP})"
    return None


def with_splitkv_decode(
    spec: AttentionSpec,
    fallback: AttentionBackend,
    num_sms: int,
    min_seqs: int = 1,
    max_seqs: int | None = None,
    backend: type[SplitKVDecodeAttention] | None = None,
) -> AttentionBackend:
    """``fallback`` with its decode steps of ``min_seqs`` sequences and more (fewer than
    ``max_seqs`` when given) on the split-KV kernel, or ``fallback`` itself for a spec the kernel
    does not take. ``backend``: a subclass to make instead (``splitkv_block.py``'s, which also
    runs one-sequence decode blocks in one launch)."""
    if unsupported(spec) is not None:
        return fallback
    return (backend or SplitKVDecodeAttention)(spec, fallback, num_sms, min_seqs, max_seqs)


@dataclass
class _DecodePlan(DecodePlan):
    scratch: kernel.Scratch  # the bucket's own for a graph key, else the shared eager one


class SplitKVDecodeAttention(DecodeOverFallback):
    """Decode on the split-KV kernel, the rest on ``fallback`` (a backend of the same spec).

    A decode plan keeps the metadata's device tensors and the kernel reads them at launch. For a
    graph bucket these are its persistent inputs (the graph-key policy, ``DecodeOverFallback``),
    its split count is fixed from the bucket's shape (batch, KV heads, ``max_seq_len``, SMs) and
    it owns its scratch and counters, since the captured launch reads their addresses at every
    replay. Eager steps share one scratch, grown on the host in ``plan``."""

    def __init__(
        self,
        spec: AttentionSpec,
        fallback: AttentionBackend,
        num_sms: int,
        min_seqs: int = 1,
        max_seqs: int | None = None,
    ) -> None:
        super().__init__(spec, fallback)
        reason = unsupported(spec)
        if reason is not None:
            raise ValueError(f"split-KV decode cannot run {reason}; use the fallback backend")
        if num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        if max_seqs is not None and max_seqs <= min_seqs:
            raise ValueError(f"max_seqs={max_seqs} must exceed min_seqs={min_seqs} (or be None)")
        self.num_sms, self.min_seqs, self.max_seqs = num_sms, min_seqs, max_seqs
        # decodes rotate inside the attention launch, other steps on the fallback: fused only
        # when both are
        self.fuses_rotary = fallback.fuses_rotary
        # Qwen3's q/k norms inside the same launch, for the decode steps it takes (the others
        # run qk_rms_norm in the layer, or whatever the fallback fuses)
        self.decode_fuses_qk_norm = self.fuses_rotary and env.cuda_fused_qk_norm()
        self._plans: dict[Hashable, _DecodePlan] = {}  # graph key -> its plan and scratch
        self._eager: kernel.Scratch | None = None

    def takes(self, m: AttentionMetadata) -> bool:
        """A pure decode (one query row per sequence) of ``min_seqs`` sequences or more, fewer
        than ``max_seqs``. A graph bucket's batch is a constant, so a bucket always runs on the
        same side."""
        return (
            super().takes(m)
            and m.num_seqs <= m.num_tokens
            and m.num_seqs >= self.min_seqs
            and (self.max_seqs is None or m.num_seqs < self.max_seqs)
        )

    def plan_decode(self, m: AttentionMetadata, graph_key: Hashable | None) -> _DecodePlan:
        s = self.spec
        if graph_key is not None and graph_key in self._plans:
            return self._plans[graph_key]
        splits = kernel.num_splits(
            m.num_seqs, s.num_kv_heads, s.group_size, s.head_dim, m.max_seq_len, self.num_sms
        )
        shape = (m.num_seqs, s.num_kv_heads, s.group_size, s.head_dim, splits)
        if graph_key is not None:
            scratch = kernel.Scratch.make(*shape, m.block_table.device)
        else:
            if self._eager is None or not self._eager.fits(m.num_seqs, s.num_kv_heads, splits):
                self._eager = kernel.Scratch.make(*shape, m.block_table.device)
            scratch = self._eager
        plan = _DecodePlan(
            m.num_seqs, m.block_table, m.kv_seq_lens, m.slot_mapping, splits, scratch
        )
        if graph_key is not None:
            self._plans[graph_key] = plan
        return plan

    def decode(self, plan: _DecodePlan, layer_id: int, q, k, v) -> torch.Tensor:
        # the KV write happens inside the attention launch (kernel.NewToken)
        new = kernel.NewToken(k, v, plan.slot_mapping)
        return self._attend(plan, q, self._caches[layer_id], new)

    def decode_rotary(self, plan: _DecodePlan, layer_id, q, k, v, positions, cos_sin_cache,
                      is_neox) -> torch.Tensor:  # fmt: skip
        # rotary and the KV write inside the attention launch: one launch for the layer's
        # decode attention (rotary_kv.py's launch before it measured in docs/h200-results.md)
        new = kernel.NewToken(k, v, plan.slot_mapping)
        rotary = kernel.Rotary(positions, cos_sin_cache, is_neox)
        return self._attend(plan, q, self._caches[layer_id], new, rotary)

    def decode_qk_norm(self, plan: _DecodePlan, layer_id, q, k, v, positions, cos_sin_cache,
                       is_neox, q_weight, k_weight, eps) -> torch.Tensor:  # fmt: skip
        # the q/k norm, rotary and the KV write inside the attention launch: no qk_rms_norm
        # launch before it (docs/h200-results.md, twelfth session)
        new = kernel.NewToken(k, v, plan.slot_mapping)
        rotary = kernel.Rotary(positions, cos_sin_cache, is_neox)
        norm = kernel.QKNorm(q_weight, k_weight, eps)
        return self._attend(plan, q, self._caches[layer_id], new, rotary, norm)

    def _attend(
        self,
        p: _DecodePlan,
        q: torch.Tensor,
        cache: LayerCache,
        new: kernel.NewToken,
        rotary: kernel.Rotary | None = None,
        qk_norm: kernel.QKNorm | None = None,
    ) -> torch.Tensor:
        # q: [T, H, D], one row per sequence first, then padding rows (left zero)
        s = self.spec
        out = self.padded_output(q, p.num_seqs)
        kernel.splitkv_decode(
            q[: p.num_seqs],
            cache.key,
            cache.value,
            p.block_table,
            self.unit_stride(p.kv_seq_lens),
            out[: p.num_seqs],
            p.scratch,
            p.splits,
            s.softmax_scale,
            s.logits_soft_cap or 0.0,
            s.sliding_window or 0,
            new=new,
            rotary=rotary,
            qk_norm=qk_norm,
        )
        return out
