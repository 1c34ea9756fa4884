"""What the executor's decode graphs stage and read (``xhal.executor.decode_graph``): persistent
rows reset after a larger step, ids handed apart or written in place, the KV prefix sums and
block table derived inside the graph. The "model" of these graphs returns what it was handed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import xhal
from tests.support.paged_host import PagedHost
from tests.support.routed_decode_graphs import RoutedGraphs
from xhal.executor import ExecutorConfig


def _graphs(routes: str, forward: Callable, backends: Sequence = ()) -> RoutedGraphs:
    """Decode graphs on the reference platform (8 sequences of up to 64 tokens, blocks of 16),
    each step staged as ``routes`` says, running ``forward`` and planning ``backends``."""
    config = ExecutorConfig(max_num_seqs=8, max_model_len=64, block_size=16)
    return RoutedGraphs(routes, xhal.platforms.get("cpu"), list(backends), config, forward=forward)


class _PrefixSumReader:
    """The part of an attention backend the decode graphs call, from one that reads
    ``kv_cu_seq_lens`` (or not, as ``reads``)."""

    def __init__(self, reads: bool) -> None:
        self.reads_kv_cu_seq_lens = reads

    def plan(self, metadata, graph_key=None) -> None:
        pass

    def before_replay(self, graph_key) -> None:
        pass


@pytest.mark.parametrize("routes", ["host", "device", "host-device", "device-host"])
def test_decode_staging_resets_rows_a_larger_step_left(routes):
    """The persistent rows past a smaller batch carry slot -1 and one KV token again (a stale
    slot could belong to a block since given to another sequence), whichever way each step is
    staged (host: numpy into the pinned buffer; device: the multi-tensor copy); the graph derives
    the KV prefix sums from them for a backend that reads those."""
    graphs = _graphs(
        routes,
        lambda ids, pos, m: m.slot_mapping.clone(),
        [_PrefixSumReader(False), _PrefixSumReader(True)],
    )
    host = PagedHost(64, 16)
    ids, pos, meta = host.step([(i, [1] * (3 + i)) for i in range(4)])
    ids, pos, meta = host.step([(i, [2]) for i in range(4)])
    assert graphs.run(ids, pos, meta, bucket=4).tolist() == meta.slot_mapping.tolist()
    ids, pos, meta = host.step([(2, [3])])
    graphs.run(ids, pos, meta, bucket=4)
    padded, _ = graphs._padded_metadata(4)
    n = meta.kv_seq_lens_host.item()
    assert padded.slot_mapping.tolist() == meta.slot_mapping.tolist() + [-1, -1, -1]
    assert padded.kv_seq_lens.tolist() == [n, 1, 1, 1]
    assert padded.kv_seq_lens_host.tolist() == padded.kv_seq_lens.tolist()
    assert padded.kv_cu_seq_lens.tolist() == [0, n, n + 1, n + 2, n + 3]


def test_decode_graph_derives_no_prefix_sums_that_no_backend_reads():
    """With no backend reading ``kv_cu_seq_lens``, the captured step leaves it unwritten (on CUDA
    its prefix sum is two kernels a step); the block table is laid out all the same."""
    graphs = _graphs(
        "host", lambda ids, pos, m: m.block_table[:, :2].clone(), [_PrefixSumReader(False)]
    )
    host = PagedHost(64, 16)
    host.step([(i, [1] * (20 + i)) for i in range(3)])
    ids, pos, meta = host.step([(i, [2]) for i in range(3)])
    table = graphs.run(ids, pos, meta, bucket=4)
    assert table[:3].tolist() == meta.block_table[:, :2].tolist()
    assert graphs._padded_metadata(4)[0].kv_cu_seq_lens.tolist() == [0] * 5


def _echo_graphs(routes: str) -> RoutedGraphs:
    """Decode graphs whose "model" returns each row's id, position and slot: what the graph
    read."""
    return _graphs(routes, lambda ids, pos, m: torch.stack([ids, pos, m.slot_mapping], dim=1))


@pytest.mark.parametrize("routes", ["ids", "host-ids", "ids-device"])
def test_decode_ids_handed_apart_are_copied_in_after_the_pinned_copy(routes):
    """A served decode step hands its metadata on the host and its ids where the step before
    sampled them (int64, on the device): the graph reads exactly those ids over the stale ones
    the pinned buffer carries, with the step's own positions and slots, whichever route the
    steps around it take."""
    graphs = _echo_graphs(routes)
    host = PagedHost(64, 16)
    host.step([(i, [1] * (3 + i)) for i in range(3)])
    for step in range(4):
        ids, pos, meta = host.step([(i, [step]) for i in range(3)])
        sampled = torch.tensor([100 + 10 * step + i for i in range(3)])  # int64, as sampled
        route = graphs.routes[step % len(graphs.routes)]
        out = graphs.run(sampled if route == "ids" else ids, pos, meta, bucket=4)
        want = sampled if route == "ids" else ids
        assert out[:, 0].tolist() == want.tolist()
        assert out[:, 1].tolist() == pos.tolist()
        assert out[:, 2].tolist() == meta.slot_mapping.tolist()


@pytest.mark.parametrize("routes", ["host", "device", "host-device"])
def test_decode_ids_written_into_token_ids_are_read_in_place(routes):
    """A caller that samples on the device writes the next step's tokens into
    ``token_ids(b)`` and hands that view as the ids: the graph reads them where they are (the
    pinned upload starts past them, the device route copies none) with the step's own
    positions and slots; a step with ids of its own still overwrites them."""
    graphs = _echo_graphs(routes)
    starts = []
    upload = graphs.packed.upload
    graphs.packed.upload = lambda *a, **k: starts.append(k.get("start", 0)) or upload(*a, **k)
    assert graphs.token_ids(9) is None and graphs.token_ids(8).dtype == torch.int32
    host = PagedHost(64, 16)
    host.step([(i, [1] * (3 + i)) for i in range(3)])
    for step in range(4):
        ids, pos, meta = host.step([(i, [step]) for i in range(3)])
        in_place = step % 2 == 1
        if in_place:
            graphs.token_ids(3).copy_(torch.tensor([100 + 10 * step + i for i in range(3)]))
            want = graphs.token_ids(3).tolist()
            ids = graphs.token_ids(3)
        else:
            want = ids.tolist()
        out = graphs.run(ids, pos, meta, bucket=4)
        assert out[:3, 0].tolist() == want
        assert out[:3, 1].tolist() == pos.tolist()
        assert out[:3, 2].tolist() == meta.slot_mapping.tolist()
        if graphs._route() == "host":
            assert starts.pop() == (graphs.packed.offsets["positions"] if in_place else 0)
