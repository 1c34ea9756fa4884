"""FIA argument checks and numerics, TND layout (npu.md §1.4; the op-plugin doc it cites is
``torch_npu-npu_fused_infer_attention_score.md``). Pure functions over already-typed arguments."""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch

OP = "npu_fused_infer_attention_score"
INT_MAX = 2147483647
MASK_SIZE = 2048
LAYOUTS = ("BSH", "BSND", "BNSD", "TND", "TND_NTD", "NTD_TND", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD",
           "BNSD_NBSD")  # §1.4 "Layouts"
_MASK_SHAPES = ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE))
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_DTYPES = (torch.float16, torch.bfloat16)


def fail(msg: str) -> RuntimeError:
    return RuntimeError(f"{OP}: {msg} [emulated torch_npu]")


def host_int_list(name: str, value: Any) -> list[int] | None:
    """§0, §1.3: ``actual_seq_lengths*`` are ``SymInt[]``: host Python ints, never tensors."""
    if value is None:
        return None
    bad = isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple))
    if not bad:
        bad = any(isinstance(v, (torch.Tensor, bool)) or not hasattr(v, "__index__") for v in value)
    if bad:
        is_seq = isinstance(value, (list, tuple))
        kind = "list with a non-int" if is_seq else type(value).__name__
        raise TypeError(
            f"{OP}(): argument '{name}' must be tuple of ints, not {kind}. FIA takes host int "
            "lists (SymInt[]) that a graph bakes at capture; build them on the host in plan() "
            "(npu.md §0, §1.4) [emulated torch_npu]"
        )
    return [operator.index(v) for v in value]


@dataclass(frozen=True)
class Plan:
    """What the checks derive: per sequence ``(q_start, q_end, kv_start, kv_len)``."""

    seqs: tuple[tuple[int, int, int, int], ...]
    num_kv_heads: int
    kv_layout: str  # "BnBsH" | "BnNBsD" | "TND"
    max_q_len: int
    sparse_mode: int  # effective: 0 when Q_S == 1 (§1.4: ignored there)


