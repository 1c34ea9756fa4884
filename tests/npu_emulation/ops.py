"""Emulated torch_npu KV-cache writers (npu.md §1.1-1.2) and the DeviceOps kernels (npu.md §3).

Each op is a custom op (so a captured graph records it as one kernel that reads its index tensors
when it runs) with the documented Python signature in front, and checks its arguments as the
document says the real op does. FIA is in ``fia.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

_lib = torch.library.Library("npu_emu", "FRAGMENT")
for _schema in (
    "scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, str cache_mode) -> ()",
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_indices) -> ()",
    "scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)",
    "rms_norm(Tensor self, Tensor gamma, float epsilon) -> (Tensor, Tensor)",
    "add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon) -> (Tensor, Tensor, Tensor)",
    "swiglu(Tensor self, int dim) -> Tensor",
    "mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
    "int[]? mrope_section, str rotary_mode) -> (Tensor, Tensor)",
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox_style) -> ()",
    "top_k_top_p(Tensor logits, Tensor? p, Tensor? k) -> Tensor",
):
    _lib.define(_schema)


def _fail(op: str, msg: str) -> RuntimeError:
    return RuntimeError(f"{op}: {msg} [emulated torch_npu]")


# KV-cache writers (§1.1, §1.2) --------------------------------------------------------------------
def _scatter_slots(op: str, src: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                   unique: bool) -> None:
    """cache[slot // bs, slot % bs] = src[t]; negative slots are padding and skipped (§1.1)."""
    num_blocks, block_size = cache.shape[:2]
    keep = slots >= 0
    s = slots[keep].long()
    if s.numel() and int(s.max()) >= num_blocks * block_size:
        raise _fail(op, f"slot {int(s.max())} outside [0, {num_blocks * block_size})")
    if unique and s.unique().numel() != s.numel():
        raise _fail(op, "slot_mapping holds duplicate slots; they must be unique (§1.2)")
    cache[s // block_size, s % block_size] = src[keep]


def _check_cache_pair(op: str, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 3 or cache.dim() != 4 or tuple(cache.shape[2:]) != tuple(x.shape[1:]):
        raise _fail(op, f"key/value [T, N, D] {tuple(x.shape)} does not fit an ND cache "
                    f"[num_blocks, block_size, N, D] {tuple(cache.shape)}")
    if x.dtype != cache.dtype:
        raise _fail(op, f"input dtype {x.dtype} differs from cache dtype {cache.dtype}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise _fail(op, f"slot mapping {tuple(slots.shape)} must be [T={x.shape[0]}]")


@torch.library.impl(_lib, "scatter_pa_kv_cache", "CPU")
def _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, cache_mode):
    op = "npu_scatter_pa_kv_cache"
    if cache_mode == "PA_NZ":
        raise _fail(op, "cache_mode='PA_NZ' (the default) expects an NZ cache (num_blocks, "
                    "N*D//16, block_size, 16); pass cache_mode='Norm' for an ND cache (§1.2)")
    if cache_mode != "Norm":
        raise _fail(op, f"cache_mode={cache_mode!r}: the emulation knows 'Norm' (and 'PA_NZ')")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            raise _fail(op, f"{name} must be contiguous (§1.2)")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _check_cache_pair(op, key, key_cache, slot_mapping)
    _check_cache_pair(op, value, value_cache, slot_mapping)
    _scatter_slots(op, key, key_cache, slot_mapping, unique=True)
    _scatter_slots(op, value, value_cache, slot_mapping, unique=True)


def npu_scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, compress_lens: Tensor | None = None,
                            compress_seq_offsets: Tensor | None = None,
                            seq_lens: Tensor | None = None, cache_mode: str = "PA_NZ") -> None:
    """§1.2 (yaml:6950). -1 slots are skipped (§1.1, PR #11713); others unique, in range."""
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("npu_scatter_pa_kv_cache: compress_* / seq_lens are not emulated")
    torch.ops.npu_emu.scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                          cache_mode)


@torch.library.impl(_lib, "reshape_and_cache", "CPU")
def _reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    op = "_npu_reshape_and_cache"
    if slot_indices.dtype != torch.int32:
        raise _fail(op, f"slot_indices must be int32, got {slot_indices.dtype} (§1.2)")
    _check_cache_pair(op, key, key_cache, slot_indices)
    _check_cache_pair(op, value, value_cache, slot_indices)
    _scatter_slots(op, key, key_cache, slot_indices, unique=False)
    _scatter_slots(op, value, value_cache, slot_indices, unique=False)


def _npu_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                           slot_indices: Tensor) -> None:
    """§1.2 (ATB ReshapeAndCache): [T, N, D] into [nb, bs, N, D]; negative slots skipped."""
    torch.ops.npu_emu.reshape_and_cache(key, value, key_cache, value_cache, slot_indices)


