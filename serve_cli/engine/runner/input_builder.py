"""A scheduled batch -> the executor's step inputs, through xLLM's C++ metadata layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from xhal.adapter import from_xllm, to_xllm
from xhal.adapter.upload import upload

if TYPE_CHECKING:
    from serve_cli.engine.batch import ScheduledBatch
    from xhal.interfaces.metadata import AttentionMetadata


@dataclass(frozen=True)
class HostStep:
    """One step's inputs as plain host values: flattened ``input_ids`` / ``positions`` /
    ``slot_mapping`` ``[T]``, per-sequence ``q_seq_lens`` / ``kv_seq_lens`` and ``block_tables``
    rows, the sampled rows ``selected_idxes`` for ``sampled_request_ids``. Small and picklable:
    rank 0 sends it to the tensor-parallel workers, and every rank uploads it the same way."""

    input_ids: list[int]
    positions: list[int]
    q_seq_lens: list[int]
    kv_seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    selected_idxes: list[int]
    sampled_request_ids: list[str]


@dataclass(frozen=True)
class ModelInput:
    """One step's inputs: int32 ``input_ids`` / ``positions`` ``[T]`` on the device, the
    normalized ``metadata``, and the rows whose logits are sampled (``selected_idxes`` int32
    ``[S]``: the last token of each chunk that produces a token), for ``sampled_request_ids`` in
    that order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    selected_idxes: torch.Tensor
    sampled_request_ids: list[str]


class InputBuilder:
    """Lays a ``ScheduledBatch`` out as xLLM's C++ builder would for the device (``convention``
    "cuda" or "npu"), then normalizes it with ``xhal.adapter.from_xllm``: the served path goes
    through the same adapter a C++ host's metadata does."""

    def __init__(self, device: torch.device, convention: str, block_size: int) -> None:
        self.device, self.convention, self.block_size = device, convention, block_size

    def build(self, batch: ScheduledBatch) -> ModelInput:
        return self.upload(self.describe(batch))

    def describe(self, batch: ScheduledBatch) -> HostStep:
        """The batch flattened into host lists (no torch)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        selected: list[int] = []
        sampled: list[str] = []
        for seq in batch.requests:
            input_ids += seq.token_ids
            positions += seq.positions
            slots += seq.slot_mapping
            if seq.produces_token:
                selected.append(len(input_ids) - 1)
                sampled.append(seq.request_id)
        return HostStep(
            input_ids,
            positions,
            [seq.num_tokens for seq in batch.requests],
            [seq.end_position for seq in batch.requests],
            [seq.block_table for seq in batch.requests],
            slots,
            selected,
            sampled,
        )

    def upload(self, step: HostStep) -> ModelInput:
        """``step`` on the device, its metadata in the C++ layout normalized by the adapter."""
        view = to_xllm(
            step.q_seq_lens,
            step.kv_seq_lens,
            step.block_tables,
            step.slot_mapping,
            self.convention,
            self.device,
            # xLLM's CUDA builder also emits FlashInfer's paged-KV index arrays
            block_size=self.block_size if self.convention == "cuda" else None,
        )
        metadata = from_xllm(view, self.convention)
        host = {
            "input_ids": torch.tensor(step.input_ids, dtype=torch.int32),
            "positions": torch.tensor(step.positions, dtype=torch.int32),
            "selected_idxes": torch.tensor(step.selected_idxes, dtype=torch.int32),
        }
        dev = upload(host, self.device)
        return ModelInput(
            dev["input_ids"],
            dev["positions"],
            metadata,
            dev["selected_idxes"],
            step.sampled_request_ids,
        )