def check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]) -> Plan:
    """Raise as the real op would (RuntimeError) for arguments §1.4 rules out."""
    layout = kw.get("input_layout", "BSH")
    if layout not in LAYOUTS:
        raise fail(f"input_layout {layout!r} is not supported; supported: {list(LAYOUTS)}")
    if layout != "TND":
        raise NotImplementedError(f"{OP}: the emulation implements input_layout='TND' only, "
                                  f"got {layout!r}")
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise fail(f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype}: page "
                   "attention takes float16 or bfloat16, the same for all three (§1.4)")
    if query.dim() != 3:
        raise fail(f"TND query must be [T, N, D], got shape {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    if kw.get("num_heads", 1) != num_heads:
        raise fail(f"num_heads={kw.get('num_heads', 1)} but query has N={num_heads}")
    num_kv_heads = kw.get("num_key_value_heads", 0) or num_heads
    if num_heads % num_kv_heads or num_heads // num_kv_heads > 64 or num_heads > 256:
        raise fail(f"num_heads={num_heads}, num_key_value_heads={num_kv_heads}: the GQA ratio must "
                   "divide and be <= 64, N <= 256 (§1.4 'Other limits')")
    if head_dim > 512 or head_dim % 16:
        raise fail(f"head dim {head_dim}: D must be <= 512 and 16-aligned for float16/bfloat16")

    q_cu = kw.get("actual_seq_lengths")
    kv = kw.get("actual_seq_lengths_kv")
    if q_cu is None or kv is None:
        raise fail("TND needs both actual_seq_lengths and actual_seq_lengths_kv (§1.4 'TND')")
    num_seqs = len(q_cu)
    if not 1 <= num_seqs <= 4096 or len(kv) != num_seqs:
        raise fail(f"actual_seq_lengths has {num_seqs} entries and actual_seq_lengths_kv "
                   f"{len(kv)}: both give the batch (1..4096 sequences)")
    if q_cu[0] < 0 or any(b < a for a, b in zip(q_cu, q_cu[1:])):
        raise fail(f"actual_seq_lengths={q_cu} must be CUMULATIVE query lengths (non-decreasing, "
                   "no leading 0) under TND (§1.4 'TND')")
    if num_tokens != q_cu[-1]:
        raise fail(f"error 561002: TND needs query.shape[0] == actual_seq_lengths[-1], got "
                   f"{num_tokens} != {q_cu[-1]}; slice query or add a dummy sequence "
                   "(§1.4 'Padding')")
    q_starts = [0, *q_cu[:-1]]
    q_lens = [e - s for s, e in zip(q_starts, q_cu)]
    max_q_len = max(q_lens)

    if kw.get("block_table") is None:
        kv_layout, kv_starts, kv_lens = _check_dense_kv(key, value, kv, num_kv_heads, head_dim)
    else:
        kv_layout = _check_paged(key, value, kw, kv, num_kv_heads, head_dim, max_q_len)
        kv_starts, kv_lens = [0] * num_seqs, list(kv)
    sparse_mode = _check_sparse(kw, max_q_len)
    if sparse_mode in (3, 4):
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            if q_len > kv_len:
                raise fail(f"sequence {i}: q length {q_len} > kv length {kv_len}; with causal "
                           "masking the kv length includes this step's tokens")
    seqs = tuple(zip(q_starts, q_cu, kv_starts, kv_lens))
    return Plan(seqs, num_kv_heads, kv_layout, max_q_len, sparse_mode)


def _check_dense_kv(key, value, kv_cu, num_kv_heads, head_dim):
    # TND without page attention: kv lengths are cumulative like the q ones (§1.4 'TND')
    if key.shape != value.shape or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise fail(f"TND key/value must be [T_kv, {num_kv_heads}, {head_dim}], got "
                   f"{tuple(key.shape)}/{tuple(value.shape)}")
    if kv_cu[0] < 0 or any(b < a for a, b in zip(kv_cu, kv_cu[1:])) or kv_cu[-1] != key.shape[0]:
        raise fail(f"without block_table, actual_seq_lengths_kv={kv_cu} must be cumulative and "
                   f"end at key.shape[0]={key.shape[0]}")
    starts = [0, *kv_cu[:-1]]
    return "TND", starts, [e - s for s, e in zip(starts, kv_cu)]


def _check_paged(key, value, kw, kv_lens, num_kv_heads, head_dim, max_q_len) -> str:
    # §1.4 'Page attention' and §1.1: per-sequence kv lengths, cache BnBsH or BnNBsD
    block_size, table = kw.get("block_size", 0), kw["block_table"]
    if max_q_len > 1 and (block_size % 128 or not 128 <= block_size <= 512):
        raise fail(f"block_size={block_size}: with page attention and Q_S > 1 it must be a "
                   "multiple of 128 between 128 and 512 (§1.4 'Page attention', §1.1 #8480)")
    if not 0 < block_size <= 512:
        raise fail(f"block_size={block_size}: page attention needs 0 < block_size <= 512")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != len(kv_lens):
        raise fail(f"block_table must be int32 [B={len(kv_lens)}, max_blocks], got "
                   f"{table.dtype} {tuple(table.shape)}")
    if key.shape != value.shape:
        raise fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} caches differ in shape")
    if key.dim() == 3 and tuple(key.shape[1:]) == (block_size, num_kv_heads * head_dim):
        if num_kv_heads * head_dim > 65535:
            raise fail("KV_N * D > 65535 with a (blocknum, blocksize, H) cache")
        layout = "BnBsH"
    elif key.dim() == 4 and tuple(key.shape[1:]) == (num_kv_heads, block_size, head_dim):
        layout = "BnNBsD"
    else:
        raise fail(
            f"paged key/value {tuple(key.shape)}: expected (blocknum, {block_size}, "
            f"{num_kv_heads * head_dim}) [BnBsH] or (blocknum, {num_kv_heads}, {block_size}, "
            f"{head_dim}) [BnNBsD]; a [nb, bs, Hkv, D] cache is passed as cache.view(nb, bs, -1) "
            "(§1.1)"
        )
    if min(kv_lens) < 0:
        raise fail(f"actual_seq_lengths_kv={kv_lens} has a negative length")
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    if max(blocks) > table.shape[1]:
        i = blocks.index(max(blocks))
        raise fail(f"sequence {i} has kv length {kv_lens[i]} = {blocks[i]} blocks but block_table "
                   f"has {table.shape[1]} columns; under page attention actual_seq_lengths_kv are "
                   "PER-SEQUENCE lengths, not cumulative (§1.4)")
    if sum(blocks) > key.shape[0]:
        raise fail(f"actual_seq_lengths_kv={kv_lens} need {sum(blocks)} blocks, more than the "
                   f"{key.shape[0]} the cache has (per-sequence lengths, not cumulative)")
    return layout


