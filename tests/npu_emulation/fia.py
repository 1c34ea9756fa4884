"""Emulated ``torch_npu.npu_fused_infer_attention_score`` (FIA) and its ``.out`` variant
(npu.md §1.3 schema, §1.4 semantics, §2.2 capture protocol).

FIA is a custom op, so a captured graph records it as ONE entry whose host int lists
(``actual_seq_lengths``, ``actual_seq_lengths_kv``) are arguments of that entry: baked at capture,
replaced only by the graph update API (``graph.py``). Checks and numerics live in ``fia_check.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import graph, task_update
from .fia_check import INT_MAX, OP, attend, check, fail, host_int_list

# §1.3 schema: keyword arguments the emulation implements, with their defaults
_EMULATED: dict[str, Any] = {
    "atten_mask": None, "actual_seq_lengths": None, "actual_seq_lengths_kv": None,
    "block_table": None, "num_heads": 1, "scale": 1.0, "pre_tokens": INT_MAX,
    "next_tokens": INT_MAX, "input_layout": "BSH", "num_key_value_heads": 0, "sparse_mode": 0,
    "block_size": 0, "softmax_lse_flag": False,
}
# §1.3 schema: the rest, accepted only at their defaults (quantization, rope, prefixes, padding)
_NOT_EMULATED: dict[str, Any] = {
    name: None for name in (
        "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
        "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
        "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
        "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
        "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale",
    )
} | {"antiquant_mode": 0, "key_antiquant_mode": 0, "value_antiquant_mode": 0}
_HOST_LISTS = ("actual_seq_lengths", "actual_seq_lengths_kv")

_ARGS = (
    "Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
    "int[]? actual_seq_lengths=None, int[]? actual_seq_lengths_kv=None, Tensor? block_table=None, "
    "int num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
    "str input_layout='BSH', int num_key_value_heads=0, int sparse_mode=0, int block_size=0, "
    "bool softmax_lse_flag=False"
)
_lib = torch.library.Library("npu_emu", "FRAGMENT")
_lib.define(f"fia({_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"fia_out({_ARGS}, Tensor? workspace=None, Tensor(a!) attention_out, "
            "Tensor(b!) softmax_lse) -> ()")


def _lse_placeholder(kw: dict[str, Any], num_tokens: int, num_heads: int) -> torch.Tensor:
    # §1.3 doc: (T, N, 1) float32 with softmax_lse_flag, else a [1] tensor holding 0
    if kw.get("softmax_lse_flag", False):
        return torch.zeros(num_tokens, num_heads, 1, dtype=torch.float32)
    return torch.zeros(1, dtype=torch.float32)


@torch.library.impl(_lib, "fia", "CPU")
def _fia(query, key, value, **kw):
    out, lse = attend(query, key, value, kw, check(query, key, value, kw))
    return out, lse if kw.get("softmax_lse_flag", False) else _lse_placeholder(kw, 0, 0)


def _check_out(query, kw, attention_out, softmax_lse) -> None:
    if attention_out.shape != query.shape or attention_out.dtype != query.dtype:
        raise fail(f"attention_out is {attention_out.dtype} {tuple(attention_out.shape)}, expected "
                   f"{query.dtype} {tuple(query.shape)}")
    lse = _lse_placeholder(kw, *query.shape[:2])
    if kw.get("softmax_lse_flag", False) and (softmax_lse.shape != lse.shape
                                              or softmax_lse.dtype != torch.float32):
        raise fail(f"softmax_lse is {softmax_lse.dtype} {tuple(softmax_lse.shape)}, expected "
                   f"float32 {tuple(lse.shape)} with softmax_lse_flag=True")


@torch.library.impl(_lib, "fia_out", "CPU")
def _fia_out(query, key, value, *, workspace=None, attention_out, softmax_lse, **kw):
    _check_out(query, kw, attention_out, softmax_lse)
    out, lse = _fia(query, key, value, **kw)
    attention_out.copy_(out)
    if kw.get("softmax_lse_flag", False):
        softmax_lse.copy_(lse)
    else:
        softmax_lse.zero_()


def _validate(args: tuple, kw: dict[str, Any]) -> None:
    """Update-time check of a re-issued or updated FIA (graph.py, task_update.py)."""
    kw = dict(kw)
    for name in _HOST_LISTS:
        kw[name] = host_int_list(name, kw.get(name))
    extra = {k: kw.pop(k) for k in ("workspace", "attention_out", "softmax_lse") if k in kw}
    check(*args, kw)
    if "attention_out" in extra:
        _check_out(args[0], kw, extra["attention_out"], extra["softmax_lse"])


graph.AUTO_DISPATCH_OPS.update({"npu_emu::fia", "npu_emu::fia_out"})
task_update.UPDATE_VALIDATORS.update({"npu_emu::fia": _validate, "npu_emu::fia_out": _validate})


def _op_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The emulated keyword arguments the caller passed; typed as the real binding types them."""
    for name, value in kwargs.items():
        if name not in _EMULATED and name not in _NOT_EMULATED and name != "inner_precise":
            raise TypeError(f"{OP}() got an unexpected keyword argument '{name}' [emulated]")
        default = _NOT_EMULATED.get(name)
        if name in _NOT_EMULATED and (isinstance(value, torch.Tensor) or value != default):
            raise NotImplementedError(f"{OP}: argument {name!r} is not emulated; leave it at "
                                      f"{_NOT_EMULATED[name]!r}")
    if kwargs.get("inner_precise", 0) not in (0, 1, 2, 3):
        raise fail(f"inner_precise={kwargs['inner_precise']} must be 0, 1, 2 or 3")
    kw = {k: v for k, v in kwargs.items() if k in _EMULATED}
    for name in _HOST_LISTS:
        if name in kw:
            kw[name] = host_int_list(name, kw[name])
    return kw


def npu_fused_infer_attention_score(
    query: Tensor, key: Tensor, value: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """§1.3: ``(query, key, value, *, ...) -> (attention_out, softmax_lse)``; TND only."""
    kw = _op_kwargs(kwargs)
    graph.check_recordable(OP)
    if task_update.updating():
        task_update.reissue(torch.ops.npu_emu.fia.default, (query, key, value), kw)
        return torch.empty_like(query), _lse_placeholder(kw, *query.shape[:2])
    return torch.ops.npu_emu.fia(query, key, value, **kw)


def _npu_fused_infer_attention_score_out(
    query: Tensor, key: Tensor, value: Tensor, *, workspace: Tensor | None = None,
    out: list[Tensor] | None = None, **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """§1.3 ``.out``: the same arguments plus ``workspace=None`` and
    ``out=[attention_out, softmax_lse]``."""
    if not (isinstance(out, (list, tuple)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"{OP}.out needs out=[attention_out, softmax_lse] [emulated]")
    kw = _op_kwargs(kwargs)
    kw |= {"workspace": workspace, "attention_out": out[0], "softmax_lse": out[1]}
    graph.check_recordable(f"{OP}.out")
    if task_update.updating():
        task_update.reissue(torch.ops.npu_emu.fia_out.default, (query, key, value), kw)
    else:
        torch.ops.npu_emu.fia_out(query, key, value, **kw)
    return out[0], out[1]


npu_fused_infer_attention_score.out = _npu_fused_infer_attention_score_out  # type: ignore


def _npu_fused_infer_attention_score_get_max_workspace(
    query: Tensor, key: Tensor, value: Tensor, **kwargs: Any
) -> Tensor:
    """§1.3: a workspace for ``.out`` (the emulation needs none: a 1-byte tensor)."""
    _op_kwargs(kwargs)
    return torch.empty(1, dtype=torch.uint8)
