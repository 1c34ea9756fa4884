"""FIA argument checks and numerics, TND layout, from the op's official documentation (the
wheel's ``_op_plugin_docs.py``, quoted in docs/npu-ops.md). Pure functions over arguments already
bound to the schema and passed by the wheel's meta function."""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

OP = "npu_fused_infer_attention_score"
INT_MAX = 2147483647
MASK_SIZE = 2048
LAYOUTS = ("BSH", "BSND", "BNSD", "TND", "TND_NTD", "NTD_TND", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD",
           "BNSD_NBSD")  # the layouts the meta function parses
_MASK_SHAPES = ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE))
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_DTYPES = (torch.float16, torch.bfloat16)


def fail(msg: str) -> RuntimeError:
    return RuntimeError(f"{OP}: {msg} [emulated torch_npu]")


@dataclass(frozen=True)
class Plan:
    """What the checks derive: per sequence ``(q_start, q_end, kv_start, kv_len)``."""

    seqs: tuple[tuple[int, int, int, int], ...]
    num_kv_heads: int
    kv_layout: str  # "BnBsH" | "BnNBsD" | "TND"
    max_q_len: int
    sparse_mode: int  # effective: 0 when Q_S == 1 (the doc: "Q_S为1且不带rope输入时该参数无效")


def check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]) -> Plan:
    """Raise as the real op would (RuntimeError) for arguments the FIA doc rules out."""
    layout = kw.get("input_layout", "BSH")
    if layout not in LAYOUTS:
        raise fail(f"input_layout {layout!r} is not supported; supported: {list(LAYOUTS)}")
    if layout != "TND":
        raise NotImplementedError(f"{OP}: the emulation implements input_layout='TND' only, "
                                  f"got {layout!r}")
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise fail(
            f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype}: page "
            "attention takes float16 or bfloat16 (the doc: "
            "'支持key、value数据类型为float16、bfloat16、int8'; int8 is not emulated), "
            "the same for all three"
        )
    if query.dim() != 3:
        raise fail(f"TND query must be [T, N, D], got shape {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    if kw.get("num_heads", 1) != num_heads:
        raise fail(f"num_heads={kw.get('num_heads', 1)} but query has N={num_heads}")
    num_kv_heads = kw.get("num_key_value_heads", 0) or num_heads
    if num_heads % num_kv_heads or num_heads // num_kv_heads > 64 or num_heads > 256:
        raise fail(
            f"num_heads={num_heads}, num_key_value_heads={num_kv_heads}: the GQA ratio must "
            "divide and be <= 64 (the doc: 'num_heads与num_key_value_heads的比值不能大于64'), "
            "N <= 256 ('支持N轴小于等于256')"
        )
    if head_dim > 512 or head_dim % 16:
        raise fail(
            f"head dim {head_dim}; the doc: '支持D轴小于等于512', '输入类型全为float16、"
            "bfloat16时, D轴需16对齐'"
        )

    q_cu = kw.get("actual_seq_lengths")
    kv = kw.get("actual_seq_lengths_kv")
    if q_cu is None or kv is None:
        raise fail(
            "TND needs both actual_seq_lengths and actual_seq_lengths_kv; the doc: '当query"
            "的input_layout为TND时, 该入参必须传入', 'page attention场景下, 必须传入"
            "actual_seq_lengths_kv'"
        )
    num_seqs = len(q_cu)
    if not 1 <= num_seqs <= 4096 or len(kv) != num_seqs:
        raise fail(
            f"actual_seq_lengths has {num_seqs} entries and actual_seq_lengths_kv "
            f"{len(kv)}: both give the batch (1..4096 sequences)"
        )
    if q_cu[0] < 0 or any(b < a for a, b in itertools.pairwise(q_cu)):
        raise fail(
            f"actual_seq_lengths={q_cu} must be CUMULATIVE query lengths under TND; the "
            "doc: '该入参中每个元素的值表示当前Batch与之前所有Batch的seqlen和, 因此后一个元素"
            "的值必须大于等于前一个元素的值, 且不能出现负值'"
        )
    if num_tokens != q_cu[-1]:
        raise fail(
            f"error 561002: TND needs query.shape[0] == actual_seq_lengths[-1], got "
            f"{num_tokens} != {q_cu[-1]}; slice query or add a dummy sequence "
            "(the meta function sizes the output by query)"
        )
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
                raise fail(
                    f"sequence {i}: q length {q_len} > kv length {kv_len}; with causal "
                    "masking the kv length includes this step's tokens"
                )
    seqs = tuple(zip(q_starts, q_cu, kv_starts, kv_lens))
    return Plan(seqs, num_kv_heads, kv_layout, max_q_len, sparse_mode)


def _check_dense_kv(key, value, kv_cu, num_kv_heads, head_dim):
    # TND without page attention: kv lengths are cumulative like the q ones (the doc: '在非PA场景
    # 下, 第b个值表示前b个Batch的S轴累加长度')
    if key.shape != value.shape or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise fail(
            f"TND key/value must be [T_kv, {num_kv_heads}, {head_dim}], got "
            f"{tuple(key.shape)}/{tuple(value.shape)}"
        )
    if (
        kv_cu[0] < 0
        or any(b < a for a, b in itertools.pairwise(kv_cu))
        or kv_cu[-1] != key.shape[0]
    ):
        raise fail(
            f"without block_table, actual_seq_lengths_kv={kv_cu} must be cumulative and "
            f"end at key.shape[0]={key.shape[0]}"
        )
    starts = [0, *kv_cu[:-1]]
    return "TND", starts, [e - s for s, e in zip(starts, kv_cu)]


def _check_paged(key, value, kw, kv_lens, num_kv_heads, head_dim, max_q_len) -> str:
    # the doc's 'page attention场景': per-sequence kv lengths ('在PA场景下, 其长度等于key/value
    # 的Batch值, 代表每个Batch的实际长度'), cache (blocknum, blocksize, H) or (blocknum, KV_N,
    # blocksize, D)
    block_size, table = kw.get("block_size", 0), kw["block_table"]
    if max_q_len > 1 and (block_size % 128 or not 128 <= block_size <= 512):
        raise fail(
            f"block_size={block_size} with Q_S > 1: page attention needs a multiple of 128 "
            "in [128, 512]; the doc: '在使能page attention场景下, "
            "block_size最小为128, 最大为512, 且要求是128的倍数'"
        )
    if not 0 < block_size <= 512 or block_size % 16:
        raise fail(
            f"block_size={block_size} with Q_S = 1: it must be a non-zero multiple of 16, at "
            "most 512 (fp16/bf16); the doc: 'block_size需要传入非0值，且最大"
            "不超过512, key、value输入类型为float16、bfloat16时需要16对齐'"
        )
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != len(kv_lens):
        raise fail(
            f"block_table must be int32 [B={len(kv_lens)}, max_blocks], got "
            f"{table.dtype} {tuple(table.shape)}"
        )
    if key.shape != value.shape:
        raise fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} caches differ in shape")
    if key.dim() == 3 and tuple(key.shape[1:]) == (block_size, num_kv_heads * head_dim):
        if num_kv_heads * head_dim > 65535:
            raise fail(
                f"KV_N * D = {num_kv_heads * head_dim} with a (blocknum, blocksize, H) "
                "cache; the doc: '当输入kv cache排布格式为(blocknum, blocksize, H), 且KV_N*D"
                "超过65535时, 受硬件指令约束, 会被拦截报错' -- use (blocknum, KV_N, blocksize, D)"
            )
        layout = "BnBsH"
    elif key.dim() == 4 and tuple(key.shape[1:]) == (num_kv_heads, block_size, head_dim):
        layout = "BnNBsD"
    else:
        raise fail(
            f"paged key/value {tuple(key.shape)}: expected (blocknum, {block_size}, "
            f"{num_kv_heads * head_dim}) [BnBsH] or (blocknum, {num_kv_heads}, {block_size}, "
            f"{head_dim}) [BnNBsD] (the doc: '当query的input_layout为BNSD、TND时, kv cache排布支持"
            "(blocknum, blocksize, H)和(blocknum, KV_N, blocksize, D)两种格式'); "
            "a [nb, bs, Hkv, D] cache is passed as cache.view(nb, bs, -1)"
        )
    if min(kv_lens) < 0:
        raise fail(f"actual_seq_lengths_kv={kv_lens} has a negative length")
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    if max(blocks) > table.shape[1]:
        i = blocks.index(max(blocks))
        raise fail(
            f"sequence {i} has kv length {kv_lens[i]} = {blocks[i]} blocks but block_table "
            f"has {table.shape[1]} columns; under page attention actual_seq_lengths_kv are "
            "PER-SEQUENCE lengths, not cumulative; the doc: 'block_table ... 第二维长度不能"
            "小于maxBlockNumPerSeq', '在PA场景下, 其长度等于key/value的Batch值, 代表每个Batch"
            "的实际长度'"
        )
    if sum(blocks) > key.shape[0]:
        raise fail(
            f"actual_seq_lengths_kv={kv_lens} need {sum(blocks)} blocks, more than the "
            f"{key.shape[0]} the cache has; the doc: 'blocknum不能小于根据actual_seq_lengths_kv"
            "和blockSize计算的每个batch的block数量之和' (per-sequence lengths, not cumulative)"
        )
    return layout


