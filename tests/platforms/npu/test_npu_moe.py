"""The NPU backend's mixture of experts on the emulated torch_npu MoE ops: the emulation against
the documentation's own examples and formulas (computed by hand here), its refusals (by the wheel's
schema, its meta function and the documentation's rules), every backend call bound and
meta-checked, and a Qwen3-MoE model decoding on the emulated NPU (graphs against eager, and
against the CPU reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import xhal
from tests.support.npu_emulation_helpers import (
    emulated_npu_platform,
    require_wheel,  # noqa: F401  (skips without the torch-npu wheel)
)
from tests.support.paged_host import PagedHost

BLOCK_SIZE = 128


npu = emulated_npu_platform  # the fixture, under the name the tests take


def test_init_routing_follows_the_documented_example(npu) -> None:
    import torch_npu

    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(
        x, row_idx, expert_idx, 3
    )
    # by hand: pairs sorted by expert are (row 1, e0) (row 2, e0) (row 0, e1) (row 1, e1) (row 0,
    # e2) (row 2, e2), with original positions 1, 2, 0, 4, 3, 5
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(expanded_x, x[[1, 2, 0, 1, 0, 2]])
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]


def test_expert_tokens_and_gating_follow_the_documentation(npu) -> None:
    import torch_npu

    sorted_experts = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32)
    assert torch_npu.npu_moe_compute_expert_tokens(sorted_experts, 3).tolist() == [3, 5, 6]
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    y, experts, rows = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=2)
    p = torch.softmax(logits, -1)
    assert experts.tolist() == [[2, 3]] and rows.tolist() == [[0, 1]]
    assert torch.allclose(y, p[:, [2, 3]])


def test_finalize_routing_follows_the_documented_formula(npu) -> None:
    import torch_npu

    g = torch.Generator().manual_seed(0)
    num_rows, k, hidden, experts = 5, 3, 8, 4
    rows = torch.randn(num_rows * k, hidden, generator=g)
    skip1, skip2 = (
        torch.randn(num_rows, hidden, generator=g),
        torch.randn(num_rows, hidden, generator=g),
    )
    bias = torch.randn(experts, hidden, generator=g)
    scales = torch.rand(num_rows, k, generator=g)
    src_to_dst = torch.randperm(num_rows * k, generator=g).int()
    expert_for_row = torch.randint(0, experts, (num_rows, k), generator=g, dtype=torch.int32)
    out = torch_npu.npu_moe_finalize_routing(
        rows, skip1, skip2, bias, scales, src_to_dst, expert_for_row, 0, k
    )
    expected = skip1 + skip2
    for i in range(num_rows):
        for j in range(k):
            dst = int(src_to_dst[i + j * num_rows])
            expected[i] += scales[i, j] * (rows[dst] + bias[int(expert_for_row[i, j])])
    assert torch.allclose(out, expected, atol=1e-5)


def test_grouped_matmul_refuses_what_is_not_emulated(npu) -> None:
    import torch_npu

    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    ends = torch.tensor([2, 6])
    (y,) = torch_npu.npu_grouped_matmul([x], [w], group_list=ends, split_item=2, group_type=0)
    assert torch.allclose(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]), atol=1e-5)
    with pytest.raises(RuntimeError, match="int64"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=ends.int(), split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="covers 5 rows"):
        torch_npu.npu_grouped_matmul(
            [x], [w], group_list=torch.tensor([2, 5]), split_item=2, group_type=0
        )
    with pytest.raises(RuntimeError, match="group_type=0"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=ends, split_item=0, group_type=-1)


def test_grouped_matmul_takes_transposed_weight_views_and_group_sizes(npu) -> None:
    """'支持weight转置. x不支持转置'; group_list_type 1
    'group_list_type中数值为分组轴上每组大小'."""
    import torch_npu

    g = torch.Generator().manual_seed(1)
    x, w_nk = torch.randn(7, 8, generator=g), torch.randn(3, 5, 8, generator=g)  # w_nk: [E, N, K]
    w = w_nk.transpose(1, 2)  # [E, K, N], strides (40, 1, 8): the backend's weight views
    by_hand = torch.cat([x[:2] @ w[0], x[2:2] @ w[1], x[2:] @ w[2]])  # expert 1 gets no row
    (ends,) = torch_npu.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([2, 2, 7]), split_item=2, group_type=0, group_list_type=0
    )
    (sizes,) = torch_npu.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([2, 0, 5]), split_item=3, group_type=0, group_list_type=1
    )
    assert torch.allclose(ends, by_hand, atol=1e-5) and torch.allclose(sizes, by_hand, atol=1e-5)
    with pytest.raises(RuntimeError, match="x不支持转置"):
        torch_npu.npu_grouped_matmul(
            [x.t().contiguous().t()],
            [w],
            group_list=torch.tensor([2, 2, 7]),
            split_item=2,
            group_type=0,
        )


def test_moe_ops_refuse_what_the_real_api_refuses(npu) -> None:
    """The wheel's schema (binding), its meta function and the documentation's rules each refuse."""
    import torch_npu

    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    ends = torch.tensor([2, 6])
    with pytest.raises(TypeError, match=r"'x' must be tuple of Tensors, not Tensor.*Tensor\[\]"):
        torch_npu.npu_grouped_matmul(x, [w], group_list=ends, split_item=2, group_type=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_k'"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(2, 4), None, top_k=2)
    with pytest.raises(
        TypeError, match="takes 2 positional arguments"
    ):  # group_list is keyword-only
        torch_npu.npu_grouped_matmul([x], [w], ends)
    with pytest.raises(RuntimeError, match="meta function.*support only 2d and 3d"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(4), None, k=2)
    with pytest.raises(RuntimeError, match="meta function.*group_type only supports"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=ends, split_item=2, group_type=1)
    with pytest.raises(RuntimeError, match="k<=1024"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(2, 4), None, k=5)
    with pytest.raises(RuntimeError, match="非递减顺序"):
        torch_npu.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2)
    with pytest.raises(RuntimeError, match="sorted_row_idx"):  # row ids not a permutation
        torch_npu.npu_moe_init_routing(
            x, torch.zeros(6, 2, dtype=torch.int32), torch.zeros(6, 2, dtype=torch.int32), 6
        )
    rows, src_to_dst = torch.randn(12, 8), torch.arange(12, dtype=torch.int32)
    scales, skip = torch.rand(6, 2), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="skip2参数为None时, skip1参数必须也为None"):
        torch_npu.npu_moe_finalize_routing(rows, skip, None, None, scales, src_to_dst, None, 0, 2)
    with pytest.raises(RuntimeError, match="数据类型要求与expanded_permuted_rows一致"):
        torch_npu.npu_moe_finalize_routing(
            rows, None, None, None, scales.double(), src_to_dst, None, 0, 2
        )
    with pytest.raises(RuntimeError, match="meta function.*Dimension out of range"):
        # drop_pad_mode 1 has the meta function read expanded_permuted_rows as [E, C, H]
        torch_npu.npu_moe_finalize_routing(rows, None, None, None, scales, src_to_dst, None, 1, 2)
    with pytest.raises(
        RuntimeError, match="取值范围为0"
    ):  # the layout it takes, refused by the doc
        torch_npu.npu_moe_finalize_routing(
            rows.view(2, 6, 8), None, None, None, scales, src_to_dst, None, 1, 2
        )


def test_every_moe_call_of_the_backend_is_bound_and_meta_checked(npu) -> None:
    """moe_route and moe_experts reach each MoE op through its real schema and meta function, and
    compute the experts' float64 sum (hand-written loop) within float32 rounding."""
    from tests.support.npu_emulation import registry

    names = (
        "npu_moe_gating_top_k_softmax",
        "npu_moe_init_routing",
        "npu_moe_compute_expert_tokens",
        "npu_grouped_matmul",
        "npu_moe_finalize_routing",
    )
    before = {n: registry.COUNTS[n].copy() for n in names}
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(5, 16, generator=g), torch.randn(5, 6, generator=g)
    w13, w2 = torch.randn(6, 2 * 8, 16, generator=g), torch.randn(6, 16, 8, generator=g)
    weights, ids = npu.ops.moe_route(logits, 2, True)
    out = npu.ops.moe_experts(x, w13, w2, weights, ids)
    expected = torch.zeros(5, 16, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            expected[t] += float(weights[t, j]) * (
                w2[e].double() @ (torch.nn.functional.silu(gate) * up)
            )
    assert torch.allclose(out.double(), expected, atol=1e-4, rtol=1e-4)
    for n in names:
        calls = 2 if n == "npu_grouped_matmul" else 1  # gate-up and down
        got = registry.COUNTS[n]
        assert (
            got["bound"] - before[n]["bound"] == calls and got["meta"] - before[n]["meta"] == calls
        ), n


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="the tiny checkpoint is built with transformers")
    from tests.support.checkpoints import qwen3_moe

    # head_dim 128: the head size FIA's TND layout takes (npu.md section 1.4)
    return qwen3_moe(tmp_path_factory.mktemp("npu-qwen3-moe"), head_dim=128)