@torch.library.impl(_lib, "scatter_nd_update_", "CPU")
def _scatter_nd_update_(self, indices, updates):
    op = "npu_scatter_nd_update_"
    if indices.dim() < 2 or indices.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"indices must be int32/int64 with at least 2 dims, got {indices.dtype} "
                    f"{tuple(indices.shape)} (§1.2)")
    depth = indices.shape[-1]
    expected = (*indices.shape[:-1], *self.shape[depth:])
    if not 1 <= depth <= self.dim() or tuple(updates.shape) != expected:
        raise _fail(op, f"updates {tuple(updates.shape)} must be {expected} for indices "
                    f"{tuple(indices.shape)} into {tuple(self.shape)}")
    if updates.dtype != self.dtype:
        raise _fail(op, f"updates dtype {updates.dtype} differs from self dtype {self.dtype}")
    idx = indices.reshape(-1, depth).long()
    bound = torch.tensor(self.shape[:depth])
    if idx.numel() and bool(((idx < 0) | (idx >= bound)).any()):
        raise _fail(op, "an index is out of range: this general scatter does NOT skip -1 padding "
                    "slots (§1.2 documents no skipping); filter or redirect them first")
    self[tuple(idx.T)] = updates.reshape(-1, *self.shape[depth:])
    return self


def npu_scatter_nd_update_(self: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """§1.2 (yaml:6935): in-place scatter of ``updates`` at index tuples ``indices[..., :]``."""
    return torch.ops.npu_emu.scatter_nd_update_(self, indices, updates)


# DeviceOps (§3) -----------------------------------------------------------------------------------
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
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)  # float32 (§3)
    return xf * rstd * gamma.float(), rstd


@torch.library.impl(_lib, "rms_norm", "CPU")
def _rms_norm(x, gamma, epsilon):
    _check_float("npu_rms_norm", x=x, gamma=gamma)
    y, rstd = _rms(x, gamma, epsilon, "npu_rms_norm")
    return y.to(x.dtype), rstd


def npu_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """§3 (yaml:6865): ``(y, rstd)``, rstd float32 with gamma's dims reduced to 1."""
    return torch.ops.npu_emu.rms_norm(x, gamma, epsilon)


@torch.library.impl(_lib, "add_rms_norm", "CPU")
def _add_rms_norm(x1, x2, gamma, epsilon):
    op = "npu_add_rms_norm"
    _check_float(op, x1=x1, x2=x2, gamma=gamma)
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise _fail(op, f"x1 {x1.dtype} {tuple(x1.shape)} and x2 {x2.dtype} "
                    f"{tuple(x2.shape)} differ")
    summed = x1.float() + x2.float()
    y, rstd = _rms(summed, gamma, epsilon, op)
    return y.to(x1.dtype), rstd, summed.to(x1.dtype)


def npu_add_rms_norm(
    x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6
) -> tuple[Tensor, Tensor, Tensor]:
    """§3 (yaml:5805): ``(y, rstd, x1 + x2)``; the inputs are not mutated."""
    return torch.ops.npu_emu.add_rms_norm(x1, x2, gamma, epsilon)


@torch.library.impl(_lib, "swiglu", "CPU")
def _swiglu(x, dim):
    _check_float("npu_swiglu", x=x)
    if not x.is_contiguous():
        raise _fail("npu_swiglu", "the input must be contiguous (§3)")
    if x.shape[dim] % 2:
        raise _fail("npu_swiglu", f"dim {dim} has odd size {x.shape[dim]}")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def npu_swiglu(x: Tensor, dim: int = -1) -> Tensor:
    """§3 (yaml:7014): ``silu(A) * B`` with ``A, B = x.chunk(2, dim)``."""
    return torch.ops.npu_emu.swiglu(x, dim)


# rotary (§3) --------------------------------------------------------------------------------------
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
                    f"{tuple(key.shape)} (§3)")
    if query.shape[1] % head_size or key.shape[1] % head_size or query.shape[0] != key.shape[0]:
        raise _fail(op, f"query {tuple(query.shape)} / key {tuple(key.shape)} are not "
                    f"[T, N*{head_size}]")
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > head_size:
        raise _fail(op, f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, rotary_dim] "
                    f"with an even rotary_dim <= head_size={head_size}")
    if positions.shape[-1] != query.shape[0]:
        raise _fail(op, f"positions {tuple(positions.shape)} do not cover T={query.shape[0]}")