def _check_sparse(kw: dict[str, Any], max_q_len: int) -> int:
    mode, mask = kw.get("sparse_mode", 0), kw.get("atten_mask")
    if max_q_len == 1:
        # the doc: sparse_mode 'Q_S为1且不带rope输入时该参数无效', pre/next_tokens 'Q_S为1时该参数
        # 无效': one query per sequence is the decode (IncreFlashAttention) branch, no mask
        return 0
    if mode not in (0, 1, 2, 3, 4):
        raise fail(f"sparse_mode={mode}: only 0, 1, 2, 3, 4 are supported")
    if mode in (1, 2):
        raise fail(
            f"sparse_mode={mode} under TND; the doc's TND limits: 'sparse模式仅支持sparse=0"
            "且不传mask, 或sparse=3且传入mask', 'sparse模式支持sparse_mode=4且传入mask'"
        )
    if mode == 0:
        if mask is not None:
            raise fail(
                "sparse_mode=0 with an atten_mask under TND: non-causal attention passes no mask; "
                "the doc: '仅支持sparse=0且不传"
                "mask'"
            )
        return 0
    if mask is None:
        raise fail(
            f"sparse_mode={mode} needs atten_mask, the compressed 2048x2048 "
            "upper-triangular mask (1 = masked): torch.triu(torch.ones(2048, 2048), "
            "diagonal=1).to(torch.int8); the doc: 'sparse_mode=2、3、4时, ... 不传入atten_mask"
            "或者传入的shape不正确报错'"
        )
    if tuple(mask.shape) not in _MASK_SHAPES or mask.dtype not in _MASK_DTYPES:
        raise fail(
            f"sparse_mode={mode} atten_mask is {mask.dtype} {tuple(mask.shape)}; it must be "
            "bool/int8/uint8 of shape (2048,2048), (1,2048,2048) or (1,1,2048,2048) (the "
            "doc: 'S的值需要固定为2048')"
        )
    if not _is_compressed_causal(mask):
        raise fail(
            "atten_mask is not the compressed causal mask triu(ones(2048, 2048), 1) (1 = "
            "masked, lower triangle valid); the real op does not check and computes garbage"
        )
    return mode