def _decode(platform, model, enforce_eager: bool) -> list[torch.Tensor]:
    from xhal.executor import ExecutorConfig, ModelExecutor

    config = ExecutorConfig(
        dtype=torch.bfloat16, block_size=BLOCK_SIZE, max_num_seqs=4, max_model_len=512,
        enforce_eager=enforce_eager, decode_graph_sizes=(4,), piecewise_token_sizes=(),
    )  # fmt: skip
    executor = ModelExecutor(model, platform, config)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=16))
    host = PagedHost(16, BLOCK_SIZE, seed=3)
    chunks = [
        (s, [(7 * s + j) % 200 + 3 for j in range(n)]) for s, n in {0: 5, 1: 20, 2: 9}.items()
    ]
    ids, pos, meta = host.step(chunks)
    logits = [executor.compute_logits(executor.execute(ids, pos, meta)).clone()]
    for step, seqs in enumerate([[0, 1, 2], [2, 0], [1]]):
        ids, pos, meta = host.step([(s, [(11 * step + s) % 200 + 3]) for s in seqs])
        logits.append(executor.compute_logits(executor.execute(ids, pos, meta)).clone())
    return logits


def test_qwen3_moe_decodes_on_the_npu_like_the_reference(npu, model_dir: Path) -> None:
    """Graph replays equal eager on the NPU, and both follow the CPU reference in bfloat16."""
    from models.loader import load_model

    model = load_model(model_dir, dtype=torch.bfloat16, progress=False)
    eager = _decode(npu, model, enforce_eager=True)
    graph = _decode(npu, model, enforce_eager=False)
    cpu = xhal.platforms.get("cpu")
    with xhal.ops.using("cpu", cpu.ops):
        reference = _decode(cpu, model, enforce_eager=True)
    for step, (g, e, r) in enumerate(zip(graph, eager, reference)):
        assert torch.equal(g, e), f"step {step}: graph replay != eager"
        rel = float((e - r).abs().max() / r.abs().max())
        assert rel < 3e-2, f"step {step}: NPU logits differ from the CPU reference by {rel:.2e}"
