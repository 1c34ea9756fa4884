"""Emulated torch_npu mixture-of-experts ops, registered with ``real_op``: gating top-k softmax,
init routing, expert token counts, grouped matmul and finalize routing, each under its schema from
the pinned wheel's YAML and checked by the wheel's meta function on every call (``registry.py``).

The kernels implement the ops' documentation (``torch_npu/_op_plugin_docs.py``; the rules are
collected in docs/npu-ops.md) and refuse what it forbids, quoting it. Only the paths the NPU
backend uses are emulated (no quantization, no ``finished`` rows, no drop/pad mode, grouped
matmul's single-tensor m-grouped case); anything else raises NotImplementedError naming it.

Not documented, and chosen here: the gating op's order among equal probabilities (the lower expert
first, the order ``DeviceOps.moe_route`` promises), its ``row_idx`` layout ``j * NUM_ROWS + r``
(the one init routing's example takes), init routing's order within one expert (stable in
row-major order of ``expert_idx``) and expert token counts as cumulative ends (what grouped
matmul's ``group_list_type=0`` reads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import real_op

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INNER_LIMIT = 65536  # grouped matmul: "内轴限制InnerLimit为65536"


def _fail(op: str, msg: str) -> RuntimeError:
    return RuntimeError(f"{op}: {msg} [emulated torch_npu]")


def _check_float(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise _fail(op, f"{name} is {t.dtype}; the doc: '数据类型支持float16、bfloat16、float32'")


def _check_int32(op: str, name: str, t: Tensor) -> None:
    if t.dtype != torch.int32:
        raise _fail(op, f"{name} is {t.dtype}; the doc: '数据类型支持int32'")


# gating: softmax then top-k ---------------------------------------------------------------------
def _gating(x: Tensor, finished: Tensor | None = None, k: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    op = "npu_moe_gating_top_k_softmax"
    _check_float(op, "x", x)
    if finished is not None:
        raise NotImplementedError(f"{op}: finished rows are not emulated; pass None")
    if not 0 < k <= min(x.shape[-1], 1024):
        raise _fail(
            op, f"k={k} with x {tuple(x.shape)}; the doc: '大小为0<k<=x的-1轴大小, k<=1024'"
        )
    probs = torch.softmax(x.float(), dim=-1)
    flat = probs.reshape(-1, x.shape[-1])
    ids = flat.argsort(dim=-1, descending=True, stable=True)[:, :k]
    y = flat.gather(1, ids).to(x.dtype)  # y: "数据类型与x需要保持一致"
    rows = flat.shape[0]
    row_idx = (
        torch.arange(k, dtype=torch.int32)[None, :] * rows
        + torch.arange(rows, dtype=torch.int32)[:, None]
    )
    shape = (*x.shape[:-1], k)
    return y.view(shape), ids.to(torch.int32).view(shape), row_idx.view(shape)


npu_moe_gating_top_k_softmax = real_op("npu_moe_gating_top_k_softmax", _gating)


# init routing: tokens expanded and sorted by expert ----------------------------------------------
def _init_routing(
    x: Tensor, row_idx: Tensor, expert_idx: Tensor, active_num: int
) -> tuple[Tensor, Tensor, Tensor]:
    op = "npu_moe_init_routing"
    _check_float(op, "x", x)
    _check_int32(op, "row_idx", row_idx)
    _check_int32(op, "expert_idx", expert_idx)
    if x.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise _fail(
            op,
            f"x {tuple(x.shape)}, expert_idx {tuple(expert_idx.shape)}; the doc: x "
            "'shape为 (NUM_ROWS, H)', expert_idx '2D的shape (NUM_ROWS, K)'",
        )
    if row_idx.shape != expert_idx.shape:
        raise _fail(op, f"row_idx {tuple(row_idx.shape)}; the doc: 'shape要求与expert_idx一致'")
    if x.numel() >= 2**24:
        raise _fail(op, "x has 2^24 elements or more; the doc: 'shape大小需要小于2^24'")
    num_rows, k = expert_idx.shape
    flat_rows = row_idx.reshape(-1).long()
    if flat_rows.numel() and not torch.equal(flat_rows.sort().values, torch.arange(num_rows * k)):
        # expanded_row_idx[sorted_row_idx[i]] = i fills the (NUM_ROWS*K,) output only when the
        # row ids are a permutation of it
        raise _fail(
            op,
            "row_idx must hold each of 0..NUM_ROWS*K-1 once (the doc's formula "
            "'expanded_row_idx[sorted_row_idx[i]]=i' into a (NUM_ROWS*K,) output)",
        )
    # "expanded_expert_idx, sorted_rowIdx=keyValueSort(expert_idx,row_idx)"
    order = expert_idx.reshape(-1).argsort(stable=True)
    sorted_experts = expert_idx.reshape(-1)[order]
    sorted_rows = flat_rows[order]
    expanded_row_idx = torch.empty(num_rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_rows] = torch.arange(num_rows * k, dtype=torch.int32)
    # "expanded_x[i]=x[sorted_row_idx[i]%num_rows]", "shape (min(NUM_ROWS, activeNum) * k, H)"
    active = min(num_rows, active_num) * k
    expanded_x = x[sorted_rows[:active] % num_rows]
    return expanded_x, expanded_row_idx, sorted_experts.clone()


npu_moe_init_routing = real_op("npu_moe_init_routing", _init_routing)


# expert token counts ------------------------------------------------------------------------------
def _expert_tokens(sorted_expert_for_source_row: Tensor, num_expert: int) -> Tensor:
    op, s = "npu_moe_compute_expert_tokens", sorted_expert_for_source_row
    _check_int32(op, "sorted_expert_for_source_row", s)
    if s.dim() != 1 or s.numel() >= 2**24:
        raise _fail(
            op,
            f"sorted_expert_for_source_row {tuple(s.shape)}; the doc: '要求是一个1D的"
            "Tensor', 'Tensor元素个数需小于2^24'",
        )
    if not 0 < num_expert <= 2048:
        raise _fail(op, f"num_expert={num_expert}; the doc: '取值范围为(0, 2048]'")
    if s.numel() and (
        bool((s[1:] < s[:-1]).any()) or int(s.min()) < 0 or int(s.max()) >= num_expert
    ):
        raise _fail(op, "the doc: '输入值取值范围为[0, num_expert-1], 且需按非递减顺序排列'")
    # the binary search for each expert's last row, given as the end of its run (a cumsum)
    ends = torch.searchsorted(s, torch.arange(num_expert, dtype=torch.int32), right=True)
    return ends.to(torch.int32)  # "数据类型与sorted_expert_for_source_row保持一致"


npu_moe_compute_expert_tokens = real_op("npu_moe_compute_expert_tokens", _expert_tokens)


# grouped matmul: the m-grouped single-tensor case ("单单单", group_type=0) -----------------------
def _check_group_list(
    op: str, group_list: Tensor, group_list_type: int, num_groups: int, num_rows: int
) -> Tensor:
    """The rows of each group, after the doc's group_list rules."""
    if group_list.dtype != torch.int64 or group_list.dim() != 1 or group_list.numel() != num_groups:
        raise _fail(
            op,
            f"group_list is {group_list.dtype} {tuple(group_list.shape)}; the doc: "
            "'数据类型支持torch.int64', '每个张量仅支持1维输入, 长度与weight列表长度相同' "
            f"(here the {num_groups} groups of the 3-D weight)",
        )
    if num_groups > 1024:
        raise _fail(op, f"{num_groups} groups; the doc: 'group_list第1维最大支持1024'")
    if group_list_type == 0:
        sizes = torch.diff(group_list, prepend=group_list.new_zeros(1))
        if bool((sizes < 0).any()):
            raise _fail(op, "the doc: '当group_list_type为0时, group_list必须为非负单调非递减数列'")
        covered = int(group_list[-1])
    else:
        sizes = group_list
        if bool((sizes < 0).any()) or num_groups == 1:
            raise _fail(
                op, "the doc: '当group_list_type为1时, group_list必须为非负数列, 且长度不能为1'"
            )
        covered = int(sizes.sum())
    if covered != num_rows:
        raise _fail(
            op,
            f"group_list covers {covered} rows, x has {num_rows}; the doc: '当"
            "group_list_type为0时, 最后一个值与x中tensor的第一维相等, 当group_list_type为1时, "
            "数值的总和与x中tensor的第一维相等'",
        )
    return sizes


