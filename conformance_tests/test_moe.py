"""Mixture-of-experts family: ``xhal.ops.moe_route`` and ``xhal.ops.moe_experts`` on the
platform's tensors against float64 references (``moe_reference``), for each declared dtype:
routing with and without renormalization and with tied probabilities; expert compute for one
token, few tokens over many experts, many tokens per expert, all tokens on a few experts (the
rest get none); both inside a captured graph whose inputs change before replay."""

from __future__ import annotations

import functools

import pytest
import torch

from conformance_tests import moe_reference as ref
from conformance_tests.ops_family import _platform_ops_active, pytest_generate_tests  # noqa: F401
from xhal import ops


def separated_logits(
    num_tokens: int, num_experts: int, *, seed: int, allowed: list[int] | None = None
) -> torch.Tensor:
    """float64 ``[T, E]``: each row a random permutation of steps 0.1 apart (no near ties in any
    dtype); experts outside ``allowed`` far below the rest."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g).double() * 0.1 for _ in range(num_tokens)]
    logits = torch.stack(rows) if rows else torch.empty(0, num_experts, dtype=torch.float64)
    if allowed is not None:
        banned = torch.ones(num_experts, dtype=torch.bool)
        banned[allowed] = False
        logits[:, banned] -= 30.0
    return logits


def expert_weights(num_experts: int, hidden: int, inter: int, dtype, device, seed: int):
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` scaled so that every output is O(1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (
        torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64) * hidden**-0.5
    )
    w2 = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64) * inter**-0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def tokens(num_tokens: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64).to(device, dtype)


def check_experts(out, expected, dtype, record_error) -> None:
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected the input's {dtype}"
    err = ref.max_error(out, expected)
    record_error(err)
    tol = ref.EXPERTS_TOLERANCE[dtype]
    assert err <= tol, f"max error {err:.3e} > {tol:.1e}"


def check_routing(weights, ids, logits, top_k, renormalize, record_error) -> None:
    expected_w, expected_ids = ref.route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, (weights.dtype, ids.dtype)
    assert torch.equal(ids.cpu().long(), expected_ids), (
        f"routed experts differ: got {ids.cpu().tolist()[:4]}..., expected "
        f"{expected_ids.tolist()[:4]}... (descending probability, lower index first on ties)"
    )
    err = ref.max_error(weights, expected_w)
    record_error(err)
    assert err <= ref.ROUTING_TOLERANCE, f"routing weights: max error {err:.3e}"


# routing ---------------------------------------------------------------------------------------

ROUTING_CASES = [(1, 8, 2), (37, 8, 2), (16, 64, 6), (9, 128, 8), (5, 4, 4)]  # (T, E, k)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", ROUTING_CASES, ids=str)
def test_route(num_tokens, num_experts, top_k, renormalize, dtype, device, record_error) -> None:
    logits = separated_logits(num_tokens, num_experts, seed=num_experts).to(device, dtype)
    weights, ids = ops.moe_route(logits, top_k, renormalize)
    check_routing(weights, ids, logits, top_k, renormalize, record_error)
    if renormalize:
        assert torch.allclose(weights.sum(-1).cpu(), torch.ones(num_tokens), atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_route_ties_pick_the_lower_expert(renormalize, dtype, device, record_error) -> None:
    """Equal logits are equal in every dtype: the lower expert index wins each tie."""
    logits = torch.tensor(
        [
            [0.0, 2.0, 2.0, 1.0, 2.0, 0.0],  # three-way tie for the top: experts 1, 2
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all equal: experts 0, 1
            [3.0, 0.5, 0.5, 3.0, 0.5, 0.5],  # tie at the top: 0 then 3
            [0.0, 0.0, 0.0, 0.0, 0.0, 4.0],  # a clear winner then a tie for second: 5, 0
        ],
        dtype=torch.float64,
    ).to(device, dtype)
    weights, ids = ops.moe_route(logits, 2, renormalize)
    assert ids.cpu().tolist() == [[1, 2], [0, 1], [0, 3], [5, 0]]
    check_routing(weights, ids, logits, 2, renormalize, record_error)


# expert compute --------------------------------------------------------------------------------

EXPERT_CASES = {
    "one-token": (1, 8, 2, 64, 32, None),
    # a decode token at a model's hidden size (Qwen3-MoE's top-8): a one-token kernel's wide
    # stages, its row blocks spread over many units, experts far apart in memory
    "one-token-wide": (1, 16, 8, 2048, 96, None),
    "few-tokens-many-experts": (5, 64, 8, 128, 48, None),
    "many-tokens-per-expert": (77, 8, 2, 64, 96, None),
    "crowded-few-experts": (130, 16, 4, 32, 64, [3, 7, 12, 13]),  # 12 experts get no token
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_experts(case, dtype, device, record_error) -> None:
    num_tokens, num_experts, top_k, hidden, inter, allowed = EXPERT_CASES[case]
    logits = separated_logits(num_tokens, num_experts, seed=1, allowed=allowed)
    weights, ids = ref.route(logits, top_k, renormalize=allowed is None)
    x = tokens(num_tokens, hidden, dtype, device, seed=2)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, device, seed=3)
    out = ops.moe_experts(
        x, w13, w2, weights.to(device, torch.float32), ids.to(device, torch.int32)
    )
    check_experts(out, ref.experts(x, w13, w2, weights.float(), ids), dtype, record_error)


def test_experts_of_strided_tokens(dtype, device, record_error) -> None:
    """Hidden states arrive as a view of a wider buffer (a slice of a fused projection)."""
    wide = tokens(12, 128, dtype, device, seed=4)
    x = wide[:, :64]
    weights, ids = ref.route(separated_logits(12, 8, seed=5), 2, True)
    w13, w2 = expert_weights(8, 64, 32, dtype, device, seed=6)
    out = ops.moe_experts(
        x, w13, w2, weights.to(device, torch.float32), ids.to(device, torch.int32)
    )
    check_experts(out, ref.experts(x, w13, w2, weights.float(), ids), dtype, record_error)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_route_and_experts_in_a_graph(num_tokens, platform, dtype, device, record_error) -> None:
    """Decode steps run the MoE layer captured: replay after the tokens and logits changed in
    place (routing to other experts) must compute the new step, not the captured one."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    num_experts, top_k, hidden, inter = 16, 4, 64, 32
    x = tokens(num_tokens, hidden, dtype, device, seed=7)
    logits = separated_logits(num_tokens, num_experts, seed=8, allowed=[0, 1, 2, 3, 4]).to(
        device, dtype
    )
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, device, seed=9)

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights, ids = ops.moe_route(logits, top_k, True)
        return weights, ids, ops.moe_experts(x, w13, w2, weights, ids)

    runner = platform.graph_runner()
    runner.capture("moe", step)
    x.copy_(tokens(num_tokens, hidden, dtype, device, seed=10))
    logits.copy_(separated_logits(num_tokens, num_experts, seed=11, allowed=[9, 11, 12, 14, 15]))
    weights, ids, out = runner.replay("moe")
    platform.synchronize()
    check_routing(weights, ids, logits, top_k, True, record_error)
    expected_w, expected_ids = ref.route(logits, top_k, True)
    check_experts(
        out, ref.experts(x, w13, w2, expected_w.float(), expected_ids), dtype, record_error
    )


