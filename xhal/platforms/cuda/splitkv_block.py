"""Split-KV decode (``splitkv_attention.py``) whose one-sequence decode steps run each layer's
whole attention block (residual add, norm, qkv, q/k norm, rotary, KV write, attention, o) in one
persistent launch: ``kernels/attn_block.cu``. The ``native-block`` solution of
``paged_decode_attention``; every other step runs as ``triton-splitkv`` runs it.

The block is offered (``fuses_block``) for steps of one sequence on sm_90+ with a CUDA compiler,
for specs the kernel takes (fp16 / bf16, GQA groups up to 8, no sliding window or soft cap). A
call the kernel cannot take (operands it does not read, or a shape first met under graph capture,
where nothing can be built) is declined (``forward_block`` returns None), and the layer runs its
unfused sequence on this backend.
"""

from __future__ import annotations

import logging

import torch

from xhal.interfaces.attention import AttentionBackend, AttentionBlock, AttentionSpec
from xhal.platforms.cuda import native, pdl
from xhal.platforms.cuda.splitkv_attention import SplitKVDecodeAttention

logger = logging.getLogger(__name__)


def block_unsupported(spec: AttentionSpec) -> str | None:
    """Why the block kernel cannot serve ``spec``'s decode steps, or None when it can."""
    from xhal.platforms.cuda.kernels import attn_block

    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {spec.dtype}"
    if spec.group_size > attn_block.MAX_GROUP:
        return f"GQA group {spec.group_size} (at most {attn_block.MAX_GROUP})"
    if spec.sliding_window is not None or spec.logits_soft_cap is not None:
        return "a sliding window or a logits soft cap"
    if spec.head_dim % 8:
        return f"head_dim {spec.head_dim} (a multiple of 8)"
    return native.unavailable()


class SplitKVBlockAttention(SplitKVDecodeAttention):
    """``SplitKVDecodeAttention`` that also says ``fuses_block`` for one-sequence decode steps."""

    def __init__(
        self,
        spec: AttentionSpec,
        fallback: AttentionBackend,
        num_sms: int,
        min_seqs: int = 1,
        max_seqs: int | None = None,
    ) -> None:
        super().__init__(spec, fallback, num_sms, min_seqs, max_seqs)
        self._why_not = block_unsupported(spec)
        if self._why_not is not None:
            logger.info("attention block kernel off for %s: %s", spec, self._why_not)
        self._kernels: dict[torch.device, object] = {}
        self._launched: set[tuple] = set()  # shapes an eager call has built and launched

    @property
    def fuses_block(self) -> bool:
        return self._why_not is None and self._decode is not None and self._decode.num_seqs == 1

    def forward_block(
        self,
        layer_id: int,
        block: AttentionBlock,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel's ``(out, residual_out)``, or None when it cannot take this call."""
        from xhal.platforms.cuda.kernels import attn_block

        s, p, cache = self.spec, self._decode, self._caches[layer_id]
        qk = block.q_norm_weight is not None
        weights = (block.norm_weight, block.qkv_weight, block.o_weight)
        if qk:
            weights += (block.q_norm_weight, block.k_norm_weight)
        table = block.cos_sin_cache
        int32 = (positions, p.kv_seq_lens, p.slot_mapping, p.block_table)
        if (
            hidden.shape[0] != 1
            or any(t.dtype != torch.int32 or t.stride(-1) != 1 for t in int32)
            or table.dtype != torch.float32
            or not table.is_contiguous()
            or table.shape[1] > s.head_dim
            or not (cache.key.is_contiguous() and cache.value.is_contiguous())
            or not attn_block.supports(
                hidden, residual, weights, s.num_heads, s.num_kv_heads, s.head_dim
            )
        ):
            return None
        kernel = self._kernel(hidden.device)
        if kernel.plan_for(hidden.shape[1], s.num_heads, s.num_kv_heads, s.head_dim) is None:
            return None
        use_pdl = bool(pdl.mode(hidden.device))
        key = (hidden.shape[1], qk, table.shape[1], block.is_neox, use_pdl, hidden.device)
        if torch.cuda.is_current_stream_capturing() and key not in self._launched:
            return None  # nothing can be built under capture: the warm-up call builds it
        out = kernel(
            hidden, residual, block.norm_weight, block.norm_eps, block.qkv_weight,
            block.o_weight,
            (block.q_norm_weight, block.k_norm_weight, block.qk_norm_eps) if qk else None,
            table, block.is_neox, positions, cache.key, cache.value, p.block_table,
            p.kv_seq_lens, p.slot_mapping, s.num_heads, s.num_kv_heads, s.softmax_scale,
            use_pdl,
        )  # fmt: skip
        self._launched.add(key)
        return out

    def _kernel(self, device: torch.device):
        kernel = self._kernels.get(device)
        if kernel is None:
            from xhal.platforms.cuda.kernels.attn_block import AttentionBlockKernel

            kernel = self._kernels[device] = AttentionBlockKernel(device)
        return kernel