@torch.library.impl(_lib, "mrope", "CPU")
def _mrope(positions, query, key, cos_sin_cache, head_size, mrope_section, rotary_mode):
    op = "npu_mrope"
    _check_rope(op, positions, query, key, cos_sin_cache, head_size)
    if rotary_mode not in ("half", "interleaved"):
        raise _fail(op, f"rotary_mode={rotary_mode!r}: 'half' (NeoX) or 'interleaved' (GPT-J)")
    rot = cos_sin_cache.shape[-1]
    if query.dtype in (torch.float16, torch.bfloat16) and (head_size % 32 or rot % 32):
        raise _fail(op, f"head_size={head_size}, rotary_dim={rot}: dims must be multiples of 32 "
                    "for float16/bfloat16 (§3)")
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    if mrope_section is None:
        if positions.dim() != 1:
            raise _fail(op, "positions must be [T] without mrope_section")
    else:  # [3, T]: section j of the rotary half takes its angle from position row j
        if positions.dim() != 2 or positions.shape[0] != 3 or sum(mrope_section) != rot // 2:
            raise _fail(op, f"mrope_section={mrope_section} needs positions [3, T] and sections "
                        f"summing to rotary_dim/2={rot // 2}")
        cos = torch.cat([c[j] for j, c in enumerate(cos.split(mrope_section, dim=-1))], dim=-1)
        sin = torch.cat([s[j] for j, s in enumerate(sin.split(mrope_section, dim=-1))], dim=-1)
    neox = rotary_mode == "half"
    return _rotate(query, head_size, cos, sin, neox), _rotate(key, head_size, cos, sin, neox)


def npu_mrope(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
              head_size: int, *, mrope_section: list[int] | None = None,
              rotary_mode: str = "half", cache_mode: str = "default") -> tuple[Tensor, Tensor]:
    """§3 (yaml:6895): out-of-place; 2-D q/k ``[T, N*D]``, cache ``[max_pos, rotary_dim]``."""
    if cache_mode != "default":
        raise NotImplementedError(f"npu_mrope: cache_mode={cache_mode!r} is not emulated")
    section = None if mrope_section is None else list(mrope_section)
    return torch.ops.npu_emu.mrope(positions, query, key, cos_sin_cache, head_size, section,
                                   rotary_mode)


@torch.library.impl(_lib, "rotary_embedding", "CPU")
def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    _check_rope("_npu_rotary_embedding", positions, query, key, cos_sin_cache, head_size)
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    query.copy_(_rotate(query, head_size, cos, sin, is_neox_style))
    key.copy_(_rotate(key, head_size, cos, sin, is_neox_style))


def _npu_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, head_size: int,
                          cos_sin_cache: Tensor,
                          is_neox_style: bool) -> None:
    """§3 (ATB RopeAtb.cpp:82): rotates 2-D q/k IN PLACE."""
    torch.ops.npu_emu.rotary_embedding(positions, query, key, head_size, cos_sin_cache,
                                       is_neox_style)


# sampling (§3) ------------------------------------------------------------------------------------
@torch.library.impl(_lib, "top_k_top_p", "CPU")
def _top_k_top_p(logits, p, k):
    op = "npu_top_k_top_p"
    _check_float(op, logits=logits)
    if logits.dim() != 2:
        raise _fail(op, f"logits must be 2-D [B, V], got {tuple(logits.shape)}")
    batch, vocab = logits.shape
    x = logits.float()
    if k is not None:
        if k.dtype != torch.int32 or tuple(k.shape) != (batch,):
            raise _fail(op, f"k must be int32 [B={batch}], got {k.dtype} {tuple(k.shape)}")
        if batch and (int(k.min()) < 1 or int(k.max()) > min(1024, vocab)):
            raise _fail(op, f"k values {k.tolist()} must lie in [1, 1024] and be <= V={vocab} (§3)")
        kth = x.sort(dim=-1, descending=True).values.gather(1, k.long()[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if p is not None:
        if p.dtype != logits.dtype or tuple(p.shape) != (batch,):
            raise _fail(op, f"p must be {logits.dtype} [B={batch}], got {p.dtype} {tuple(p.shape)}")
        probs, order = x.softmax(dim=-1).sort(dim=-1, descending=True)
        # keep a token while the mass ranked before it is below p: the top token always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= p.float()[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.to(logits.dtype)


def npu_top_k_top_p(logits: Tensor, p: Tensor | None = None, k: Tensor | None = None) -> Tensor:
    """§3 (yaml:7424): filtered logits set to -inf; k int32 [B] in [1, 1024], <= V."""
    return torch.ops.npu_emu.top_k_top_p(logits, p, k)