# the fused post-attention norm and router -----------------------------------------------------

# (T, H, E, k): one decode token over Qwen3-MoE's 128 experts, sizes off powers of 2, a batch
NORM_ROUTE_CASES = [(1, 256, 128, 8), (3, 200, 60, 6), (16, 64, 8, 2), (2, 520, 16, 4)]


def norm_route_inputs(num_tokens, hidden, num_experts, dtype, device, seed):
    x = tokens(num_tokens, hidden, dtype, device, seed=seed)
    residual = tokens(num_tokens, hidden, dtype, device, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    norm_weight = (1.0 + 0.5 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(
        device, dtype
    )
    gate = (torch.randn(num_experts, hidden, generator=g, dtype=torch.float64) * hidden**-0.5).to(
        device, dtype
    )
    return x, residual, norm_weight, gate


def check_norm_route(outputs, x, residual, norm_weight, gate, top_k, renormalize, dtype,
                     record_error) -> None:
    """Each output against the float64 unfused sequence: the new residual and the normed rows
    within 1 ulp, the logits within the fused-GEMV bound of the normed rows as stored, and the
    routing exactly that of the logits returned (so a near tie cannot flip the verdict)."""
    from conformance_tests import ops_reference as ops_ref
    from conformance_tests.test_fused import check_gemv, check_residual
    from conformance_tests.tolerances import tolerance

    logits, normed, summed, weights, ids = outputs
    normed_ref, summed_ref = ops_ref.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    check_residual(summed, summed_ref, dtype, record_error)
    if dtype in ops_ref.ULP_BITS:
        ulps = ops_ref.max_ulps(normed, normed_ref, dtype)
        assert ulps <= ops_ref.ULPS, f"normed rows {ulps:.1f} ulp from float64"
    else:
        assert ops_ref.max_error(normed, normed_ref) <= tolerance("ops", dtype)
    a = normed_ref.to(dtype).to(torch.float64)  # the router's input as the sequence stores it
    w = gate.detach().to("cpu", torch.float64)
    assert logits.shape == (x.shape[0], gate.shape[0]), tuple(logits.shape)
    check_gemv(logits, a, w, a @ w.T, dtype, record_error)
    check_routing(weights, ids, logits, top_k, renormalize, record_error)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k", NORM_ROUTE_CASES, ids=str)
def test_add_rms_norm_route(
    num_tokens, hidden, num_experts, top_k, renormalize, dtype, device, record_error
) -> None:
    inputs = norm_route_inputs(num_tokens, hidden, num_experts, dtype, device, seed=hidden)
    for _ in range(2):  # a second call starts from whatever state the first one left
        outputs = ops.add_rms_norm_moe_route(*inputs[:3], 1e-6, inputs[3], top_k, renormalize)
        check_norm_route(outputs, *inputs, top_k, renormalize, dtype, record_error)


def test_add_rms_norm_route_in_a_graph(platform, dtype, device, record_error) -> None:
    """The decode graph captures the fused router with the experts after it: each replay after
    the hidden rows changed in place must route the new rows."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    num_tokens, hidden, num_experts, top_k, inter = 2, 64, 16, 4, 32
    x, residual, norm_weight, gate = norm_route_inputs(
        num_tokens, hidden, num_experts, dtype, device, seed=20
    )
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, device, seed=21)

    def step():
        outputs = ops.add_rms_norm_moe_route(x, residual, norm_weight, 1e-6, gate, top_k, True)
        _, normed, _, weights, ids = outputs
        return (*outputs, ops.moe_experts(normed, w13, w2, weights, ids))

    runner = platform.graph_runner()
    runner.capture("moe-router", step)
    for seed in (30, 40):
        x.copy_(tokens(num_tokens, hidden, dtype, device, seed=seed))
        residual.copy_(tokens(num_tokens, hidden, dtype, device, seed=seed + 1))
        *outputs, out = runner.replay("moe-router")
        platform.synchronize()
        check_norm_route(outputs, x, residual, norm_weight, gate, top_k, True, dtype, record_error)
        _, normed, _, weights, ids = outputs
        check_experts(out, ref.experts(normed, w13, w2, weights, ids), dtype, record_error)


# the attention's o projection with the router after it -----------------------------------------

# (T, N, K, E, k): N the hidden size (o's rows), K o's input (heads x head dim); Qwen3-30B-A3B's
# layer, small ones with 60 and 8 experts, and a batch of 3 rows
O_ROUTE_CASES = [
    (1, 2048, 4096, 128, 8),
    (1, 256, 512, 60, 4),
    (1, 64, 128, 8, 2),
    (3, 200, 96, 16, 4),
]


@functools.cache
def _o_route_draws(num_tokens, hidden, k, num_experts, seed):
    """The float64 draws of ``o_route_inputs`` on the CPU, made once per shape and seed (the
    Qwen3-30B-A3B shape's o alone is 8M draws, and every dtype and solution takes them)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return (
        randn(num_tokens, k),  # a
        randn(hidden, k) * k**-0.5,  # o's weight: outputs O(1)
        randn(num_tokens, hidden),  # residual
        1.0 + 0.5 * randn(hidden),  # norm weight
        randn(num_experts, hidden) * hidden**-0.5,  # gate
    )


def o_route_inputs(num_tokens, hidden, k, num_experts, dtype, device, seed):
    """``(a, o_weight, residual, norm_weight, gate)`` on the device, in ``dtype``."""
    draws = _o_route_draws(num_tokens, hidden, k, num_experts, seed)
    return tuple(t.to(device, dtype) for t in draws)


def check_o_route(outputs, a, o_weight, residual, norm_weight, gate, top_k, renormalize, dtype,
                  record_error) -> None:  # fmt: skip
    """The new residual against float64 ``a @ o_weight.T + residual``: o within the fused-GEMV
    bound, then rounded once more by the add. The rest against the unfused router of that
    residual as returned (``check_norm_route`` with a zero residual): the normed rows within
    1 ulp, the logits within the fused-GEMV bound (a kernel may skip rounding the normed rows)
    and the routing exactly that of the logits returned."""
    from conformance_tests import ops_reference as ops_ref
    from conformance_tests.test_fused import gemv_bound

    summed = outputs[2]
    assert summed.shape == residual.shape and summed.dtype == dtype, (summed.shape, summed.dtype)
    a64, w64 = (t.detach().to("cpu", torch.float64) for t in (a, o_weight))
    o_ref = a64 @ w64.T
    summed_ref = o_ref + residual.detach().to("cpu", torch.float64)
    bound = gemv_bound(a64, w64, o_ref, dtype) + ops_ref.ulp(summed_ref, dtype)
    err = (summed.detach().to("cpu", torch.float64) - summed_ref).abs()
    record_error(float(err.max()))
    worst = float((err / bound).max())
    assert worst <= 1.0, f"new residual {worst:.2f}x its bound (o's GEMV, then the add)"
    zeros = torch.zeros_like(summed)
    check_norm_route(
        outputs, summed, zeros, norm_weight, gate, top_k, renormalize, dtype, record_error
    )


@pytest.mark.kernel_ops("linear_add_rms_norm_moe_route")
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("num_tokens,hidden,k,num_experts,top_k", O_ROUTE_CASES, ids=str)
def test_linear_add_rms_norm_route(
    num_tokens, hidden, k, num_experts, top_k, renormalize, dtype, device, record_error
) -> None:
    inputs = o_route_inputs(num_tokens, hidden, k, num_experts, dtype, device, seed=hidden)
    a, o_weight, residual, norm_weight, gate = inputs
    for _ in range(2):  # a second call starts from whatever state the first one left
        outputs = ops.linear_add_rms_norm_moe_route(
            a, o_weight, residual, norm_weight, 1e-6, gate, top_k, renormalize
        )
        check_o_route(outputs, *inputs, top_k, renormalize, dtype, record_error)


# a hidden size of 1152 spreads o's rows over more CTAs than an H100 or H200 has SMs (144 units
# of 8 rows), so a fused kernel's count and partials are reused across replays at full width; o's
# K and the experts stay small (the Triton interpreter runs this case too), and the Qwen3-30B-A3B
# shape itself runs in the eager cases above
@pytest.mark.kernel_ops("linear_add_rms_norm_moe_route", "moe_experts")
@pytest.mark.parametrize("hidden,k,num_experts,top_k", [(1152, 128, 8, 2), (64, 128, 16, 4)])
def test_linear_add_rms_norm_route_in_a_graph(
    hidden, k, num_experts, top_k, platform, dtype, device, record_error
) -> None:
    """One decode row's o projection and router captured with the experts after it, replayed
    after every input changed in place: each replay must route the new row (a kernel that
    counts its CTAs in must leave its count ready for the next replay)."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    a, o_weight, residual, norm_weight, gate = o_route_inputs(
        1, hidden, k, num_experts, dtype, device, seed=50
    )
    w13, w2 = expert_weights(num_experts, hidden, 32, dtype, device, seed=51)

    def step():
        outputs = ops.linear_add_rms_norm_moe_route(
            a, o_weight, residual, norm_weight, 1e-6, gate, top_k, True
        )
        _, normed, _, weights, ids = outputs
        return (*outputs, ops.moe_experts(normed, w13, w2, weights, ids))

    runner = platform.graph_runner()
    runner.capture("o-router", step)
    for seed in (60, 70, 80):  # new rows only: the weights stay those captured
        a.copy_(tokens(1, k, dtype, device, seed=seed))
        residual.copy_(tokens(1, hidden, dtype, device, seed=seed + 1))
        *outputs, out = runner.replay("o-router")
        platform.synchronize()
        check_o_route(
            outputs, a, o_weight, residual, norm_weight, gate, top_k, True, dtype, record_error
        )
        _, normed, _, weights, ids = outputs
        check_experts(out, ref.experts(normed, w13, w2, weights, ids), dtype, record_error)
