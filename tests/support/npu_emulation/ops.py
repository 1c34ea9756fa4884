"""Emulated torch_npu KV-cache writers and DeviceOps kernels, each registered with ``real_op``
(``registry.py``): the wheel's schema and meta function in front of a CPU kernel that checks what
the op's official documentation (the wheel's ``_op_plugin_docs.py``; clauses quoted in
docs/npu-ops.md) states and computes in plain torch. A captured graph records each op as one
kernel that reads its index tensors when it runs. FIA is in ``fia.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import real_op

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _fail(op: str, msg: str) -> RuntimeError:
    return RuntimeError(f"{op}: {msg} [emulated torch_npu]")


# KV-cache writers ---------------------------------------------------------------------------------
def _scatter_slots(op: str, src: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                   skip_negative: bool) -> None:
    """cache[slot // bs, slot % bs] = src[t]."""
    num_blocks, block_size = cache.shape[:2]
    keep = slots >= 0 if skip_negative else torch.ones_like(slots, dtype=torch.bool)
    s = slots[keep].long()
    if s.numel() and (int(s.min()) < 0 or int(s.max()) >= num_blocks * block_size):
        raise _fail(op, f"slot_mapping holds {int(s.min())}..{int(s.max())}; the doc: "
                    f"'slot_mapping的值范围[0,num_blocks*block_size-1]' (here [0, "
                    f"{num_blocks * block_size - 1}]): a -1 padding slot is outside it, so the "
                    "caller must not pass one")
    rows = src[keep]
    order = torch.argsort(s, stable=True)
    s_sorted, rows_sorted = s[order], rows[order]
    dup = s_sorted[1:] == s_sorted[:-1]
    if bool(dup.any()) and not torch.equal(rows_sorted[1:][dup], rows_sorted[:-1][dup]):
        raise _fail(op, "slot_mapping repeats a slot with different values; the doc: "
                    "'slot_mapping内的元素值保证不重复，重复时不保证正确性' (no defined result)")
    cache[s // block_size, s % block_size] = rows


def _check_cache_pair(op: str, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 3 or cache.dim() != 4 or tuple(cache.shape[2:]) != tuple(x.shape[1:]):
        raise _fail(op, f"key/value [T, N, D] {tuple(x.shape)} does not fit an ND cache "
                    f"[num_blocks, block_size, N, D] {tuple(cache.shape)} (the doc's scenario 2)")
    if x.dtype != cache.dtype:
        raise _fail(op, f"input dtype {x.dtype} differs from cache dtype {cache.dtype}; the doc: "
                    "'key、value、key_cache、value_cache的数据类型必须一致'")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise _fail(op, f"slot mapping {tuple(slots.shape)} must be [T={x.shape[0]}]")


def _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                         compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    op = "npu_scatter_pa_kv_cache"
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError(f"{op}: compress_* / seq_lens (scenario 3) are not emulated")
    if cache_mode == "PA_NZ":
        raise _fail(op, "cache_mode='PA_NZ' (the default) takes an NZ cache; the doc: '当传None"
                    "或'Norm'时，仅支持ND内存排布格式' -- pass cache_mode='Norm' for an ND cache")
    if cache_mode not in ("Norm", None):
        raise _fail(op, f"cache_mode={cache_mode!r}: the doc knows None/'Norm' and 'PA_NZ'")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            raise _fail(op, f"{name} is not contiguous; the doc: '输入参数不支持非连续'")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _check_cache_pair(op, key, key_cache, slot_mapping)
    _check_cache_pair(op, value, value_cache, slot_mapping)
    _scatter_slots(op, key, key_cache, slot_mapping, skip_negative=False)
    _scatter_slots(op, value, value_cache, slot_mapping, skip_negative=False)


npu_scatter_pa_kv_cache = real_op("npu_scatter_pa_kv_cache", _scatter_pa_kv_cache)


def _reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    # ATB ReshapeAndCache: the wheel has its C++ declaration only (no doc, no meta function);
    # negative slots are skipped as ATB's kernel does (docs/npu-ops.md: unverified)
    op = "_npu_reshape_and_cache"
    if slot_indices.dtype != torch.int32:
        raise _fail(op, f"slot_indices must be int32, got {slot_indices.dtype}")
    _check_cache_pair(op, key, key_cache, slot_indices)
    _check_cache_pair(op, value, value_cache, slot_indices)
    _scatter_slots(op, key, key_cache, slot_indices, skip_negative=True)
    _scatter_slots(op, value, value_cache, slot_indices, skip_negative=True)


_npu_reshape_and_cache = real_op("_npu_reshape_and_cache", _reshape_and_cache)


def _scatter_nd_update_(self, indices, updates):
    op = "npu_scatter_nd_update_"
    if indices.dim() < 2 or indices.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"indices {indices.dtype} {tuple(indices.shape)}; the doc: 'indices至少是2"
                    "维', int32/int64")
    depth = indices.shape[-1]
    expected = (*indices.shape[:-1], *self.shape[depth:])
    if not 1 <= depth <= self.dim() or tuple(updates.shape) != expected:
        raise _fail(op, f"updates {tuple(updates.shape)} must be {expected} for indices "
                    f"{tuple(indices.shape)} into {tuple(self.shape)} (the doc: indices' shape "
                    "minus its last dim, plus input's shape after the first a dims)")
    if updates.dtype != self.dtype:
        raise _fail(op, f"updates dtype {updates.dtype} differs from input dtype {self.dtype}")
    idx = indices.reshape(-1, depth).long()
    bound = torch.tensor(self.shape[:depth])
    if idx.numel() and bool(((idx < 0) | (idx >= bound)).any()):
        raise _fail(op, "an index is out of range; the doc: 'indices中的索引数据不支持越界' -- "
                    "a -1 padding slot must be redirected or filtered first")
    self[tuple(idx.T)] = updates.reshape(-1, *self.shape[depth:])
    return self


npu_scatter_nd_update_ = real_op("npu_scatter_nd_update_", _scatter_nd_update_)


# DeviceOps ----------------------------------------------------------------------------------------
def _check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise _fail(op, f"{name} dtype {t.dtype} is not float16/bfloat16/float32")


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float, op: str):
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise _fail(op, f"gamma {tuple(gamma.shape)} must match the trailing dims of x "
                    f"{tuple(x.shape)}")
    xf = x.float()
    dims = tuple(range(-gamma.dim(), 0))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)  # float32 rstd output
    return xf * rstd * gamma.float(), rstd


