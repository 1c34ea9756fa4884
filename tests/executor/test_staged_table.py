"""The decode graphs' block table, staged densely in the step's one copy and laid out inside the
graph: every step's rows arrive whole whatever the width before, and no entry is ever an id no
step staged."""

from __future__ import annotations

import pytest
import torch

import xhal
from tests.support.routed_decode_graphs import RoutedGraphs
from xhal.executor import ExecutorConfig
from xhal.executor.staged_table import StagedBlockTable
from xhal.interfaces import AttentionMetadata, BatchKind


def _decode(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of ``table``'s rows, each sequence at the last slot of its first page."""
    b, block = table.shape[0], 16
    kv = torch.full((b,), block, dtype=torch.int32)
    slots = (table[:, 0] * block + block - 1).int()
    meta = AttentionMetadata.from_host_lengths(
        BatchKind.DECODE, torch.ones(b, dtype=torch.int32), kv, table, slots
    )
    return torch.arange(b, dtype=torch.int32), kv - 1, meta


def _staged(num_rows: int, max_width: int) -> StagedBlockTable:
    i32 = torch.int32
    return StagedBlockTable(
        torch.zeros(num_rows * max_width, dtype=i32), torch.zeros(1, dtype=i32), max_width
    )


def test_lay_out_gathers_each_width_into_the_persistent_rows() -> None:
    staged = _staged(num_rows=4, max_width=5)
    wide = torch.arange(100, 120, dtype=torch.int32).view(4, 5)
    narrow = torch.tensor([[7, 8], [9, 10]], dtype=torch.int32)
    for table, bucket in ((wide, 4), (narrow, 2), (narrow[:1, :1].clone(), 4)):
        dst, src = staged.pairs(table)
        torch._foreach_copy_(dst, src)
        staged.lay_out(bucket)
        rows, width = table.shape
        assert torch.equal(staged.table[:rows, :width], table)


ROUTES = ["host", "device", "host-device", "device-host"]


@pytest.mark.parametrize("routes", ROUTES)
def test_graph_steps_see_every_caller_table_after_wider_and_longer_ones(routes: str) -> None:
    """One bucket of 4 replays steps of 4, 2, 3 and 1 sequences with tables 6, 1, 3 and the full
    8 columns wide (new ids each step): inside the graph a real row's first columns are the
    caller's, and every other entry (later columns, padding rows) is an id some step staged."""
    config = ExecutorConfig(max_num_seqs=4, max_model_len=128, block_size=16)
    graphs = RoutedGraphs(
        routes,
        xhal.platforms.get("cpu"),
        [],
        config,
        forward=lambda ids, pos, m: m.block_table.clone(),  # the table the graph's layers read
    )
    staged_ids = {0}  # the persistent buffers start zeroed
    next_id = 1
    for rows, width in ((4, 6), (2, 1), (3, 3), (1, config.max_blocks_per_seq)):
        table = torch.arange(next_id, next_id + rows * width, dtype=torch.int32).view(rows, width)
        next_id += rows * width
        staged_ids |= set(table.flatten().tolist())
        ids, pos, meta = _decode(table)
        seen = graphs.run(ids, pos, meta, bucket=4)
        assert ("decode", 4) in graphs.graphs
        assert seen.shape == (rows, config.max_blocks_per_seq)
        assert torch.equal(seen[:, :width], table), (rows, width)
        padded, _ = graphs._padded_metadata(4)
        assert set(padded.block_table.flatten().tolist()) <= staged_ids


@pytest.mark.parametrize("routes", ["device", "host-device", "device-host", "host-device-device"])
def test_a_step_of_the_width_staged_last_keeps_it(routes: str) -> None:
    """A device-route step whose table is as wide as the last step's leaves the width field out
    of its copy: whichever route staged that width, the graph lays each table out by it, and a
    change of width (either route) is staged again."""
    config = ExecutorConfig(max_num_seqs=4, max_model_len=128, block_size=16)
    graphs = RoutedGraphs(
        routes,
        xhal.platforms.get("cpu"),
        [],
        config,
        forward=lambda ids, pos, m: m.block_table.clone(),
    )
    next_id = 1
    for rows, width in ((2, 3), (3, 3), (3, 5), (2, 3), (4, 5), (1, 3), (2, 3)):
        table = torch.arange(next_id, next_id + rows * width, dtype=torch.int32).view(rows, width)
        next_id += rows * width
        seen = graphs.run(*_decode(table), bucket=4)
        assert torch.equal(seen[:, :width], table), (routes, rows, width)


def test_a_strided_caller_table_still_arrives_whole() -> None:
    """A caller's table that is a column slice of a wider one is not dense: the copy leaves the
    one-launch path but must still stage the right rows."""
    staged = _staged(num_rows=2, max_width=4)
    wider = torch.arange(1, 13, dtype=torch.int32).view(2, 6)
    table = wider[:, 1:4]
    assert not table.is_contiguous()
    dst, src = staged.pairs(table)
    torch._foreach_copy_(dst, src)
    staged.lay_out(2)
    assert staged.table[:, :3].tolist() == [[2, 3, 4], [8, 9, 10]]
