"""The CUDA backend's Triton fused mixture of experts against the conformance suite's float64
references: routing (ties, renormalization), the expert-sorted padded pair layout, and the
grouped GEMMs for one token, few tokens over many experts, crowded experts and experts with no
token, with both tile configurations. Interpreted on CPU when there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import DEVICE, INTERPRETED

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from conformance_tests import moe_reference as ref
from conformance_tests.test_moe import expert_weights, separated_logits, tokens
from xhal.platforms.cuda.kernels import moe, moe_route, moe_small

TOL = ref.EXPERTS_TOLERANCE


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (13, 128, 8), (6, 6, 6)])
def test_route_matches_reference(num_tokens, num_experts, top_k, renormalize) -> None:
    logits = separated_logits(num_tokens, num_experts, seed=3).float().to(DEVICE)
    weights, ids = moe_route.route(logits, top_k, renormalize)
    expected_w, expected_ids = ref.route(logits, top_k, renormalize)
    assert torch.equal(ids.cpu().long(), expected_ids)
    assert ref.max_error(weights, expected_w) <= 1e-6


def test_route_ties_pick_the_lower_expert() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    weights, ids = moe_route.route(logits, 2, True)
    assert ids.cpu().tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights.cpu(), torch.full((2, 2), 0.5))


SORTS = [moe.sort_pairs_fused, moe.sort_pairs_torch]


@pytest.mark.parametrize("sort", SORTS, ids=["fused", "torch"])
def test_sorted_pairs_group_each_expert_in_whole_blocks(sort) -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]], dtype=torch.int32, device=DEVICE)
    pairs = sort(ids, num_experts=5, block_m=4)
    rows = pairs.pair_ids.cpu().view(-1, 4).tolist()
    experts = pairs.block_expert.cpu().tolist()
    flat = ids.flatten().cpu().tolist()
    seen = []
    for block, expert in zip(rows, experts):
        if expert == 5:  # past the last run: its rows are never read (and may hold anything)
            continue
        real = [p for p in block if p < 8]
        assert all(p == 8 for p in block if p >= 8), block  # the rest of a run: padding
        assert all(flat[p] == expert for p in real) and real == sorted(real)
        seen += real
    assert sorted(seen) == list(range(8))  # every pair once: none dropped, none doubled
    # experts 0..3 hold 2, 1, 4 and 1 pairs: one block each; expert 4 has no pair and no block
    assert experts[:4] == [0, 1, 2, 3] and set(experts[4:]) <= {5}


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m", [(37, 16, 4, 16), (64, 128, 8, 16), (5, 3, 2, 64)]
)
def test_fused_sort_equals_the_torch_sort(num_tokens, num_experts, top_k, block_m) -> None:
    """The one-launch sort and torch's stable sort give the same rows for every real block."""
    _, ids = ref.route(separated_logits(num_tokens, num_experts, seed=4), top_k, True)
    ids = ids.to(DEVICE, torch.int32)
    fused = moe.sort_pairs_fused(ids, num_experts, block_m)
    plain = moe.sort_pairs_torch(ids, num_experts, block_m)
    assert torch.equal(fused.block_expert, plain.block_expert)
    real = (plain.block_expert < num_experts).repeat_interleave(block_m)
    assert torch.equal(fused.pair_ids[real], plain.pair_ids[real])


# the moe family (run interpreted below) covers more shapes with the default tiles; these force
# both ends of the tile range onto a lone token and onto crowded experts
CASES = {
    "one-token": (1, 8, 2, 64, 32, None),
    "crowded-few-experts": (70, 16, 4, 32, 64, [3, 7, 12, 13]),
}


@pytest.mark.parametrize(
    "config", [moe.MoeConfig(16, 32, 32), moe.MoeConfig(64, 64, 64)], ids=["small", "large"]
)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_experts_match_reference(case, dtype, config) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip(
            "Triton 3.6's interpreter runs tl.dot on bfloat16's raw bits; compiled on CUDA it is "
            "checked"
        )
    num_tokens, num_experts, top_k, hidden, inter, allowed = CASES[case]
    weights, ids = ref.route(
        separated_logits(num_tokens, num_experts, seed=1, allowed=allowed), top_k, True
    )
    x = tokens(num_tokens, hidden, dtype, DEVICE, seed=2)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, DEVICE, seed=3)
    out = moe.fused_experts(
        x, w13, w2, weights.float().to(DEVICE), ids.to(DEVICE, torch.int32), config
    )
    expected = ref.experts(x, w13, w2, weights.float(), ids)
    assert out.dtype == dtype
    assert ref.max_error(out, expected) <= TOL[dtype]


# the pair-GEMV path for decode batches: 1..8 tokens at top-8 of 128 experts (hidden and
# intermediate sizes cut for the interpreter, and not multiples of the tiles, so masks are hit)
# "ragged": row tiles past I and H and K steps past both (24 = 16 + 8, 48 = 32 + 16)
SMALL_CASES = [(n, moe_small.SmallMoeConfig()) for n in range(1, 9)] + [
    (n, moe_small.SmallMoeConfig(16, 32, 32, 16, up_stages=2, down_stages=2)) for n in (1, 5)
]