def _rms_norm(x, gamma, epsilon=1e-6):
    op = "npu_rms_norm"
    _check_float(op, x=x, gamma=gamma)
    if gamma.dtype != x.dtype:
        raise _fail(op, f"gamma is {gamma.dtype}, self {x.dtype}; the doc: 'gamma：Tensor类型，"
                    "数据类型需要和self保持一致'")
    if not 2 <= x.dim() <= 8:
        raise _fail(op, f"self has {x.dim()} dims; the doc: '输入shape支持2-8维'")
    y, rstd = _rms(x, gamma, epsilon, op)
    return y.to(x.dtype), rstd


npu_rms_norm = real_op("npu_rms_norm", _rms_norm)


def _add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    # torch-npu 2.14.0 ships no doc for npu_add_rms_norm (only for its _cast/_quant variants);
    # the meta function fixes the outputs (y in x1's dtype, rstd float32, x1 + x2 in x1's dtype)
    op = "npu_add_rms_norm"
    _check_float(op, x1=x1, x2=x2, gamma=gamma)
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise _fail(op, f"x1 {x1.dtype} {tuple(x1.shape)} and x2 {x2.dtype} "
                    f"{tuple(x2.shape)} differ")
    summed = x1.float() + x2.float()
    y, rstd = _rms(summed, gamma, epsilon, op)  # the float32 sum is normalized (docs/npu-ops.md)
    return y.to(x1.dtype), rstd, summed.to(x1.dtype)


npu_add_rms_norm = real_op("npu_add_rms_norm", _add_rms_norm)


def _swiglu(x, dim=-1):
    op = "npu_swiglu"
    _check_float(op, x=x)
    if not 1 <= x.dim() <= 8:
        raise _fail(op, f"x has {x.dim()} dims; the doc: 'shape支持1-8维'")
    if x.shape[dim] % 2:
        raise _fail(op, f"dim {dim} has odd size {x.shape[dim]}: A and B are its two halves")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


npu_swiglu = real_op("npu_swiglu", _swiglu)


# rotary -------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, head_size: int, cos: torch.Tensor, sin: torch.Tensor,
            neox: bool) -> torch.Tensor:
    # x: [T, N * head_size]; cos, sin: [T, rotary_dim / 2] float32
    num_tokens, rot = x.shape[0], 2 * cos.shape[-1]
    xf = x.float().reshape(num_tokens, -1, head_size)
    c, s, r = cos[:, None, :], sin[:, None, :], xf[..., :rot]
    if neox:
        x1, x2 = r.chunk(2, dim=-1)
        r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        r = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([r, xf[..., rot:]], dim=-1).reshape(x.shape).to(x.dtype)


def _check_rope(op: str, positions, query, key, cos_sin_cache, head_size: int) -> None:
    if query.dim() != 2 or key.dim() != 2:
        raise _fail(op, f"query/key must be 2-D [T, N*head_size], got {tuple(query.shape)}, "
                    f"{tuple(key.shape)} (the doc: queryIn、keyIn、cosSinCache只支持2维shape输入)")
    if query.shape[1] % head_size or key.shape[1] % head_size or query.shape[0] != key.shape[0]:
        raise _fail(op, f"query {tuple(query.shape)} / key {tuple(key.shape)} are not "
                    f"[T, N*{head_size}]")
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > head_size:
        raise _fail(op, f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, rotary_dim] "
                    f"with an even rotary_dim <= head_size={head_size}")
    if positions.shape[-1] != query.shape[0]:
        raise _fail(op, f"positions {tuple(positions.shape)} do not cover T={query.shape[0]}")




