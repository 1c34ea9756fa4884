"""Emulated ``torch_npu.npu_fused_infer_attention_score`` (FIA), its ``.out`` overload and
``_npu_fused_infer_attention_score_get_max_workspace``, registered with ``real_op``: the wheel's
schemas and FIA's meta function in front of the checks and numerics of ``fia_check.py``.

FIA is one custom op, so a captured graph records it as ONE entry whose host int lists
(``actual_seq_lengths``, ``actual_seq_lengths_kv``) are arguments of that entry: baked at capture,
replaced only by the graph update API (``graph.py``, ``task_update.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from . import binding, graph, task_update
from .fia_check import OP, attend, check, fail
from .registry import real_op

# schema arguments the emulation implements; every other one must stay at its schema default
_EMULATED = {
    "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads",
    "scale", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads", "sparse_mode",
    "block_size", "softmax_lse_flag", "inner_precise",
}
_OUTS = ("attention_out", "softmax_lse")


def _emulated_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    schema = npu_fused_infer_attention_score.schema
    for arg in schema.arguments:
        if arg.kwarg_only and arg.name not in _EMULATED and arg.name in kw:
            value = kw[arg.name]
            if isinstance(value, torch.Tensor) or value != arg.default_value:
                raise NotImplementedError(f"{OP}: argument {arg.name!r} (quantization, rope, "
                                          "shared prefix, padding, pse) is not emulated; leave it "
                                          f"at {arg.default_value!r}")
    if kw.get("inner_precise", 0) not in (0, 1, 2, 3):
        raise fail(f"inner_precise={kw['inner_precise']}; the doc: '一共4种模式: 0、1、2、3'")
    return {k: v for k, v in kw.items() if k in _EMULATED}


def _lse(kw: dict[str, Any], num_tokens: int, num_heads: int) -> torch.Tensor:
    # the meta function: (T, N, 1) float32 with softmax_lse_flag under TND, else an empty [0]
    # (the doc says a [1] zero tensor; the meta function is what the shapes are checked against)
    if kw.get("softmax_lse_flag", False):
        return torch.zeros(num_tokens, num_heads, 1, dtype=torch.float32)
    return torch.zeros(0, dtype=torch.float32)


def _fia(query, key, value, **kwargs):
    kw = _emulated_kwargs(kwargs)
    out, lse = attend(query, key, value, kw, check(query, key, value, kw))
    return out, lse if kw.get("softmax_lse_flag", False) else _lse(kw, 0, 0)


def _check_out(query, kw, attention_out, softmax_lse) -> None:
    if attention_out.shape != query.shape or attention_out.dtype != query.dtype:
        raise fail(f"attention_out is {attention_out.dtype} {tuple(attention_out.shape)}; the doc: "
                   "its shape is query's (TND), dtype query's")
    # the doc: softmaxLse '数据类型支持float32',
    # '当input_layout为TND时, 输出shape为(T,Q_N,1)的Tensor;
    # softmax_lse_flag为False时, 则输出shape为[1]的值为0的Tensor'
    flag = kw.get("softmax_lse_flag", False)
    shape = (*query.shape[:2], 1) if flag else (1,)
    if tuple(softmax_lse.shape) != shape or softmax_lse.dtype != torch.float32:
        raise fail(
            f"softmax_lse is {softmax_lse.dtype} {tuple(softmax_lse.shape)}, expected "
            f"float32 {shape} with softmax_lse_flag={flag}: the doc gives softmax_lse "
            "float32, (T, Q_N, 1) with the flag and [1] without"
        )


def _fia_out(query, key, value, *, workspace=None, attention_out, softmax_lse, **kwargs):
    kw = _emulated_kwargs(kwargs)
    _check_out(query, kw, attention_out, softmax_lse)
    out, lse = _fia(query, key, value, **kwargs)
    attention_out.copy_(out)
    if kw.get("softmax_lse_flag", False):
        softmax_lse.copy_(lse)
    else:
        softmax_lse.zero_()  # the doc: 'softmax_lse_flag为False时, 则输出shape为[1]的值为0的Tensor'
    return attention_out, softmax_lse


def _get_max_workspace(query, key, value, **kwargs):
    # the emulation needs no workspace: a 1-byte tensor (FIA's meta checks the arguments)
    kw = _emulated_kwargs(kwargs)
    check(query, key, value, kw)
    return torch.empty(1, dtype=torch.uint8)


def _dispatch(op: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Under ``graph_task_update_begin/end`` a call is queued as the new arguments of the captured
    one (and returns placeholders); otherwise it runs (and, under capture, is recorded)."""
    graph.check_recordable(OP)
    if not task_update.updating():
        return op(*args, **kwargs)
    task_update.reissue(op, args, kwargs)
    if "attention_out" in kwargs:
        return kwargs["attention_out"], kwargs["softmax_lse"]
    return torch.empty_like(args[0]), _lse(kwargs, *args[0].shape[:2])


npu_fused_infer_attention_score = real_op(
    "npu_fused_infer_attention_score", _fia, overloads={"out": _fia_out}, dispatch=_dispatch
)
_npu_fused_infer_attention_score_get_max_workspace = real_op(
    "_npu_fused_infer_attention_score_get_max_workspace",
    _get_max_workspace,
    meta_from="npu_fused_infer_attention_score",
)


def _validate(args: tuple, kw: dict[str, Any]) -> None:
    """Update-time check of a re-issued or updated FIA (graph.py, task_update.py): the new values
    bind to the schema (host int lists stay int lists) and pass the documented checks."""
    kw = dict(kw)
    outs = [kw.pop(name) for name in _OUTS if name in kw]
    overload = npu_fused_infer_attention_score.out if outs else npu_fused_infer_attention_score
    binding.bind(overload.schema, args, {**kw, **({"out": outs} if outs else {})})
    kw.pop("workspace", None)
    emulated = _emulated_kwargs(kw)
    check(*args, emulated)
    if outs:
        _check_out(args[0], emulated, *outs)


_NAME = f"npu_emu::{OP}"
graph.AUTO_DISPATCH_OPS.add(_NAME)
task_update.UPDATE_VALIDATORS[_NAME] = _validate