def _check_sparse(kw: dict[str, Any], max_q_len: int) -> int:
    mode, mask = kw.get("sparse_mode", 0), kw.get("atten_mask")
    if max_q_len == 1:
        return 0  # §1.4: 'For Q_S=1 without rope, sparse_mode is ignored' (and so is the mask)
    if mode not in (0, 1, 2, 3, 4):
        raise fail(f"sparse_mode={mode}: only 0, 1, 2, 3, 4 are supported")
    if mode in (1, 2):
        raise fail(f"sparse_mode={mode} is not supported with TND: use 0 without a mask or 3 with "
                   "one (4 for a band)")
    if mode == 0:
        if mask is not None:
            raise fail("sparse_mode=0 with an atten_mask: non-causal attention passes no mask "
                       "(§1.4 'sparse_mode')")
        return 0
    if mask is None:
        raise fail(f"sparse_mode={mode} needs atten_mask, the compressed 2048x2048 "
                   "upper-triangular mask (1 = masked): torch.triu(torch.ones(2048, 2048), "
                   "diagonal=1).to(torch.int8) (§1.4 'sparse_mode')")
    if tuple(mask.shape) not in _MASK_SHAPES or mask.dtype not in _MASK_DTYPES:
        raise fail(f"sparse_mode={mode} atten_mask is {mask.dtype} {tuple(mask.shape)}; it must be "
                   "bool/int8/uint8 of shape (2048,2048), (1,2048,2048) or (1,1,2048,2048)")
    if not _is_compressed_causal(mask):
        raise fail("atten_mask is not the compressed causal mask triu(ones(2048, 2048), 1) (1 = "
                   "masked, lower triangle valid); the real op does not check and computes garbage")
    return mode


_EXPECTED_MASK: list[torch.Tensor] = []
_mask_ok: dict[int, tuple[weakref.ref, int, bool]] = {}  # id -> (tensor, version, verdict)


def _is_compressed_causal(mask: torch.Tensor) -> bool:
    hit = _mask_ok.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    if not _EXPECTED_MASK:
        _EXPECTED_MASK.append(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1))
    ok = torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), _EXPECTED_MASK[0])
    if len(_mask_ok) > 64:
        for key in [k for k, v in _mask_ok.items() if v[0]() is None]:
            del _mask_ok[key]
    _mask_ok[id(mask)] = (weakref.ref(mask), mask._version, ok)
    return ok


def _gather(cache: torch.Tensor, plan: Plan, table: torch.Tensor | None, i: int) -> torch.Tensor:
    """Sequence i's keys or values, ``[kv_len, Hkv, D]`` float32."""
    _, _, kv_start, kv_len = plan.seqs[i]
    if plan.kv_layout == "TND":
        return cache[kv_start:kv_start + kv_len].float()
    if plan.kv_layout == "BnNBsD":
        cache = cache.transpose(1, 2)  # [nb, bs, Hkv, D]
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    cache = cache.reshape(num_blocks, block_size, plan.num_kv_heads, -1)
    positions = torch.arange(kv_len)
    ids = table[i, : math.ceil(kv_len / block_size)].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise fail(f"block_table row {i} holds block ids outside [0, {num_blocks}); the real op "
                   "does not check them and reads arbitrary memory")
    return cache[ids[positions // block_size], positions % block_size].float()


def attend(query, key, value, kw: dict[str, Any], plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence attention in float32 -> (out [T, N, D] in query dtype, lse [T, N, 1] fp32)."""
    num_tokens, num_heads, _ = query.shape
    out = torch.zeros(num_tokens, num_heads, value.shape[-1] if plan.kv_layout == "TND"
                      else query.shape[-1], dtype=torch.float32)
    lse = torch.zeros(num_tokens, num_heads, 1, dtype=torch.float32)
    group, table = num_heads // plan.num_kv_heads, kw.get("block_table")
    scale = kw.get("scale", 1.0)
    for i, (q_start, q_end, _, kv_len) in enumerate(plan.seqs):
        q_len = q_end - q_start
        if q_len == 0 or kv_len == 0:  # empty kv: zero output (doc: 'fill all-zero output')
            continue
        keys = _gather(key, plan, table, i).repeat_interleave(group, dim=1)  # [L, N, D]
        values = _gather(value, plan, table, i).repeat_interleave(group, dim=1)
        scores = torch.einsum("qnd,knd->nqk", query[q_start:q_end].float(), keys) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)  # right-down aligned
        k_pos = torch.arange(kv_len).unsqueeze(0)
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)
        if plan.sparse_mode == 3:
            visible = k_pos <= q_pos
        elif plan.sparse_mode == 4:  # band: pre_tokens before the diagonal, next_tokens after
            pre, nxt = kw.get("pre_tokens", INT_MAX), kw.get("next_tokens", INT_MAX)
            visible = (k_pos >= q_pos - pre) & (k_pos <= q_pos + nxt)
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [N, q]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[q_start:q_end] = torch.einsum("nqk,knd->qnd", probs, values)
        lse[q_start:q_end, :, 0] = row_lse.transpose(0, 1)
    return out.to(query.dtype), lse
