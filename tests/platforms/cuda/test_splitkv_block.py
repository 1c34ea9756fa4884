"""The ``native-block`` decode backend's host side off the GPU (``splitkv_block.py``): it offers
the attention block for decode steps of one sequence only, and declines a call its kernel cannot
take (here: CPU tensors, as an operand the kernel does not read would be on the GPU) before it
writes anything, so that the layer runs its own sequence. The kernel itself runs only on a GPU
(the conformance check of the block there, ``conformance_tests/test_attention_block.py``, and
``bench_model --pdl auto auto-attn-block``)."""

from __future__ import annotations

import pytest
import torch

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


def test_a_call_the_kernel_cannot_take_is_declined_before_any_write() -> None:
    import random

    from conformance_tests.batches import Seq, allocate_blocks, build_batch
    from xhal.interfaces import AttentionBlock, LayerCache

    spec = AttentionSpec(8, 2, 64, torch.bfloat16, 16)
    backend = _BlockPlatform().attention_backend(spec)
    cache = LayerCache(*(torch.randn(8, 16, 2, 64).to(torch.bfloat16) for _ in range(2)))
    before = cache.key.clone(), cache.value.clone()
    backend.bind_kv_caches([cache])
    rows = allocate_blocks([Seq(1, 20)], 16, 8, random.Random(0))
    backend.plan(build_batch(BatchKind.DECODE, [Seq(1, 20)], rows, 16, "cpu").metadata)
    assert backend.fuses_block
    hidden = 256
    w = lambda *size: torch.randn(size).to(torch.bfloat16)  # noqa: E731
    block = AttentionBlock(
        w(hidden), 1e-5, w(12 * 64, hidden), w(hidden, 8 * 64),
        torch.randn(4096, 64), True,
    )  # fmt: skip
    positions = torch.tensor([19], dtype=torch.int32)
    assert backend.forward_block(0, block, w(1, hidden), w(1, hidden), positions) is None
    assert torch.equal(cache.key, before[0]) and torch.equal(cache.value, before[1])


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
