"""A host-built step moved for the eager and piecewise runners: every host int32 tensor on the
device in one packed copy, the host twins left on the host, nothing moved on a host device."""

from __future__ import annotations

import torch

from xhal.executor.host_step import on_device
from xhal.interfaces import AttentionMetadata, BatchKind


def _step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    q, kv = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([3, 9], dtype=torch.int32)
    table = torch.tensor([[4, 0], [5, 6]], dtype=torch.int32)
    slots = torch.tensor([64, 65, 66, 104], dtype=torch.int32)
    meta = AttentionMetadata.from_host_lengths(BatchKind.MIXED, q, kv, table, slots)
    return torch.arange(4, dtype=torch.int32), torch.tensor([0, 1, 2, 8]), meta


def test_a_host_step_moves_to_the_device_in_one_buffer() -> None:
    ids, pos, meta = _step()
    device = torch.device("meta")  # a device apart from the host, on any machine
    ids_d, pos_d, meta_d = on_device(ids, pos, meta, device)
    moved = [ids_d, meta_d.q_cu_seq_lens, meta_d.kv_cu_seq_lens, meta_d.q_seq_lens,
             meta_d.kv_seq_lens, meta_d.block_table, meta_d.slot_mapping]  # fmt: skip
    given = [ids, meta.q_cu_seq_lens, meta.kv_cu_seq_lens, meta.q_seq_lens, meta.kv_seq_lens,
             meta.block_table, meta.slot_mapping]  # fmt: skip
    for d, h in zip(moved, given):
        assert d.device == device and d.shape == h.shape and d.dtype == torch.int32
    storages = {t.untyped_storage().nbytes() for t in moved}
    assert len(storages) == 1  # views of one packed buffer: one copy
    assert pos_d.device == device and pos_d.dtype == torch.int64  # not int32: its own copy
    assert meta_d.kv_seq_lens_host is meta.kv_seq_lens_host  # planners read the host twins
    assert (meta_d.num_seqs, meta_d.num_tokens, meta_d.kind) == (2, 4, BatchKind.MIXED)


def test_nothing_moves_on_a_host_device_or_when_already_there() -> None:
    ids, pos, meta = _step()
    assert on_device(ids, pos, meta, torch.device("cpu")) == (ids, pos, meta)
    device = torch.device("meta")
    ids_d, pos_d, meta_d = on_device(ids, pos, meta, device)
    again = on_device(ids_d, pos_d, meta_d, device)
    assert again[0] is ids_d and again[1] is pos_d and again[2] is meta_d