_EXPECTED_MASK: list[torch.Tensor] = []
_mask_ok: dict[int, tuple[weakref.ref, int, bool]] = {}  # id -> (tensor, version, verdict)


def _is_compressed_causal(mask: torch.Tensor) -> bool:
    # an inference tensor (a mask made under torch.inference_mode) has no version counter to
    # tell an in-place change by: checked at every call
    version = None if mask.is_inference() else mask._version
    hit = _mask_ok.get(id(mask))
    if version is not None and hit is not None and hit[0]() is mask and hit[1] == version:
        return hit[2]
    if not _EXPECTED_MASK:
        _EXPECTED_MASK.append(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1))
    ok = torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), _EXPECTED_MASK[0])
    if len(_mask_ok) > 64:
        for key in [k for k, v in _mask_ok.items() if v[0]() is None]:
            del _mask_ok[key]
    if version is not None:
        _mask_ok[id(mask)] = (weakref.ref(mask), version, ok)
    return ok


def _gather(cache: torch.Tensor, plan: Plan, table: torch.Tensor | None, i: int) -> torch.Tensor:
    """Sequence i's keys or values, ``[kv_len, Hkv, D]`` float32."""
    _, _, kv_start, kv_len = plan.seqs[i]
    if plan.kv_layout == "TND":
        return cache[kv_start : kv_start + kv_len].float()
    if plan.kv_layout == "BnNBsD":
        cache = cache.transpose(1, 2)  # [nb, bs, Hkv, D]
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    cache = cache.reshape(num_blocks, block_size, plan.num_kv_heads, -1)
    positions = torch.arange(kv_len)
    ids = table[i, : math.ceil(kv_len / block_size)].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise fail(
            f"block_table row {i} holds block ids outside [0, {num_blocks}); the real op "
            "does not check them and reads arbitrary memory"
        )
    return cache[ids[positions // block_size], positions % block_size].float()


def attend(query, key, value, kw: dict[str, Any], plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence attention in float32 -> (out [T, N, D] in query dtype, lse [T, N, 1] fp32)."""
    num_tokens, num_heads, _ = query.shape
    out = torch.zeros(
        num_tokens,
        num_heads,
        value.shape[-1] if plan.kv_layout == "TND" else query.shape[-1],
        dtype=torch.float32,
    )
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