def _grouped_matmul(
    x: list[Tensor],
    weight: list[Tensor],
    *,
    group_list: Tensor | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    **rest: object,
) -> list[Tensor]:
    op = "npu_grouped_matmul"
    given = sorted(name for name, v in rest.items() if v is not None)
    if given or act_type:
        raise NotImplementedError(
            f"{op}: only the non-quantized case without bias or activation "
            f"is emulated; got {given or f'act_type={act_type}'}"
        )
    if group_type != 0 or len(x) != 1 or len(weight) != 1 or group_list is None:
        raise NotImplementedError(
            f"{op}: emulated is group_type=0 with one x, one 3-D weight and a group_list tensor "
            f"(got group_type={group_type}, {len(x)} x, {len(weight)} weight)"
        )
    if split_item not in (2, 3):
        raise _fail(
            op, f"split_item={split_item}; the doc (group_type 0): '仅支持split_item为2或3'"
        )
    if group_list_type not in (0, 1):
        raise _fail(op, f"group_list_type={group_list_type}; the doc: '可取值0或1'")
    (a,), (w,) = x, weight
    _check_float(op, "x", a)
    if a.dim() != 2 or w.dim() != 3 or w.shape[1] != a.shape[1] or w.dtype != a.dtype:
        raise _fail(
            op,
            f"x {a.dtype} {tuple(a.shape)}, weight {w.dtype} {tuple(w.shape)}; the doc: "
            "'weight中tensor需为3维, x、y中tensor需为2维' ([M, K] and [E, K, N]), non-quantized "
            "x and weight of one dtype",
        )
    if not a.is_contiguous():
        raise _fail(op, "x is not contiguous; the doc: 'x不支持转置'")
    transposed = w.stride(-2) == 1 and w.stride(-1) == w.shape[-2]  # "支持weight转置"
    if a.shape[1] >= _INNER_LIMIT or w.shape[-2 if transposed else -1] >= _INNER_LIMIT:
        raise _fail(
            op,
            f"x {tuple(a.shape)}, weight {tuple(w.shape)}; the doc: 'x和weight中每一组"
            "tensor的最后一维大小都应小于InnerLimit' (65536)",
        )
    sizes = _check_group_list(op, group_list, group_list_type, w.shape[0], a.shape[0])
    # "y_{i}=x_{i}×weight_{i}" for each group's rows, accumulated in float32
    out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype)
    start = 0
    for g, n in enumerate(sizes.tolist()):
        out[start : start + n] = (a[start : start + n].float() @ w[g].float()).to(a.dtype)
        start += n
    return [out]


