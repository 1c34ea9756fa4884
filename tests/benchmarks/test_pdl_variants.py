"""The decode benchmarks' PDL peers (``benchmarks/pdl_variants.py``): each sets what it names
while it captures and puts it back after, on the CPU (the kernels read these settings per call;
the steps themselves need the GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks import pdl_variants  # noqa: E402
from xhal import env  # noqa: E402
from xhal.platforms.cuda import pdl  # noqa: E402
from xhal.platforms.cuda.kernels import mlp_block, splitkv_decode  # noqa: E402


def test_every_peer_setting_belongs_to_a_listed_peer() -> None:
    named = {
        *pdl_variants.EXTRA_ENV, *pdl_variants._MODULE_SETTINGS, *pdl_variants.FORCED_SOLUTION
    }  # fmt: skip
    assert named <= set(pdl_variants.PDL_VARIANTS)


@pytest.mark.parametrize(
    "name,overlap,one_sequence_trigger,depth",
    [
        ("auto", {"mlp", "qkv", "o"}, pdl.EARLY, 3),
        ("auto-no-overlap", set(), pdl.LATE, 3),
        ("auto-attn-early", set(), pdl.EARLY, 3),
        ("auto-overlap-attn-late", {"mlp", "qkv", "o"}, pdl.LATE, 3),
        ("auto-overlap-mlp-shallow", {"mlp", "qkv", "o"}, pdl.EARLY, 2),
        ("auto-overlap-mlp-qkv", {"mlp", "qkv"}, pdl.LATE, 3),
    ],
)
def test_the_overlap_peers_set_what_they_name_while_they_capture(
    name, overlap, one_sequence_trigger, depth, monkeypatch
) -> None:
    monkeypatch.delenv("XHAL_CUDA_OVERLAP", raising=False)
    with pdl_variants.pdl_variant(name):
        assert env.cuda_overlap() == overlap
        assert splitkv_decode.trigger(1) == one_sequence_trigger
        many = pdl.EARLY if name == "auto-attn-early" else pdl.LATE
        assert splitkv_decode.trigger(4) == many
        assert mlp_block.BESIDE_DEPTH == depth
    assert env.cuda_overlap() == {"mlp", "qkv", "o"}
    assert (splitkv_decode.TRIGGER, splitkv_decode.TRIGGER_BESIDE) == (pdl.LATE, pdl.EARLY)
    assert mlp_block.BESIDE_DEPTH == 3
