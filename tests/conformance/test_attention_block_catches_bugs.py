"""The conformance check of ``AttentionBackend.forward_block`` (``conformance_tests/
test_attention_block.py``) holds on this machine: a backend that runs the block as the reference's
plain sequence passes it, and one whose fused KV write stores the unrotated keys fails it. No CPU
backend fuses the block, so without these the check would first run on a GPU."""

from __future__ import annotations

import pytest
import torch

from conformance_tests.test_attention_block import check_block, check_block_in_graph
from tests.support.block_attention import SequenceBlockPlatform, StaleKeyBlockPlatform

CASES = [  # (group, head dim, shape, q/k norm, NeoX)
    (4, 64, "short", False, True),
    (8, 128, "long", True, True),
    (4, 64, "one-key", False, False),
    (8, 64, "three", True, True),
]
IDS = [f"gqa{g}-d{d}-{s}{'-qknorm' if n else ''}" for g, d, s, n, _ in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_plain_sequence_passes(case, dtype) -> None:
    worst = check_block(SequenceBlockPlatform(), *case, dtype, torch.device("cpu"))
    assert 0.0 <= worst <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_keys_written_before_the_rotation_fail(dtype) -> None:
    with pytest.raises(AssertionError, match="written keys"):
        check_block(StaleKeyBlockPlatform(), 4, 64, "short", False, True, dtype,
                    torch.device("cpu"))  # fmt: skip


def test_a_backend_that_does_not_fuse_the_step_is_skipped() -> None:
    # a mixed step: the sequence backend fuses decodes only
    with pytest.raises(pytest.skip.Exception, match="does not fuse"):
        check_block(SequenceBlockPlatform(), 8, 64, "mixed", True, True, torch.float32,
                    torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_plain_sequence_replays_as_it_runs_eagerly(dtype) -> None:
    for group, head_dim, qk_norm in [(4, 64, False), (8, 128, True)]:
        check_block_in_graph(SequenceBlockPlatform(), group, head_dim, qk_norm, dtype,
                             torch.device("cpu"))  # fmt: skip