npu_grouped_matmul = real_op("npu_grouped_matmul", _grouped_matmul)


# finalize routing: the weighted combine -----------------------------------------------------------
def _check_finalize(
    op: str,
    rows: Tensor,
    skips: tuple[Tensor | None, Tensor | None],
    bias: Tensor | None,
    scales: Tensor | None,
    src_to_dst: Tensor,
    experts: Tensor | None,
    k: int,
) -> int:
    """NUM_ROWS, after the doc's rules for every argument."""
    _check_float(op, "expanded_permuted_rows", rows)
    _check_int32(op, "expanded_src_to_dst_row", src_to_dst)
    if rows.dim() != 2 or src_to_dst.dim() != 1:
        raise _fail(
            op,
            f"expanded_permuted_rows {tuple(rows.shape)}, expanded_src_to_dst_row "
            f"{tuple(src_to_dst.shape)}; the doc: '2D的Tensor', '1D的Tensor'",
        )
    num_rows = src_to_dst.numel() // k
    if src_to_dst.numel() != num_rows * k or rows.shape[0] != num_rows * k:
        raise _fail(
            op,
            f"expanded_permuted_rows {tuple(rows.shape)}, expanded_src_to_dst_row "
            f"{tuple(src_to_dst.shape)}, K={k}; the doc: 'shape支持(NUM_ROWS * K, H)', "
            "'shape支持(NUM_ROWS * K)'",
        )
    if src_to_dst.numel() and (int(src_to_dst.min()) < 0 or int(src_to_dst.max()) >= rows.shape[0]):
        raise _fail(
            op, "the doc: 'drop_pad_mode参数为0时, Tensor中的值取值范围是[0, NUM_ROWS * K-1]'"
        )
    skip1, skip2 = skips
    if skip2 is None and skip1 is not None:
        raise _fail(op, "skip1 without skip2; the doc: 'skip2参数为None时, skip1参数必须也为None'")
    shapes = {
        "skip1": (num_rows, rows.shape[1]),
        "skip2": (num_rows, rows.shape[1]),
        "scales": (num_rows, k),
        "bias": (None, rows.shape[1]),
    }
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias), ("scales", scales)):
        if t is None:
            continue
        want = shapes[name]
        if (
            t.dtype != rows.dtype
            or t.dim() != 2
            or any(w is not None and w != s for w, s in zip(want, t.shape))
        ):
            raise _fail(
                op,
                f"{name} is {t.dtype} {tuple(t.shape)}; the doc: '数据类型要求与"
                f"expanded_permuted_rows一致' ({rows.dtype}), shape {want} (None: any E)",
            )
    if experts is not None:
        _check_int32(op, "export_for_source_row", experts)
        if tuple(experts.shape) != (num_rows, k):
            raise _fail(
                op,
                f"export_for_source_row {tuple(experts.shape)}; the doc: 'shape支持"
                f"(NUM_ROWS, K)' ({num_rows}, {k})",
            )
    if bias is not None and experts is None:
        raise _fail(
            op,
            "bias needs export_for_source_row: the doc's 'expertid=exportForSourceRow"
            "[i,k]' picks each row's bias",
        )
    return num_rows