@pytest.mark.parametrize(
    "num_tokens,config", SMALL_CASES, ids=[f"{n}-{c.up_block_k}" for n, c in SMALL_CASES]
)
def test_small_experts_match_float64(num_tokens, config) -> None:
    num_experts, top_k, hidden, inter = 128, 8, 48, 24
    weights, ids = ref.route(
        separated_logits(num_tokens, num_experts, seed=num_tokens), top_k, True
    )
    x = tokens(num_tokens, hidden, torch.float32, DEVICE, seed=5)
    w13, w2 = expert_weights(num_experts, hidden, inter, torch.float32, DEVICE, seed=6)
    out = moe_small.small_experts(
        x, w13, w2, weights.float().to(DEVICE), ids.to(DEVICE, torch.int32), config
    )
    expected = ref.experts(x, w13, w2, weights.float(), ids)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, hidden)
    assert ref.max_error(out, expected) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_small_experts_share_experts_across_tokens(dtype) -> None:
    """Eight tokens over four experts: every expert serves several tokens, each pair on its own
    (forced: by default this many repeats take the grouped GEMM)."""
    num_tokens, num_experts, top_k, hidden, inter = 8, 16, 4, 64, 48
    logits = separated_logits(num_tokens, num_experts, seed=7, allowed=[2, 5, 6, 11])
    weights, ids = ref.route(logits, top_k, False)
    x = tokens(num_tokens, hidden, dtype, DEVICE, seed=8)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, DEVICE, seed=9)
    out = moe.fused_experts(
        x,
        w13,
        w2,
        weights.float().to(DEVICE),
        ids.to(DEVICE, torch.int32),
        moe_small.SmallMoeConfig(),
    )
    assert out.dtype == dtype
    assert ref.max_error(out, ref.experts(x, w13, w2, weights.float(), ids)) <= TOL[dtype]


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,small",
    [
        (1, 8, 128, True),
        (8, 8, 128, True),
        (9, 8, 128, False),
        (1, 2, 8, True),
        (2, 2, 8, True),
        (4, 2, 8, False),
        (1, 6, 6, True),
        (2, 6, 6, False),
    ],
)
def test_small_path_only_where_experts_rarely_repeat(num_tokens, top_k, num_experts, small) -> None:
    """One token's experts are distinct; several tokens take the pair GEMVs only while their pairs
    are at most half the experts (Qwen3-MoE's 128 up to 8 tokens, Mixtral's 8 up to 2)."""
    assert moe_small.use_small_path(num_tokens, top_k, num_experts) is small


def test_small_experts_of_no_token() -> None:
    w13, w2 = expert_weights(4, 32, 16, torch.float32, DEVICE, seed=1)
    out = moe_small.small_experts(
        torch.empty(0, 32, device=DEVICE),
        w13,
        w2,
        torch.empty(0, 2, device=DEVICE),
        torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
    )
    assert out.shape == (0, 32)


def test_small_experts_reject_a_trigger_they_do_not_have() -> None:
    """Under PDL the pair GEMVs take OFF, EARLY or LATE (pdl.py); the GEMVs' rules are not
    theirs, so AUTO is an error, not a silent choice (the PDL launches themselves are checked on
    the compiled PTX, tests/platforms/cuda/test_pdl.py, and on the H200)."""
    from xhal.platforms.cuda import pdl

    w13, w2 = expert_weights(4, 32, 16, torch.float32, DEVICE, seed=1)
    x = torch.zeros(1, 32, device=DEVICE)
    ids = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(1, 2, device=DEVICE)
    with pytest.raises(ValueError, match="triggers must be two of pdl.OFF, EARLY or LATE"):
        moe_small.small_experts(x, w13, w2, weights, ids, triggers=(pdl.AUTO, pdl.LATE))
    with pytest.raises(ValueError, match="triggers must be two of"):
        moe_small.small_experts(x, w13, w2, weights, ids, triggers=(pdl.LATE,))


@pytest.mark.parametrize(
    "device", ["cuda-moe-interpreted", "cuda-moe-small-interpreted"], ids=["by-shape", "pair-gemv"]
)
def test_triton_moe_passes_the_moe_family_interpreted(device, tmp_path) -> None:
    """The whole moe family (graphs with changing inputs included) on the Triton kernels: with
    the path chosen by shape, and with the pair GEMVs forced onto every case of up to 64 tokens."""
    from tests.support.conformance_run import explain, run_conformance

    proc, report = run_conformance(
        device,
        "tests.support.triton_moe_interpreted_platform",
        tmp_path / "r.json",
        ("moe",),
        TRITON_INTERPRET="1",
    )
    assert proc.returncode == 0, explain(proc)
    fam = report["families"]["moe"]
    assert fam["passed"] > 0 and fam["failed"] == 0, fam


@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k", [(1, 2048, 128, 8), (5, 96, 8, 2)])
def test_fused_norm_route_matches_float64(num_tokens, hidden, num_experts, top_k) -> None:
    """The one-launch norm + router + top-k at Qwen3-MoE's shape and a small odd one, twice in a
    row: the second launch finds the per-token counters the first one left at zero."""
    from conformance_tests.test_moe import check_norm_route, norm_route_inputs
    from xhal.platforms.cuda.kernels import moe_router

    inputs = norm_route_inputs(num_tokens, hidden, num_experts, torch.float32, DEVICE, seed=1)
    x, residual, norm_weight, gate = inputs
    assert moe_router.supports(x, residual, gate)
    errors = []
    for _ in range(2):
        outputs = moe_router.add_rms_norm_route(x, residual, norm_weight, 1e-6, gate, top_k, True)
        check_norm_route(outputs, *inputs, top_k, True, torch.float32, errors.append)
    assert moe_router._counter(x.device).count_nonzero() == 0
    assert max(errors) < 1e-4


def test_fused_norm_route_leaves_large_batches_to_the_sequence() -> None:
    from xhal.platforms.cuda.kernels import moe_router

    x = torch.zeros(moe_router.MAX_TOKENS + 1, 64, device=DEVICE)
    gate = torch.zeros(8, 64, device=DEVICE)
    assert not moe_router.supports(x, x, gate)
    assert not moe_router.supports(x[:2, ::2], x[:2, ::2], gate[:, :32])  # strided rows
    assert moe_router.supports(x[:2], x[:2], gate)
