"""The executor's layer synchronizer: ``record_event(layer_id)`` once per layer, in order, each
event coming when that layer (and no later one) has written the step's K/V, eagerly; after a
decode graph's replay, once per layer in order with every layer written."""

from __future__ import annotations

import pytest
import torch

import xhal
from models.loader import load_model
from tests.support.paged_host import PagedHost
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces import BatchKind

pytest.importorskip("transformers", reason="tiny checkpoints are built with transformers")


class WrittenLayers:
    """Records, per event, its layer id and which layers' K caches hold a key at ``slot`` yet
    (read straight from the bound caches: an independent view of what has run)."""

    def __init__(self, caches: list, block_size: int) -> None:
        self.caches, self.block_size = caches, block_size
        self.slot = 0
        self.events: list[tuple[int, list[bool]]] = []

    def record_event(self, layer_id: int) -> None:
        block, offset = divmod(self.slot, self.block_size)
        written = [bool(c.key[block, offset].abs().sum() > 0) for c in self.caches]
        self.events.append((layer_id, written))


def _executor(model_dir, enforce_eager: bool) -> tuple[ModelExecutor, list]:
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    config = ExecutorConfig(
        block_size=16, max_num_seqs=4, max_model_len=128, enforce_eager=enforce_eager,
        decode_graph_sizes=(1,), piecewise_token_sizes=(),
    )
    executor = ModelExecutor(model, xhal.platforms.get("cpu"), config)
    caches = executor.allocate_kv_caches(num_blocks=16)
    executor.bind_kv_caches(caches)
    return executor, caches


def _run(executor, caches, host: PagedHost, chunks) -> WrittenLayers:
    ids, pos, meta = host.step(chunks)
    sync = WrittenLayers(caches, host.block_size)
    sync.slot = int(meta.slot_mapping[-1])
    executor.execute(ids, pos, meta, layer_synchronizer=sync)
    return sync


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_one_event_per_layer_in_order_after_its_kv_write(checkpoint_factory, enforce_eager):
    executor, caches = _executor(checkpoint_factory("llama_tied"), enforce_eager)
    num_layers = len(caches)
    assert num_layers >= 2  # otherwise "in order" says nothing
    host = PagedHost(16, 16)
    prefill = _run(executor, caches, host, [(0, [5, 9, 11, 3])])  # a prefill runs eagerly
    assert [i for i, _ in prefill.events] == list(range(num_layers))
    for i, written in prefill.events:  # layer i is done, layer i + 1 has not started
        assert written == [j <= i for j in range(num_layers)]

    if not enforce_eager:
        executor.capture_graphs(progress=False)
    decode = _run(executor, caches, host, [(0, [7])])
    assert [i for i, _ in decode.events] == list(range(num_layers))
    if enforce_eager:
        for i, written in decode.events:
            assert written == [j <= i for j in range(num_layers)]
    else:
        assert executor.decode_graphs is not None and executor.decode_graphs.graphs
        assert all(all(written) for _, written in decode.events)  # recorded after the replay


def test_no_synchronizer_leaves_no_hook(checkpoint_factory):
    executor, caches = _executor(checkpoint_factory("llama_tied"), enforce_eager=True)
    host = PagedHost(16, 16)
    _run(executor, caches, host, [(0, [5, 9])])
    ids, pos, meta = host.step([(0, [4])])
    assert meta.kind == BatchKind.DECODE
    assert all(not layer._forward_hooks for layer in executor._attention_layers)
    executor.execute(ids, pos, meta)  # runs without a synchronizer after one was used