def _finalize(
    expanded_permuted_rows: Tensor,
    skip1: Tensor | None,
    skip2: Tensor | None,
    bias: Tensor | None,
    scales: Tensor | None,
    expanded_src_to_dst_row: Tensor,
    export_for_source_row: Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> Tensor:
    op, rows, experts = "npu_moe_finalize_routing", expanded_permuted_rows, export_for_source_row
    if drop_pad_mode not in (0, None):
        raise _fail(op, f"drop_pad_mode={drop_pad_mode}; the doc: '取值范围为0'")
    if scales is not None:
        if k is not None and k != scales.shape[-1]:  # the doc gives K twice; they must agree
            raise _fail(
                op, f"k={k} but scales has {scales.shape[-1]} columns ('shape支持(NUM_ROWS, K)')"
            )
        k = scales.shape[-1]
    elif k is None or k <= 0:
        raise _fail(op, f"k={k}; the doc: '当scales为None时，则需要指定k'")
    num_rows = _check_finalize(
        op, rows, (skip1, skip2), bias, scales, expanded_src_to_dst_row, experts, k
    )
    # out(i) = skip1 + skip2 + sum_k scales[i, k] * (rows[src_to_dst[i + k * NUM_ROWS]] + bias[e])
    out = torch.zeros(num_rows, rows.shape[1], dtype=torch.float32)
    for j in range(k):
        picked = rows[expanded_src_to_dst_row[j * num_rows : (j + 1) * num_rows].long()].float()
        if bias is not None:
            picked = picked + bias[experts[:, j].long()].float()
        out += (scales[:, j : j + 1].float() if scales is not None else 1.0) * picked
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.float()
    return out.to(rows.dtype)


npu_moe_finalize_routing = real_op("npu_moe_finalize_routing", _finalize)


OPS = {
    "npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax,
    "npu_moe_init_routing": npu_moe_init_routing,
    "npu_moe_compute_expert_tokens": npu_moe_compute_expert_tokens,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_finalize_routing": npu_moe_finalize_routing,
}