ROPE_MODES = {"half": True, "interleave": False}  # the doc: 'half' NeoX, 'interleave' GPT-J


def _mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
           rotary_mode="half", cache_mode="default"):
    op = "npu_mrope"
    if cache_mode != "default":
        raise NotImplementedError(f"{op}: cache_mode={cache_mode!r} is not emulated")
    _check_rope(op, positions, query, key, cos_sin_cache, head_size)
    if rotary_mode not in ROPE_MODES:
        raise _fail(op, f"rotary_mode={rotary_mode!r}; the doc: ''half'表示rotate_half(GPT-NeoX "
                    "style)计算模式，'interleave'表示rotate_interleaved(GPT-J style)计算模式'")
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t.dtype not in _FLOATS:  # the doc lists the cache's dtypes apart from the query's
            raise _fail(op, f"{name} is {t.dtype}; the doc: 数据类型支持BFLOAT16、FLOAT16、FLOAT32")
    if positions.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"positions is {positions.dtype}; the doc: 数据类型支持INT32、INT64")
    rot = cos_sin_cache.shape[-1]
    multiple = 16 if query.dtype == torch.float32 else 32
    if rot % multiple:
        raise _fail(op, f"rotary_dim={rot} with {query.dtype} input; the doc: '当输入是BFLOAT16或"
                    "FLOAT16时，rotary_dim要求是32的倍数，当输入是FLOAT32时，rotary_dim要求是16的倍数'")
    if positions.numel() and int(positions.max()) >= cos_sin_cache.shape[0]:
        raise _fail(op, "a position is past the cache; the doc: '当输入tensor positions中值域超过"
                    "cosSinCache的0维maxSeqLen，会有越界报错'")
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    if mrope_section is None or list(mrope_section) == [0, 0, 0]:
        if positions.dim() != 1:
            raise _fail(op, "positions must be [T] without mrope_section (rope mode)")
    else:  # [3, T]: section j of the rotary half takes its angle from position row j
        if positions.dim() != 2 or positions.shape[0] != 3 or sum(mrope_section) != rot // 2:
            raise _fail(op, f"mrope_section={mrope_section}; the doc: mropeSection[0] + "
                        "mropeSection[1] + mropeSection[2] == rotary_dim/2, positions (3, T)")
        cos = torch.cat([c[j] for j, c in enumerate(cos.split(list(mrope_section), -1))], -1)
        sin = torch.cat([s[j] for j, s in enumerate(sin.split(list(mrope_section), -1))], -1)
    neox = ROPE_MODES[rotary_mode]
    return _rotate(query, head_size, cos, sin, neox), _rotate(key, head_size, cos, sin, neox)


npu_mrope = real_op("npu_mrope", _mrope)


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    # ATB RopeAtb: the wheel has its C++ declaration only (void, query/key written in place)
    _check_rope("_npu_rotary_embedding", positions, query, key, cos_sin_cache, head_size)
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    query.copy_(_rotate(query, head_size, cos, sin, is_neox_style))
    key.copy_(_rotate(key, head_size, cos, sin, is_neox_style))


_npu_rotary_embedding = real_op("_npu_rotary_embedding", _rotary_embedding)


# sampling -----------------------------------------------------------------------------------------
def _top_k_top_p(logits, p=None, k=None):
    op = "npu_top_k_top_p"
    _check_float(op, logits=logits)
    if logits.dim() != 2:
        raise _fail(op, f"logits must be 2-D [B, V], got {tuple(logits.shape)}")
    if p is None and k is None:
        raise _fail(op, "p and k are both None; the doc: '不支持p和k同时传None'")
    batch, vocab = logits.shape
    x = logits.float()
    if k is not None:
        if k.dtype != torch.int32 or tuple(k.shape) != (batch,):
            raise _fail(op, f"k must be int32 [B={batch}], got {k.dtype} {tuple(k.shape)}")
        if batch and (int(k.min()) < 1 or int(k.max()) > min(1024, vocab)):
            raise _fail(
                op,
                f"k values {k.tolist()}; the doc: '值域为[1, 1024]，且最大值需要小于等于"
                f"logits.size(1)' (V={vocab})",
            )
        # the doc's steps 2-4: the k-th largest value is the threshold, smaller ones are -inf
        kth = x.sort(dim=-1, descending=True).values.gather(1, k.long()[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if p is not None:
        if p.dtype != logits.dtype or tuple(p.shape) != (batch,):
            raise _fail(
                op,
                f"p must be {logits.dtype} [B={batch}], got {p.dtype} {tuple(p.shape)};"
                " the doc: '数据类型需要与logits一致'",
            )
        # steps 5-8: ascending cumulative probability <= 1 - p is dropped, the largest kept; the
        # same as keeping a token while the mass ranked above it is below p
        probs, order = x.softmax(dim=-1).sort(dim=-1, descending=True)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= p.float()[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.to(logits.dtype)


npu_top_k_top_p = real_op("npu_top_k_top_p", _top_k_top_p)
