"""Emulated torch_npu mixture-of-experts ops: gating top-k softmax, init routing, expert token
counts, grouped matmul and finalize routing, from their documentation in the torch-npu 2.14.0
wheel (``torch_npu/_op_plugin_docs.py``).

Each op is a custom op of the ``npu_emu`` namespace (a captured graph records it as one kernel)
behind a Python function with the real signature, and checks its arguments as the documentation
says the real op does. ``REAL_SCHEMAS`` holds each op's schema string exactly as the wheel's
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` declares it, so the emulation can be
bound to the real schema later. Only the paths the NPU backend uses are emulated (no
quantization, no drop/pad mode, grouped matmul's single-tensor m-grouped case); anything else
raises naming what is supported.

Not documented, and chosen here: the gating op's order among equal probabilities (the lower expert
first, the order ``DeviceOps.moe_route`` promises) and init routing's order within one expert
(stable in row-major order of ``expert_idx``).
"""

from __future__ import annotations

import torch
from torch import Tensor

REAL_SCHEMAS = {
    "npu_moe_gating_top_k_softmax": (
        "npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_moe_init_routing": (
        "npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_moe_compute_expert_tokens": (
        "npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor"
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]"
    ),
    "npu_moe_finalize_routing": (
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
        "int? k=1) -> Tensor"
    ),
}

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

_lib = torch.library.Library("npu_emu", "FRAGMENT")
for _schema in (
    "moe_gating_top_k_softmax(Tensor x, Tensor? finished, int k) -> (Tensor, Tensor, Tensor)",
    "moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)",
    "moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
    "grouped_matmul_m(Tensor x, Tensor weight, Tensor group_list, int group_list_type) -> Tensor",
    (
        "moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int k) -> Tensor"
    ),
):
    _lib.define(_schema)


def _fail(op: str, msg: str) -> RuntimeError:
    return RuntimeError(f"{op}: {msg} [emulated torch_npu]")


def _check_float(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise _fail(op, f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


# gating: softmax then top-k ---------------------------------------------------------------------
@torch.library.impl(_lib, "moe_gating_top_k_softmax", "CPU")
def _gating(x, finished, k):
    op = "npu_moe_gating_top_k_softmax"
    _check_float(op, "x", x)
    if x.dim() not in (2, 3):
        raise _fail(op, f"x must be 2-D or 3-D, got {tuple(x.shape)}")
    if not 0 < k <= min(x.shape[-1], 1024):
        raise _fail(op, f"k={k} must satisfy 0 < k <= x.shape[-1]={x.shape[-1]} and k <= 1024")
    if finished is not None:
        raise _fail(op, "finished is not emulated; pass None")
    probs = torch.softmax(x.float(), dim=-1)
    flat = probs.reshape(-1, x.shape[-1])
    ids = flat.argsort(dim=-1, descending=True, stable=True)[:, :k]
    y = flat.gather(1, ids).to(x.dtype)
    rows = flat.shape[0]
    # row_idx[r, j] = j * rows + r: the layout npu_moe_init_routing reads (the doc's example)
    row_idx = (torch.arange(k, dtype=torch.int32)[None, :] * rows + torch.arange(rows, dtype=torch.int32)[:, None])
    shape = (*x.shape[:-1], k)
    return y.view(shape), ids.to(torch.int32).view(shape), row_idx.view(shape)


@torch.library.register_fake("npu_emu::moe_gating_top_k_softmax")
def _(x, finished, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


def npu_moe_gating_top_k_softmax(x: Tensor, finished: Tensor | None = None, k: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, expert_idx, row_idx)``: the k largest softmax values of x's last axis (x's dtype),
    their experts (int32) and each position's original row (int32)."""
    return torch.ops.npu_emu.moe_gating_top_k_softmax(x, finished, k)


# init routing: tokens expanded and sorted by expert ------------------------------------------------
def _check_int32(op: str, name: str, t: Tensor) -> None:
    if t.dtype != torch.int32:
        raise _fail(op, f"{name} must be int32, got {t.dtype}")


@torch.library.impl(_lib, "moe_init_routing", "CPU")
def _init_routing(x, row_idx, expert_idx, active_num):
    op = "npu_moe_init_routing"
    _check_float(op, "x", x)
    _check_int32(op, "row_idx", row_idx)
    _check_int32(op, "expert_idx", expert_idx)
    if x.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise _fail(op, f"x must be (NUM_ROWS, H) and expert_idx (NUM_ROWS, K); got {tuple(x.shape)}, "
                        f"{tuple(expert_idx.shape)}")
    if row_idx.shape != expert_idx.shape:
        raise _fail(op, f"row_idx {tuple(row_idx.shape)} must have expert_idx's shape {tuple(expert_idx.shape)}")
    if x.numel() >= 2**24:
        raise _fail(op, "x must have fewer than 2^24 elements")
    num_rows, k = expert_idx.shape
    # keyValueSort(expert_idx, row_idx); expanded_row_idx[sorted_row_idx[i]] = i;
    # expanded_x[i] = x[sorted_row_idx[i] % num_rows]
    order = expert_idx.reshape(-1).argsort(stable=True)
    sorted_experts = expert_idx.reshape(-1)[order]
    sorted_rows = row_idx.reshape(-1)[order].long()
    expanded_row_idx = torch.empty(num_rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_rows] = torch.arange(num_rows * k, dtype=torch.int32)
    active = min(num_rows, active_num) * k
    expanded_x = x[sorted_rows[:active] % num_rows]
    return expanded_x, expanded_row_idx, sorted_experts.clone()


@torch.library.register_fake("npu_emu::moe_init_routing")
def _(x, row_idx, expert_idx, active_num):
    num_rows, k = expert_idx.shape
    return (x.new_empty(min(num_rows, active_num) * k, x.shape[1]),
            x.new_empty(num_rows * k, dtype=torch.int32), x.new_empty(num_rows * k, dtype=torch.int32))


def npu_moe_init_routing(x: Tensor, row_idx: Tensor, expert_idx: Tensor, active_num: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(expanded_x, expanded_row_idx, expanded_expert_idx)``: x's rows once per routed expert,
    sorted by expert; where each original (row, slot) went; the sorted experts."""
    return torch.ops.npu_emu.moe_init_routing(x, row_idx, expert_idx, active_num)


# expert token counts ------------------------------------------------------------------------------
@torch.library.impl(_lib, "moe_compute_expert_tokens", "CPU")
def _expert_tokens(sorted_experts, num_expert):
    op = "npu_moe_compute_expert_tokens"
    _check_int32(op, "sorted_expert_for_source_row", sorted_experts)
    if sorted_experts.dim() != 1 or not 0 < num_expert <= 2048:
        raise _fail(op, f"needs a 1-D input and 0 < num_expert <= 2048, got {tuple(sorted_experts.shape)}, {num_expert}")
    if sorted_experts.numel() and (bool((sorted_experts[1:] < sorted_experts[:-1]).any())
                                   or int(sorted_experts.min()) < 0 or int(sorted_experts.max()) >= num_expert):
        raise _fail(op, "the input must be non-decreasing expert ids in [0, num_expert)")
    # the binary search for each expert's last row: the end of its run (a cumulative count)
    ends = torch.searchsorted(sorted_experts, torch.arange(num_expert, dtype=torch.int32), right=True)
    return ends.to(torch.int32)


@torch.library.register_fake("npu_emu::moe_compute_expert_tokens")
def _(sorted_experts, num_expert):
    return sorted_experts.new_empty(num_expert)


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: Tensor, num_expert: int) -> Tensor:
    """int32 ``[num_expert]``: for each expert, the end of its rows in the sorted input."""
    return torch.ops.npu_emu.moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert)


# grouped matmul: the m-grouped single-tensor case ----------------------------------------------------
@torch.library.impl(_lib, "grouped_matmul_m", "CPU")
def _grouped_matmul_m(x, weight, group_list, group_list_type):
    op = "npu_grouped_matmul"
    num_groups = weight.shape[0]
    if group_list.dtype != torch.int64 or group_list.dim() != 1 or group_list.numel() != num_groups:
        raise _fail(op, f"group_list must be int64 [{num_groups}] (one entry per weight group), "
                        f"got {group_list.dtype} {tuple(group_list.shape)}")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    if bool((sizes < 0).any()):
        raise _fail(op, "group_list must be non-negative and, with group_list_type=0, non-decreasing")
    if int(sizes.sum()) != x.shape[0]:
        raise _fail(op, f"group_list covers {int(sizes.sum())} rows, x has {x.shape[0]}")
    out = torch.empty(x.shape[0], weight.shape[2], dtype=x.dtype)
    start = 0
    for g, n in enumerate(sizes.tolist()):
        out[start : start + n] = (x[start : start + n].float() @ weight[g].float()).to(x.dtype)
        start += n
    return out


@torch.library.register_fake("npu_emu::grouped_matmul_m")
def _(x, weight, group_list, group_list_type):
    return x.new_empty(x.shape[0], weight.shape[2])


def npu_grouped_matmul(
    x: list[Tensor], weight: list[Tensor], *, bias=None, scale=None, offset=None, antiquant_scale=None,
    antiquant_offset=None, per_token_scale=None, group_list: Tensor | None = None, activation_input=None,
    activation_quant_scale=None, activation_quant_offset=None, split_item: int = 0,
    group_type: int | None = None, group_list_type: int = 0, act_type: int = 0, tuning_config=None,
    output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None,
) -> list[Tensor]:
    """``[y]`` for the single-tensor case grouped on m (group_type=0, split_item 2 or 3): rows
    of group g of x times ``weight[g]`` (``[E, K, N]``, a transposed view allowed), no bias."""
    op = "npu_grouped_matmul"
    extras = {"bias": bias, "scale": scale, "offset": offset, "antiquant_scale": antiquant_scale,
              "antiquant_offset": antiquant_offset, "per_token_scale": per_token_scale,
              "activation_input": activation_input, "activation_quant_scale": activation_quant_scale,
              "activation_quant_offset": activation_quant_offset, "tuning_config": tuning_config,
              "output_dtype": output_dtype, "x_dtype": x_dtype, "weight_dtype": weight_dtype,
              "scale_dtype": scale_dtype, "per_token_scale_dtype": per_token_scale_dtype}
    given = sorted(k for k, v in extras.items() if v is not None)
    if given or act_type:
        raise _fail(op, f"only the non-quantized case without bias or activation is emulated; got {given or 'act_type'}")
    if group_type != 0 or split_item not in (2, 3) or group_list is None:
        raise _fail(op, "emulated: group_type=0 with split_item 2 or 3 and a group_list tensor "
                        f"(got group_type={group_type}, split_item={split_item})")
    if group_list_type not in (0, 1):
        raise _fail(op, f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
    if len(x) != 1 or len(weight) != 1:
        raise _fail(op, f"emulated: a single x and a single 3-D weight tensor, got {len(x)} and {len(weight)}")
    (a,), (w,) = x, weight
    _check_float(op, "x", a)
    if a.dim() != 2 or w.dim() != 3 or w.shape[1] != a.shape[1] or w.dtype != a.dtype:
        raise _fail(op, f"x must be (M, K) and weight (E, K, N) of x's dtype; got {tuple(a.shape)} {a.dtype}, "
                        f"{tuple(w.shape)} {w.dtype}")
    if not a.is_contiguous():
        raise _fail(op, "x does not support transposition: pass a contiguous x")
    if w.shape[0] > 1024:
        raise _fail(op, "at most 1024 groups")
    return [torch.ops.npu_emu.grouped_matmul_m(a, w, group_list, group_list_type)]


# finalize routing: the weighted combine -------------------------------------------------------------
@torch.library.impl(_lib, "moe_finalize_routing", "CPU")
def _finalize(rows, skip1, skip2, bias, scales, src_to_dst, experts, k):
    op = "npu_moe_finalize_routing"
    _check_float(op, "expanded_permuted_rows", rows)
    _check_int32(op, "expanded_src_to_dst_row", src_to_dst)
    if skip2 is not None and skip1 is None:
        raise _fail(op, "skip2 given without skip1")
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias), ("scales", scales)):
        if t is not None and t.dtype != rows.dtype:
            raise _fail(op, f"{name} must have expanded_permuted_rows' dtype {rows.dtype}, got {t.dtype}")
    if scales is not None:
        k = scales.shape[1]
    num_rows = src_to_dst.numel() // k
    if src_to_dst.numel() != num_rows * k or rows.shape[0] != num_rows * k:
        raise _fail(op, f"expanded rows {tuple(rows.shape)} and src_to_dst {tuple(src_to_dst.shape)} must be "
                        f"(NUM_ROWS * K, H) and (NUM_ROWS * K,) with K={k}")
    if bias is not None and experts is None:
        raise _fail(op, "bias needs export_for_source_row")
    # out(i) = skip1 + skip2 + sum_k scales[i, k] * (rows[src_to_dst[i + k * NUM_ROWS]] + bias[expert])
    out = torch.zeros(num_rows, rows.shape[1], dtype=torch.float32)
    for j in range(k):
        picked = rows[src_to_dst[j * num_rows : (j + 1) * num_rows].long()].float()
        if bias is not None:
            picked = picked + bias[experts[:, j].long()].float()
        weight = scales[:, j : j + 1].float() if scales is not None else 1.0
        out += weight * picked
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.float()
    return out.to(rows.dtype)


@torch.library.register_fake("npu_emu::moe_finalize_routing")
def _(rows, skip1, skip2, bias, scales, src_to_dst, experts, k):
    k = scales.shape[1] if scales is not None else k
    return rows.new_empty(src_to_dst.shape[0] // k, rows.shape[1])


def npu_moe_finalize_routing(
    expanded_permuted_rows: Tensor, skip1: Tensor | None, skip2: Tensor | None, bias: Tensor | None,
    scales: Tensor | None, expanded_src_to_dst_row: Tensor, export_for_source_row: Tensor | None,
    drop_pad_mode: int = 0, k: int = 1,
) -> Tensor:
    """``(NUM_ROWS, H)``: each row's K expert outputs gathered back and summed with ``scales``."""
    if drop_pad_mode != 0:
        raise RuntimeError("npu_moe_finalize_routing: drop_pad_mode must be 0 [emulated torch_npu]")
    return torch.ops.npu_emu.moe_finalize_routing(
        expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row, k
    )


OPS = {
    "npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax,
    "npu_moe_init_routing": npu_moe_init_routing,
    "npu_moe_compute_expert_tokens": npu_moe_compute_expert_tokens,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_finalize_routing": npu_moe_finalize_routing,
}
