"""A scheduled batch -> the executor's step inputs, through xLLM's C++ metadata layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from serve_cli.engine.batch import PLACEHOLDER_TOKEN_ID
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
    rank 0 sends it to the tensor-parallel workers, and every rank uploads it the same way.

    With async scheduling, ``input_ids[placeholder_idxes[i]]`` is ``PLACEHOLDER_TOKEN_ID``: the
    token the previous step samples for ``placeholder_request_ids[i]``, filled in on the device.
    """

    input_ids: list[int]
    positions: list[int]
    q_seq_lens: list[int]
    kv_seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    selected_idxes: list[int]
    sampled_request_ids: list[str]
    placeholder_idxes: list[int] = field(default_factory=list)
    placeholder_request_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PreviousTokens:
    """The tokens the step before samples, still on the device: int64 ``tokens[i]`` is
    ``request_ids[i]``'s."""

    request_ids: Sequence[str]
    tokens: torch.Tensor


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
        holes: list[int] = []
        hole_ids: list[str] = []
        for seq in batch.requests:
            for i, token in enumerate(seq.token_ids):
                if token == PLACEHOLDER_TOKEN_ID:
                    holes.append(len(input_ids) + i)
                    hole_ids.append(seq.request_id)
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
            holes,
            hole_ids,
        )

    def upload(self, step: HostStep, previous: PreviousTokens | None = None) -> ModelInput:
        """``step`` on the device, its metadata in the C++ layout normalized by the adapter; its
        placeholders gathered on the device from ``previous`` (no host round trip)."""
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
        if step.placeholder_idxes:
            host["holes"] = torch.tensor(step.placeholder_idxes, dtype=torch.int32)
            host["sources"] = torch.tensor(_rows(step, previous), dtype=torch.int32)
        dev = upload(host, self.device)
        if step.placeholder_idxes:
            assert previous is not None
            tokens = previous.tokens.index_select(0, dev["sources"].long())
            dev["input_ids"].index_copy_(0, dev["holes"].long(), tokens.to(torch.int32))
        return ModelInput(
            dev["input_ids"],
            dev["positions"],
            metadata,
            dev["selected_idxes"],
            step.sampled_request_ids,
        )


def require_previous(step: HostStep, previous: PreviousTokens | None) -> None:
    """``ValueError`` when ``step`` has placeholders and no ``previous`` tokens to fill them."""
    if step.placeholder_idxes and previous is None:
        raise ValueError("the step feeds tokens sampled by a previous step, but none was given")


def _rows(step: HostStep, previous: PreviousTokens | None) -> list[int]:
    """Each placeholder's row in ``previous.tokens``."""
    require_previous(step, previous)
    row_of = {rid: i for i, rid in enumerate(previous.request_ids)}
    missing = [r for r in step.placeholder_request_ids if r not in row_of]
    if missing:
        raise ValueError(f"the previous step sampled no token for {missing}")
    return [row_of[r] for r in step.placeholder_request_ids]
