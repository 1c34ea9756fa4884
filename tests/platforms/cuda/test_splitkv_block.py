"""The ``native-block`` decode backend's host side off the GPU (``splitkv_block.py``): it offers
the attention block for decode steps of one sequence only, and a call its kernel cannot take
(here: CPU tensors, as an operand the kernel does not read would be on the GPU) runs the block as
the plain sequence on the split-KV backend, its Triton kernels in the interpreter, and passes the
conformance check of the block (``conformance_tests/test_attention_block.py``). The kernel itself
runs only on a GPU (the same check there, and ``bench_model --pdl auto auto-attn-block``)."""

from __future__ import annotations

import pytest
import torch

from conformance_tests.test_attention_block import check_block
from tests.support.triton_env import NO_RUNTIME_LOOPS, RUNTIME_LOOPS  # before any Triton kernel
from tests.support.triton_interpreted_platform import InterpretedTritonPlatform
from xhal.interfaces import AttentionSpec, BatchKind

pytestmark = pytest.mark.skipif(not RUNTIME_LOOPS, reason=f"split-KV decode {NO_RUNTIME_LOOPS}")


class _BlockPlatform(InterpretedTritonPlatform):
    """The interpreted Triton platform whose attention is the native-block backend."""

    name = "cuda-block-interpreted"

    def attention_backend(self, spec: AttentionSpec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode
        from xhal.platforms.cuda.splitkv_block import SplitKVBlockAttention
        from xhal.platforms.cuda.triton_attention import TritonAttention

        return with_splitkv_decode(
            spec, TritonAttention(spec), num_sms=4, backend=SplitKVBlockAttention
        )


@pytest.mark.parametrize(
    "group,head_dim,shape,qk_norm",
    [(4, 64, "short", False), (8, 128, "one-key", True), (4, 128, "short", True)],
)
def test_a_call_the_kernel_cannot_take_runs_the_sequence(group, head_dim, shape, qk_norm) -> None:
    worst = check_block(
        _BlockPlatform(), group, head_dim, shape, qk_norm, True, torch.bfloat16,
        torch.device("cpu"),
    )  # fmt: skip
    assert worst <= 1.0


def test_the_block_is_offered_for_one_sequence_decodes_only() -> None:
    import random

    from conformance_tests.batches import Seq, allocate_blocks, build_batch

    spec = AttentionSpec(8, 2, 64, torch.bfloat16, 16)
    backend = _BlockPlatform().attention_backend(spec)
    rng = random.Random(0)
    for kind, seqs, fused in [
        (BatchKind.DECODE, [Seq(1, 20)], True),
        (BatchKind.DECODE, [Seq(1, 20), Seq(1, 5)], False),
        (BatchKind.MIXED, [Seq(1, 20), Seq(3, 5)], False),
    ]:
        rows = allocate_blocks(seqs, 16, 8, rng)
        backend.plan(build_batch(kind, seqs, rows, 16, torch.device("cpu")).metadata)
        assert backend.fuses_block is fused, (kind, len(seqs))
    float32 = _BlockPlatform().attention_backend(AttentionSpec(8, 2, 64, torch.float32, 16))
    rows = allocate_blocks([Seq(1, 20)], 16, 8, rng)
    float32.plan(build_batch(BatchKind.DECODE, [Seq(1, 20)], rows, 16, "cpu").metadata)
    assert not float32.fuses_block  # the kernel reads fp16 / bf16 only
