"""Attention of one-token sequences (decodes) over their keys in three batched matrix calls:
every query head of a KV head's group against that head's keys at once. For float32 caches;
cheaper than SDPA at these sizes, whose CPU kernel sets up query blocks and threads for long
queries (a decode has one row per head). ``NativeDecode``: the same, with the layer's rotary and
KV write, in one native call (``kernels/decode_kernels.c``) for steps of few keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xhal.platforms.cpu_fast.kernels.native import library

if TYPE_CHECKING:
    from xhal.interfaces.attention import AttentionSpec


def one_token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """q ``[B, H, D]``; k, v ``[B * Hkv, L, D]``, sequence-major (views of the cache or one
    gather, any strides with unit channel stride); ``bias`` float32 ``[B * Hkv, 1, L]`` added to
    the scores (0 where visible, -inf where not) or None -> ``[B, H, D]`` float32. Query heads
    ``h`` of KV head ``h // (H / Hkv)`` are consecutive, so each group is one ``[G, D]`` matrix
    of q."""
    batch, heads, dim = q.shape
    groups = k.shape[0]  # B * Hkv
    q = q.reshape(groups, heads * batch // groups, dim)  # [B Hkv, G, D]
    # bmm then an in-place scale: baddbmm's alpha costs more than the product here
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # [B Hkv, G, L]
    if bias is not None:
        scores += bias
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(batch, heads, dim)


# a step's decodes go to the native kernel when their keys together are at most this many. Its
# (sequence, kv head) pairs run on torch's threads; against torch's batched products (2 threads,
# 9 heads over 3 KV heads of 64, us per layer, best of 60-200 calls on a loaded machine): 1 x 64
# keys 20 against 63, 8 x 96 150 against 247, 1 x 1000 176 against 209, 8 x 256 385 against 586,
# 8 x 1024 1111 against 5254, 1 x 4000 837 against 3488. Longer steps were not measured.
NATIVE_MAX_KEYS = 8192


class NativeDecode:
    """A decode-only step's host arrays in the layout ``xhal_decode_attention`` reads, with the
    spec's values, made once per step for every layer (token b is sequence b): each layer's
    call then checks only its own tensors' layout."""

    def __init__(
        self, slots: torch.Tensor, kv_rows: torch.Tensor, lens: torch.Tensor, spec: AttentionSpec
    ) -> None:
        # kept alive for the pointers: slots int64 [B] (-1: not written), kv_rows int64 [B, Lmax]
        # flat-cache rows of each sequence's keys, lens int64 [B] keys per sequence
        self._arrays = (slots.contiguous(), kv_rows.contiguous(), lens.long().contiguous())
        slots, kv_rows, lens = self._arrays
        self.num_seqs = lens.shape[0]
        self._step_args = (slots.data_ptr(), kv_rows.data_ptr(), lens.data_ptr(), kv_rows.shape[1])
        self._spec_args = (
            spec.sliding_window or 0, spec.softmax_scale, spec.logits_soft_cap or 0.0
        )
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # last checked pair

    @classmethod
    def build(
        cls, slots: torch.Tensor, kv_rows: torch.Tensor, lens: torch.Tensor, spec: AttentionSpec
    ) -> NativeDecode | None:
        """None when the native kernels are not built or the step is too long for them."""
        if library() is None or int(lens.sum()) > NATIVE_MAX_KEYS:
            return None
        return cls(slots, kv_rows, lens, spec)

    def _rotary_ok(self, positions: torch.Tensor, table: torch.Tensor, dim: int) -> bool:
        """int32 contiguous positions and a float32 contiguous table no wider than a head; the
        layers of a step pass the same pair, checked once."""
        if self._rotary is not None and self._rotary[0] is positions and self._rotary[1] is table:
            return True
        ok = (
            positions.dtype == torch.int32
            and positions.is_contiguous()
            and table.dtype == torch.float32
            and table.is_contiguous()
            and table.shape[1] <= dim
        )
        if ok:
            self._rotary = (positions, table)
        return ok

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
        is_neox: bool = True,
    ) -> torch.Tensor | None:
        """Rotate q and k (when ``cos_sin_cache`` is given), write k and v to the cache and
        attend: ``[B, H, D]`` float32, or None when the inputs are not laid out as the kernel
        reads them (float32, unit channel and head strides)."""
        lib = library()
        num_tokens, heads, dim = q.shape
        kv_strides = k.stride()
        if (
            lib is None
            or num_tokens != self.num_seqs
            or q.dtype != torch.float32
            or k.dtype != torch.float32
            or v.dtype != torch.float32
            or k_flat.dtype != torch.float32
            or q.stride()[1:] != (dim, 1)
            or kv_strides[1:] != (dim, 1)
            or v.stride() != kv_strides
        ):
            return None
        rotary_dim, cos_sin, position_ptr = 0, None, None
        if cos_sin_cache is not None:
            assert positions is not None
            if not self._rotary_ok(positions, cos_sin_cache, dim):
                return None
            rotary_dim, cos_sin = cos_sin_cache.shape[1], cos_sin_cache.data_ptr()
            position_ptr = positions.data_ptr()
        out = torch.empty(num_tokens, heads, dim)
        slots, kv_rows, lens, max_len = self._step_args
        window, scale, soft_cap = self._spec_args
        status = lib.xhal_decode_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), kv_strides[0], num_tokens,
            heads, k.shape[1], dim, position_ptr, cos_sin, rotary_dim, is_neox, slots,
            k_flat.data_ptr(), v_flat.data_ptr(), kv_rows, lens, max_len, window, scale,
            soft_cap, out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("cpu-fast's native decode attention could not allocate scratch")
        return out
