"""Paged attention on the CPU, planned once per step: vectorized KV writes (with the rotary
embedding fused in, its tables gathered once per step, q and k rotated together; a step of more
than ``MATRIX_TOKENS`` tokens rotated and written in one native pass), every
one-token sequence of the batch in one batched attention (``decode.py``; read in place when a
lone sequence's keys are consecutive cache rows), each longer sequence in one SDPA call, or, a
float32 prefill chunk (with a cached prefix or none; no window, no logit cap), in one native
causal attention (``kernels/prefill_attention.c``: 1.3-1.4x torch's CPU flash SDPA at 1,300
tokens here)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.cpu_fast.decode import NativeDecode, one_token_attention
from xhal.platforms.cpu_fast.kernels import calls
from xhal.platforms.cpu_fast.rotary import MATRIX_TOKENS, RotaryTables
from xhal.platforms.cpu_fast.scratch import Scratch


@dataclass(frozen=True)
class _Chunk:
    """One sequence with several new tokens: its q rows ``start:end``, the flat-cache rows of its
    ``kv_len`` keys, and its visibility mask (None: plain causal, no cached prefix, no window)."""

    start: int
    end: int
    kv_rows: torch.Tensor  # int64 [L]
    mask: torch.Tensor | None  # bool [Lq, L]


@dataclass(frozen=True)
class _Plan:
    """What every layer of one step reuses: built from host values once, in ``plan``."""

    write_rows: torch.Tensor | None  # int64 rows of k / v that are written (None: all of them)
    write_slots: torch.Tensor  # int64 flat-cache rows they go to
    slots: torch.Tensor  # int64 [T] every token's flat-cache row, -1 where not written
    decode_rows: torch.Tensor | None  # int64 [Bd] q rows of the one-token sequences
    decode_kv_rows: torch.Tensor | None  # int64 [Bd, Lmax] flat-cache rows, 0 where masked
    decode_mask: torch.Tensor | None  # bool [Bd, 1, 1, Lmax]; None: every key visible
    decode_bias: torch.Tensor | None  # float32 [Bd * Hkv, 1, Lmax]: 0 or -inf, as decode_mask
    decode_start: int | None  # a lone decode's keys are flat rows start..start+L-1: read in place
    decode_head_rows: torch.Tensor | None  # int64 [Bd * Hkv * Lmax] rows of the [N * Hkv, D] view
    chunks: tuple[_Chunk, ...]
    num_real_tokens: int  # rows past it are padding and come out as zeros
    decode_only: bool  # every row is a one-token sequence's, in order: no row shuffling needed
    native: NativeDecode | None  # a decode-only step for the native kernel (rotary, write, attend)


def _visible(kv_lens: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool ``[B, L]``: key position ``positions[j]`` is seen by the newest token of sequence b."""
    visible = positions[None] < kv_lens[:, None]
    if window > 0:
        visible &= positions[None] >= kv_lens[:, None] - window
    return visible


