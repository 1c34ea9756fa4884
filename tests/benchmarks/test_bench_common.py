"""Benchmark ceilings and floors: the streaming-read kernel behind ``read_bandwidth`` reads every
element once (on the GPU or in Triton's interpreter), and the honest decode floor counts the bytes
a step really reads (hand-computed for the Llama-3 8B and 3.2-1B shapes)."""

from __future__ import annotations

import torch


def test_streaming_read_kernel_reads_every_element_once() -> None:
    from benchmarks.common import stream_read_sum
    from tests.support.triton_env import (  # skips where triton is missing
        DEVICE,
        NO_RUNTIME_LOOPS,
        RUNTIME_LOOPS,
    )

    if not RUNTIME_LOOPS:
        import pytest

        pytest.skip(NO_RUNTIME_LOOPS)
    block, unroll = 64, 2
    n = 5 * block * unroll + 77  # a ragged tail: program 0 reads it under a mask
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    partial = stream_read_sum(x, programs=3, block=block, unroll=unroll, num_warps=1)
    assert partial.numel() == 3  # persistent: one partial per program, 5 chunks over 3 programs
    assert abs(partial.double().sum().item() - x.double().sum().item()) < 1e-3


def test_decode_reads_one_embedding_row_unless_the_table_is_the_lm_head() -> None:
    from benchmarks.llama_model import SHAPES, decode_read_bytes

    weights = 10**9  # any figure: only the differences are computed
    # 8B, untied: the table (128256 x 4096 bf16) is replaced by one row per sequence; KV of
    # 2048 tokens x 32 layers x 8 heads x 128 x (K, V) x 2 bytes per sequence
    kv = 2048 * 32 * 8 * 128 * 2 * 2
    got = decode_read_bytes(SHAPES["llama3-8b"], weights, batch=2, ctx=2048)
    assert got["all"] == weights + 2 * kv
    assert got["honest"] == weights - 128256 * 4096 * 2 + 2 * 4096 * 2 + 2 * kv
    # 3.2-1B, tied: the LM head reads the whole table, so nothing is taken off; head dim 64
    kv_1b = 2048 * 16 * 8 * 64 * 2 * 2
    got = decode_read_bytes(SHAPES["llama3.2-1b"], weights, batch=1, ctx=2048)
    assert got["all"] == got["honest"] == weights + kv_1b


def test_graph_and_eager_executors_share_one_set_of_caches() -> None:
    """The two executors the model benchmarks time side by side: one graph and one eager
    executor, both writing the KV of a step into the same returned caches, sized for the largest
    batch's context plus 64 spare blocks."""
    import xhal
    from benchmarks.common import graph_and_eager_executors
    from benchmarks.llama_model import BLOCK, CONFIG, decode_metadata, random_model

    tiny = {**CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
    cpu = torch.device("cpu")
    model = random_model(cpu, tiny)
    ctx = 2 * BLOCK
    platform = xhal.platforms.get("cpu")
    executors, caches = graph_and_eager_executors(model, platform, [1, 2], BLOCK, ctx)
    assert {eager: ex.config.enforce_eager for eager, ex in executors.items()} == {
        False: False,
        True: True,
    }
    assert executors[False].config.decode_graph_sizes == (1, 2)
    assert len(caches) == 2 and caches[0].key.shape[0] == 2 * ctx // BLOCK + 64
    ids, pos, meta = decode_metadata(1, ctx, cpu, tiny["vocab_size"])
    slot = int(meta.slot_mapping[0])
    for eager in (True, False):
        for cache in caches:
            cache.key.zero_()
        ex = executors[eager]
        ex.execute(ids, pos, meta)
        written = caches[0].key.view(-1, *caches[0].key.shape[2:])[slot]  # [Hkv, D]
        assert written.abs().sum() > 0, f"enforce_eager={eager} wrote elsewhere"

