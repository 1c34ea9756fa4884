"""One rank's forward: the logits of exactly the sampled rows, taking every row without a
selection when a decode batch samples each of its tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.request import Request
from serve_cli.engine.runner.input_builder import InputBuilder
from serve_cli.engine.runner.rank import forward
from serve_cli.engine.scheduler import Scheduler


class RowExecutor:
    """Hidden row i of a step is ``[i, token i]``; logits are the hidden rows asked for (all of
    them when ``selected`` is None, as ``ModelExecutor.compute_logits`` documents)."""

    platform = SimpleNamespace(device=lambda: torch.device("cpu"))

    def __init__(self) -> None:
        self.selections: list[torch.Tensor | None] = []

    def execute(self, input_ids, positions, metadata):
        rows = torch.arange(input_ids.shape[0], dtype=torch.float32)
        return torch.stack([rows, input_ids.float()], dim=1)  # [T, 2]

    def compute_logits(self, hidden, selected=None):
        self.selections.append(selected)
        return hidden if selected is None else hidden.index_select(0, selected.long())


def _scheduler() -> Scheduler:
    return Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=16,
                     max_model_len=64)  # fmt: skip


def test_a_decode_batch_takes_every_row_and_a_prefill_its_last_tokens() -> None:
    scheduler, executor = _scheduler(), RowExecutor()
    builder = InputBuilder(torch.device("cpu"), "cuda", block_size=4)
    scheduler.submit(Request("a", [5, 6, 7], max_tokens=4))
    scheduler.submit(Request("b", [8, 9], max_tokens=4))
    prefill = scheduler.next_batch()  # a's 3 prompt tokens, then b's 2: rows 2 and 4 sample
    logits, scored = forward(executor, builder.build(prefill))
    assert scored is None  # no prompt asked to be scored
    assert logits.tolist() == [[2.0, 7.0], [4.0, 9.0]]
    assert executor.selections[-1].tolist() == [2, 4]
    scheduler.advance(prefill, {"a": 11, "b": 12})
    decode = scheduler.next_batch()  # one token each: both rows sample, in order
    logits, _ = forward(executor, builder.build(decode))
    assert logits.tolist() == [[0.0, 11.0], [1.0, 12.0]]
    assert executor.selections[-1] is None
