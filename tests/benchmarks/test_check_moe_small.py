"""bench_moe --check's pieces on the CPU: its float64 experts (computed on the device, gathering
only the routed experts) against the moe family's reference, and the pdl_variants peers that
replace moe_small's PDL triggers while they capture, restored after."""

from __future__ import annotations

import pytest
import torch

from conformance_tests import moe_reference as ref
from conformance_tests.test_moe import expert_weights, separated_logits, tokens


def test_experts_float64_equals_the_moe_reference() -> None:
    pytest.importorskip("triton")
    from benchmarks.check_moe_small import experts_float64

    num_tokens, num_experts, top_k, hidden, inter = 3, 16, 4, 24, 12
    weights, ids = ref.route(separated_logits(num_tokens, num_experts, seed=2), top_k, True)
    x = tokens(num_tokens, hidden, torch.float32, "cpu", seed=3)
    w13, w2 = expert_weights(num_experts, hidden, inter, torch.float32, "cpu", seed=4)
    got = experts_float64(x, w13, w2, weights.float(), ids.to(torch.int32))
    want = ref.experts(x, w13, w2, weights.float(), ids)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name,triggers", [("auto-moe-plain", (0, 0)), ("auto-moe-down-early", (2, 1))]
)  # (pdl.OFF, pdl.OFF), (pdl.LATE, pdl.EARLY)
def test_the_moe_peers_replace_the_triggers_while_they_capture(name, triggers) -> None:
    pytest.importorskip("triton")
    from benchmarks import pdl_variants
    from xhal.platforms.cuda import pdl
    from xhal.platforms.cuda.kernels import moe_small

    before = moe_small.TRIGGERS
    assert before == (pdl.LATE, pdl.LATE)
    with pdl_variants.pdl_variant(name):
        assert moe_small.TRIGGERS == triggers
    assert moe_small.TRIGGERS == before
    with pdl_variants.pdl_variant("auto"):  # the other variants leave them alone
        assert moe_small.TRIGGERS == before
