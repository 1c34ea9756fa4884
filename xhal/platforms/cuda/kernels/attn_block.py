"""A decoder layer's attention block for one decode token (residual add, RMSNorm, qkv, Qwen3's
q/k norms, rotary, KV write, split-KV attention, o) in one persistent launch: ``attn_block.cu``
(what it computes and how), built by ``native.py``.

Why one launch: at batch 1 the block's three launches (norm + qkv GEMV, the split-KV attention
with rotary and the KV write inside, the o GEMV) each pay a ramp and a tail on a few microseconds
of work; the Llama-3.2-1B step spent about 23 us a layer on them against ~6 us of bytes
(docs/h200-results.md, fourteenth session: stream GEMV 6.4, split-KV 8.8, o 8.3). Here the qkv
weights and the first K / V tiles are requested before the wait for the kernel ahead, the o
weights stream while attention runs, and two grid barriers replace two launches.

Measured on an H100 (docs/h200-results.md, sixteenth session) it conforms but loses to that
chain: 23.0 against 18.6 us a layer at the 1B shape, 32.4 against 31.5 at Qwen3-30B-A3B's. After
the weights land, its barriers, the queries' round trip, attention and the merge form a latency
chain about as long as the launches it removes, and it gives up the overlap programmatic dependent
launch gave the chain (it and the MLP block each fill an SM's shared memory).

Shapes it takes (``plan``): one token, fp16 / bf16, head dims 64 and 128 (multiples of 8 in
general) with GQA groups up to 8, hidden sizes multiples of 8, no sliding window or soft cap,
int32 positions / lengths / slots / table; sm_90+.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from xhal.platforms.cuda import native

SOURCE = Path(__file__).with_name("attn_block.cu")
THREADS = 256
_WARPS = THREADS // 32
KV_TILE = 64
MAX_GROUP = 8
_MAX_STAGES = 8
_BARS_BYTES = 128
_SLOT_BYTES = (32768, 16384)  # a stage's room, widest first
_MAX_ROWS = 8  # weight rows per stage (the reduction's unrolled rows)


@dataclass(frozen=True)
class Plan:
    """A shape's layout: weight rows per qkv / o stage, the stage room and how many stages the
    ring holds, the attention splits per KV head, and the shared memory in all (bytes)."""

    rows1: int
    rows3: int
    slot_bytes: int
    stages: int
    splits: int
    shared_mem: int


def _rows(num_rows: int, row_bytes: int, slot_bytes: int) -> int:
    """The most rows of ``row_bytes`` a slot holds (at most ``_MAX_ROWS``) that divide
    ``num_rows``; 0 when not one row fits."""
    for rows in range(min(_MAX_ROWS, slot_bytes // row_bytes), 0, -1):
        if num_rows % rows == 0:
            return rows
    return 0


@functools.cache
def plan(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    max_shared_mem: int,
) -> Plan | None:
    """The widest stages that fit at least three deep beside the K / V tiles, or None.
    The layout of the shared memory is the kernel's: mbarriers, ring, tiles, fp32 scratch."""
    group = num_heads // num_kv_heads
    if (
        num_heads % num_kv_heads
        or group > MAX_GROUP
        or hidden % 8
        or head_dim % 8
        or num_sms < num_kv_heads
    ):
        return None
    splits = num_sms // num_kv_heads
    hd = num_heads * head_dim
    tiles = 4 * KV_TILE * head_dim * 2
    heads2 = group + 1
    max_rows = _MAX_ROWS
    scratch = 4 * (
        heads2 * head_dim + group * KV_TILE + 3 * group + heads2 + 1
        + 2 * _WARPS * max_rows + _WARPS
    )  # fmt: skip
    for slot_bytes in _SLOT_BYTES:
        rows1 = _rows((num_heads + 2 * num_kv_heads) * head_dim, hidden * 2, slot_bytes)
        rows3 = _rows(hidden, hd * 2, slot_bytes)
        if not rows1 or not rows3:
            continue
        room = max_shared_mem - _BARS_BYTES - tiles - scratch
        stages = min(_MAX_STAGES, room // slot_bytes)
        if stages >= 3:
            used = _BARS_BYTES + stages * slot_bytes + tiles + scratch
            return Plan(rows1, rows3, slot_bytes, stages, splits, used)
    return None


def supports(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> bool:
    """Whether the launch takes these operands: one row of ``hidden`` and ``residual``, and
    ``weights`` (norm, qkv, o and the q/k-norm weights when given) contiguous in its dtype on
    its device (the caller runs the sequence otherwise)."""
    if not native.takes_rows(hidden, 1) or residual.shape != hidden.shape:
        return False
    norm_w, w_qkv, w_o = weights[:3]
    size = hidden.shape[1]
    if norm_w.shape != (size,) or w_qkv.shape != ((num_heads + 2 * num_kv_heads) * head_dim, size):
        return False
    if w_o.shape != (size, num_heads * head_dim):
        return False
    if any(w.dtype != hidden.dtype or w.device != hidden.device for w in (*weights, residual)):
        return False
    if not all(w.is_contiguous() for w in weights):
        return False
    return native.chunk_aligned((hidden, residual), weights)


class AttentionBlockKernel:
    """The launches of one device: its kernels by shape, and per shape the scratch every launch
    of that shape shares (qkv, the splits' partials, the merged attention, the per-KV-head
    counters and the grid barriers' arrival count). Launches are stream-ordered: one stream at a
    time uses them."""

    def __init__(self, device: torch.device, timing: torch.Tensor | None = None) -> None:
        """``timing`` (int64 ``[SMs, 8]``, benchmarks only): each CTA's phase-boundary times
        (``%globaltimer``, ns), the kernel built with ``TIMING``."""
        self._kernels = native.KernelCache(SOURCE, "attn_block", device)
        self.timing = timing
        self.num_sms = self._kernels.num_sms
        self._scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def plan_for(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int):
        return plan(
            hidden, num_heads, num_kv_heads, head_dim, self.num_sms, self._kernels.max_shared_mem
        )

    def _shared(self, key: tuple, p: Plan, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
        scratch = self._scratch.get(key)
        if scratch is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("attn_block: a shape's scratch is made by an eager call first")
            group = num_heads // num_kv_heads
            items = num_kv_heads * p.splits
            f32 = dict(dtype=torch.float32, device=device)
            scratch = self._scratch[key] = (
                torch.empty((num_heads + 2 * num_kv_heads) * head_dim, **f32),  # qkv
                torch.empty(items * group * head_dim, **f32),  # the splits' outputs
                torch.empty(items * group * 2, **f32),  # their max and sum
                torch.empty(num_heads * head_dim, dtype=dtype, device=device),  # attn
                torch.zeros(num_kv_heads, dtype=torch.int64, device=device),  # group counts
                torch.zeros(1, dtype=torch.int64, device=device),  # the barriers' arrivals
            )
        return scratch

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        w_qkv: torch.Tensor,
        w_o: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        kv_seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        use_pdl: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual_out)`` for one token; ``supports`` said yes for the operands and
        ``plan_for`` gave a plan. The int32 tensors' first entries are the token's."""
        size = hidden.shape[1]
        head_dim = k_cache.shape[-1]
        p = self.plan_for(size, num_heads, num_kv_heads, head_dim)
        assert p is not None, "the caller checks plan_for first"
        page = k_cache.shape[1]
        defines = {
            "DTYPE_BF16": int(hidden.dtype == torch.bfloat16), "HIDDEN": size,
            "NUM_HEADS": num_heads, "NUM_KV": num_kv_heads, "HEAD_DIM": head_dim,
            "ROT_DIM": cos_sin_cache.shape[1], "NEOX": int(is_neox),
            "QK_NORM": int(qk_norm is not None), "SPLITS": p.splits, "PAGE": page,
            "ROWS1": p.rows1, "ROWS3": p.rows3, "STAGES": p.stages, "SLOT_BYTES": p.slot_bytes,
            "USE_PDL": int(use_pdl), "TIMING": int(self.timing is not None),
        }  # fmt: skip
        kernel = self._kernels.get(defines, p.shared_mem)
        key = (size, num_heads, num_kv_heads, head_dim, hidden.dtype)
        qkv, part_acc, part_ml, attn, counters, sync = self._shared(
            key, p, num_heads, num_kv_heads, head_dim, hidden.dtype, hidden.device
        )
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        residual_out = torch.empty_like(out)
        q_w, k_w, qk_eps = qk_norm if qk_norm is not None else (norm_weight, norm_weight, 0.0)
        tensors = (
            hidden, residual, norm_weight, w_qkv, q_w, k_w, cos_sin_cache, positions, k_cache,
            v_cache, block_table, kv_seq_lens, slot_mapping, w_o, out, residual_out, qkv,
            part_acc, part_ml, attn, counters, sync,
        )  # fmt: skip
        args = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        args += [ctypes.c_longlong(hidden.stride(0)), ctypes.c_longlong(residual.stride(0))]
        args += [ctypes.c_float(eps), ctypes.c_float(qk_eps), ctypes.c_float(scale)]
        args.append(ctypes.c_void_p(0 if self.timing is None else self.timing.data_ptr()))
        kernel.launch(self.num_sms, THREADS, args, use_pdl)
        return out, residual_out