def _kv_rows(block_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat-cache rows (``block * block_size + offset``) of ``positions`` read by ``block_rows``."""
    return block_rows[..., positions // block_size] * block_size + positions % block_size


def _chunk(
    start: int, q_len: int, kv_len: int, block_row: torch.Tensor, spec: AttentionSpec
) -> _Chunk:
    positions = torch.arange(kv_len)
    kv_rows = _kv_rows(block_row, positions, spec.block_size)
    window = spec.sliding_window or 0
    mask = None
    if q_len != kv_len or window > 0:  # bottom-right causal over a cached prefix, or a window
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        mask = positions[None] <= q_pos
        if window > 0:
            mask &= q_pos - positions[None] < window
    return _Chunk(start, start + q_len, kv_rows, mask)


def make_plan(metadata: AttentionMetadata, spec: AttentionSpec) -> _Plan:
    """The step's plan from its host lengths, slot mapping and block table (all on the CPU)."""
    q_lens = metadata.q_seq_lens_host.tolist()
    kv_lens = metadata.kv_seq_lens_host.tolist()
    slots = metadata.slot_mapping.long().contiguous()
    written = slots >= 0
    write_rows = None if bool(written.all()) else written.nonzero().squeeze(1)
    write_slots = slots if write_rows is None else slots[write_rows]
    block_table = metadata.block_table.long()
    starts, decode, chunks = 0, [], []
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len == 1:
            decode.append((i, starts))
        elif q_len > 1:
            chunks.append(_chunk(starts, q_len, kv_len, block_table[i], spec))
        starts += q_len
    decode_rows = decode_kv_rows = decode_mask = decode_bias = decode_start = None
    decode_head_rows = None
    if decode:
        seqs = torch.tensor([i for i, _ in decode])
        decode_rows = torch.tensor([row for _, row in decode])
        lens = torch.tensor([kv_lens[i] for i, _ in decode])
        positions = torch.arange(int(lens.max()))
        visible = _visible(lens, positions, spec.sliding_window or 0)  # [Bd, Lmax]
        # rows past a sequence's length may name stale blocks: read row 0 there, masked anyway
        decode_kv_rows = _kv_rows(block_table[seqs], positions, spec.block_size).masked_fill(
            ~visible, 0
        )
        if not bool(visible.all()):
            decode_mask = visible[:, None, None, :]
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            decode_bias = bias.repeat_interleave(spec.num_kv_heads, dim=0)[:, None, :]
        elif len(decode) == 1:
            first = int(decode_kv_rows[0, 0])
            if torch.equal(decode_kv_rows[0], positions + first):  # consecutive blocks
                decode_start = first
        # each (sequence, KV head)'s keys as rows of the cache viewed [N * Hkv, D]: one gather
        # lands them in the [Bd * Hkv, Lmax, D] layout the batched products read
        heads = torch.arange(spec.num_kv_heads)[None, :, None]
        decode_head_rows = (decode_kv_rows[:, None, :] * spec.num_kv_heads + heads).view(-1)
    decode_only = not chunks and len(decode) == starts == metadata.num_tokens
    native = None
    if decode_only and decode:
        native = NativeDecode.build(slots, decode_kv_rows, lens, spec)
    return _Plan(
        write_rows,
        write_slots,
        slots,
        decode_rows,
        decode_kv_rows,
        decode_mask,
        decode_bias,
        decode_start,
        decode_head_rows,
        tuple(chunks),
        starts,
        decode_only,
        native,
    )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    spec: AttentionSpec,
) -> torch.Tensor:
    """q ``[B, H, Lq, D]``, k / v ``[B, Hkv, L, D]`` -> ``[B, H, Lq, D]`` in float32."""
    q, k, v = q.float(), k.float(), v.float()
    cap = spec.logits_soft_cap or 0.0
    if cap <= 0:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=spec.softmax_scale, enable_gqa=True
        )
    # SDPA has no logit cap: the same math spelled out, keys shared by each query head group
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * spec.softmax_scale  # [B, H, Lq, L]
    scores = cap * torch.tanh(scores / cap)
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q ``[T, H, D]`` and k ``[T, Hkv, D]`` as one ``[T, H + Hkv, D]`` view when k's heads
    follow q's in the same rows of one buffer (the q and k columns of a fused qkv projection, as
    the layers pass them), else None. (Same storage, not same ``_base``: views made under
    inference mode do not record their base.)"""
    num_tokens, heads, dim = q.shape
    if (
        q.dtype != k.dtype
        or k.shape[0] != num_tokens
        or q.stride()[1:] != (dim, 1)
        or k.stride()[1:] != (dim, 1)
        or (num_tokens > 1 and q.stride(0) != k.stride(0))  # one row: its stride is arbitrary
        or k.data_ptr() != q.data_ptr() + heads * dim * q.element_size()
        or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    ):
        return None
    return q.as_strided((num_tokens, heads + k.shape[1], dim), (q.stride(0), dim, 1))


class FastCpuAttention(AttentionBackend):
    """Paged attention for CPU tensors (``cpu-fast``), numerically the reference's (float32
    accumulation) by a different route.

    Requirements: CPU tensors; contiguous caches in the executor's layout ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` (each is read as ``[num_blocks * block_size, Hkv, D]``);
    float32 or bfloat16; any head dim, block size, GQA ratio, sliding window and logit cap. Eager
    only: the plan holds host-built index tensors sized by this step's lengths, so it declares no
    graph support (``plan`` refuses a ``graph_key``). Fuses rotary into the KV write: the step's
    rotation tables are built by the first layer and reused by the others (the layers of a step
    pass the same positions tensor and rope table; other ones get tables of their own).
    """

    reads_kv_cu_seq_lens = False
    fuses_rotary = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._plan: _Plan | None = None
        self._rotary: RotaryTables | None = None
        self._scratch = Scratch()  # a prefill's rotated q and k, read before forward returns

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        flat = []
        for layer_id, cache in enumerate(normalize_layer_caches(caches)):
            if not (cache.key.is_contiguous() and cache.value.is_contiguous()):
                raise ValueError(
                    f"cpu-fast attention reads layer {layer_id}'s cache as one flat row array: "
                    "allocate contiguous caches (ModelExecutor.allocate_kv_caches does)"
                )
            _, _, heads, dim = cache.key.shape
            flat.append((cache.key.view(-1, heads, dim), cache.value.view(-1, heads, dim)))
        self._flat = flat

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        if graph_key is not None:
            raise RuntimeError(
                "cpu-fast attention runs eagerly (capabilities.graphs is False): plan without a "
                "graph_key, or use the 'cpu' reference platform for graph runs"
            )
        self._plan = make_plan(metadata, self.spec)
        self._rotary = None  # positions change with the step

    def forward_rotary(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is not None and plan.native is not None:
            k_flat, v_flat = self._flat[layer_id]
            out = plan.native(q, k, v, k_flat, v_flat, positions, cos_sin_cache, is_neox)
            if out is not None:  # float32, as q
                return out
        if plan is not None and q.shape[0] > MATRIX_TOKENS:  # a prefill's rows: one native pass
            k_flat, v_flat = self._flat[layer_id]
            heads = q.shape[1]
            rotated = self._scratch.take(q.shape[0], (heads + k.shape[1]) * q.shape[2])
            rotated = rotated.view(q.shape[0], heads + k.shape[1], q.shape[2])
            if calls.rotary_write(
                q, k, v, positions, cos_sin_cache, is_neox, plan.slots, k_flat, v_flat, rotated
            ):  # k and v are in the cache now; the rotated rows are read before we return
                q, k = rotated[:, :heads], rotated[:, heads:]
                return self._attend_cached(plan, q, k, v, k_flat, v_flat)
        tables = self._rotary
        if tables is None or not tables.matches(positions, cos_sin_cache, is_neox):
            tables = RotaryTables.build(positions, cos_sin_cache, is_neox, q.shape[-1])
            self._rotary = tables
        qk = _joined(q, k)
        if qk is None:
            return self.forward(layer_id, tables.rotate(q), tables.rotate(k), v)
        rotated = tables.rotate(qk)  # [T, H + Hkv, D]: both in one call
        heads = q.shape[1]
        return self.forward(layer_id, rotated[:, :heads], rotated[:, heads:], v)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("FastCpuAttention.forward called before plan(metadata)")
        k_flat, v_flat = self._flat[layer_id]
        if plan.native is not None:
            out = plan.native(q, k, v, k_flat, v_flat)
            if out is not None:  # float32, as q
                return out
        if plan.write_rows is None:
            k_flat.index_copy_(0, plan.write_slots, k)
            v_flat.index_copy_(0, plan.write_slots, v)
        else:
            k_flat.index_copy_(0, plan.write_slots, k.index_select(0, plan.write_rows))
            v_flat.index_copy_(0, plan.write_slots, v.index_select(0, plan.write_rows))
        return self._attend_cached(plan, q, k, v, k_flat, v_flat)

    def _attend_cached(
        self,
        plan: _Plan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
    ) -> torch.Tensor:
        """The step's attention once k and v are in the cache."""
        if plan.decode_only:  # the common decode step: no padding, no prefill, rows in order
            return self._decode(q, k_flat, v_flat, plan).to(q.dtype)
        num_tokens = q.shape[0]
        padded = num_tokens > plan.num_real_tokens
        out = q.new_zeros(q.shape) if padded else q.new_empty(q.shape)  # [T, H, D]
        if plan.decode_rows is not None:
            od = self._decode(q.index_select(0, plan.decode_rows), k_flat, v_flat, plan)
            out.index_copy_(0, plan.decode_rows, od.to(out.dtype))
        # the native causal attention serves chunks with or without a cached prefix, not a
        # window or a logit cap
        native = not self.spec.sliding_window and not self.spec.logits_soft_cap
        for chunk in plan.chunks:
            rows = slice(chunk.start, chunk.end)
            if chunk.kv_rows.shape[0] == chunk.end - chunk.start and k.dtype == k_flat.dtype:
                # no cached prefix: its keys are this step's rows, just written (no gather)
                kc, vc = k[rows], v[rows]
            else:
                kc = k_flat.index_select(0, chunk.kv_rows)  # [L, Hkv, D]
                vc = v_flat.index_select(0, chunk.kv_rows)
            if native and calls.prefill_attention(
                q[rows], kc, vc, self.spec.softmax_scale, out[rows]
            ):
                continue
            qc = q[rows].transpose(0, 1)[None]  # [1, H, Lq, D]
            kc, vc = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]  # [1, Hkv, L, D]
            oc = _attend(qc, kc, vc, chunk.mask, chunk.mask is None, self.spec)  # [1, H, Lq, D]
            out[rows] = oc[0].transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """q ``[Bd, H, D]`` of the one-token sequences -> their outputs ``[Bd, H, D]`` (float32)."""
        rows = plan.decode_kv_rows  # [Bd, Lmax]
        assert rows is not None
        shape = (*rows.shape, *k_flat.shape[1:])  # [Bd, Lmax, Hkv, D]
        if k_flat.dtype == torch.float32 and not self.spec.logits_soft_cap:
            if plan.decode_start is not None:  # the keys in place: no gather
                start = plan.decode_start
                end = start + rows.shape[1]
                kd, vd = k_flat[start:end].transpose(0, 1), v_flat[start:end].transpose(0, 1)
            else:
                head_rows, dim = plan.decode_head_rows, k_flat.shape[-1]
                kd = k_flat.view(-1, dim).index_select(0, head_rows).view(-1, rows.shape[1], dim)
                vd = v_flat.view(-1, dim).index_select(0, head_rows).view(-1, rows.shape[1], dim)
            return one_token_attention(
                q.float(), kd, vd, self.spec.softmax_scale, plan.decode_bias
            )
        kd = k_flat.index_select(0, rows.view(-1)).view(shape).transpose(1, 2)  # [Bd, Hkv, Lmax, D]
        vd = v_flat.index_select(0, rows.view(-1)).view(shape).transpose(1, 2)
        return _attend(q.unsqueeze(2), kd, vd, plan.decode_mask, False, self.spec).squeeze(2)
