"""A scheduled batch -> the executor's step inputs, through xLLM's C++ metadata layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from serve_cli.engine.batch import PLACEHOLDER_TOKEN_ID
from xhal.adapter.from_xllm import from_xllm
from xhal.adapter.host_metadata import host_metadata
from xhal.adapter.to_xllm import to_xllm_step
from xhal.env import check_metadata
from xhal.interfaces.metadata import BatchKind

if TYPE_CHECKING:
    from serve_cli.engine.batch import ScheduledBatch
    from xhal.interfaces.metadata import AttentionMetadata


@dataclass(frozen=True)
class HostStep:
    """One step's inputs as host values: int32 numpy ``input_ids`` / ``positions`` /
    ``slot_mapping`` ``[T]``, per-sequence ``q_seq_lens`` / ``kv_seq_lens`` ``[B]`` and the
    ``block_tables`` rows (the scheduler's lists), the sampled rows ``selected_idxes`` ``[S]`` for
    ``sampled_request_ids`` (strictly increasing: the last token of each chunk that samples).
    Small and picklable: rank 0 sends it to the tensor-parallel workers, and every rank uploads
    it the same way.

    With async scheduling, ``input_ids[placeholder_idxes[i]]`` is ``PLACEHOLDER_TOKEN_ID``: the
    token the previous step samples for ``placeholder_request_ids[i]``, filled in on the device.

    Requests that score their prompt: the logits of rows ``prompt_rows`` ``[P]`` give the logprobs
    of ``prompt_targets`` ``[P]``; ``scored_prompts`` lists ``(request_id, first, count)``, their
    rows in order (the prompt positions ``first ..`` of each).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    q_seq_lens: np.ndarray
    kv_seq_lens: np.ndarray
    block_tables: list[list[int]]
    slot_mapping: np.ndarray
    selected_idxes: np.ndarray
    sampled_request_ids: list[str]
    placeholder_idxes: list[int] = field(default_factory=list)
    placeholder_request_ids: list[str] = field(default_factory=list)
    prompt_rows: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    scored_prompts: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class PreviousTokens:
    """The tokens the step before samples, still on the device: ``tokens[i]`` (int64, or int32
    where the sampler wrote them into the executor's ``token_ids``) is ``request_ids[i]``'s."""

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
    prompt_rows: torch.Tensor | None = None  # HostStep's, as host tensors
    prompt_targets: torch.Tensor | None = None


class InputBuilder:
    """Lays a ``ScheduledBatch`` out as xLLM's C++ builder would for the device (``convention``
    "cuda" or "npu"), then normalizes it with ``xhal.adapter.from_xllm``: the served path goes
    through the same adapter a C++ host's metadata does. The step is built once, with numpy, and
    every device tensor of it (ids, positions, lengths, slots, sampled rows, block table, paged-KV
    arrays) reaches the device in one packed copy. The adapter's value checks and
    ``AttentionMetadata.validate`` run only under ``XHAL_CHECK_METADATA=1``: this builder's
    layout is right by construction, and the checks cost more host time than the rest."""

    def __init__(self, device: torch.device, convention: str, block_size: int) -> None:
        self.device, self.convention, self.block_size = device, convention, block_size
        self.check = check_metadata()
        # xLLM's CUDA builder also emits FlashInfer's paged-KV index arrays
        self._paged_block_size = block_size if convention == "cuda" else None

    def build(self, batch: ScheduledBatch) -> ModelInput:
        return self.upload(self.describe(batch))

    def describe(self, batch: ScheduledBatch) -> HostStep:
        """The batch flattened into host arrays (no torch)."""
        # One pass over the sequences into flat lists, then one array per field: a decode step
        # holds a few ints each, for which every numpy call costs more than the values do.
        q_lens: list[int] = []
        kv_lens: list[int] = []
        ids: list[int] = []
        slots: list[int] = []
        selected: list[int] = []
        sampled: list[str] = []
        holes: list[int] = []
        owners: list[str] = []
        scored_rows: list[int] = []
        targets: list[int] = []
        scored: list[tuple[str, int, int]] = []
        for s in batch.requests:
            offset, n, start = len(ids), len(s.token_ids), s.start_position
            q_lens.append(n)
            kv_lens.append(start + n)
            ids += s.token_ids
            slots += s.slot_mapping
            if s.produces_token:
                selected.append(offset + n - 1)
                sampled.append(s.request_id)
            if s.prompt_targets:
                count = len(s.prompt_targets)
                scored_rows += range(offset, offset + count)
                targets += s.prompt_targets
                scored.append((s.request_id, start + 1, count))
            if PLACEHOLDER_TOKEN_ID in s.token_ids:
                found = [offset + j for j, t in enumerate(s.token_ids) if t == PLACEHOLDER_TOKEN_ID]
                holes += found
                owners += [s.request_id] * len(found)
        q, kv = _int32(q_lens), _int32(kv_lens)
        if len(ids) == len(q_lens):  # one token per sequence (decodes): each at its last position
            positions = kv - 1
        else:  # token j of sequence i sits at kv_i - q_i + (j - q_cu_i)
            starts = np.cumsum(q) - q  # each sequence's first row
            positions = np.arange(len(ids), dtype=np.int32) - np.repeat(starts - (kv - q), q)
        return HostStep(
            _int32(ids),
            positions.astype(np.int32, copy=False),
            q,
            kv,
            [s.block_table for s in batch.requests],
            _int32(slots),
            _int32(selected),
            sampled,
            holes,
            owners,
            _int32(scored_rows) if scored else None,
            _int32(targets) if scored else None,
            scored,
        )

    def upload(self, step: HostStep, previous: PreviousTokens | None = None) -> ModelInput:
        """``step``'s inputs for ``execute``, its placeholders filled on the device from
        ``previous`` (no host round trip).

        A decode step whose ids are all known, or all the previous step's tokens in its order
        (steady decode), is handed on as host tensors (``host_metadata``): the executor stages it
        itself, in one pinned copy for a decode graph or one packed upload otherwise, so an upload
        here would be a second copy. Any other step goes on the device here, its metadata in the
        C++ layout normalized by the adapter."""
        holes = step.placeholder_idxes
        sources = _rows(step, previous) if holes else []
        in_order = sources == holes == list(range(len(holes)))
        num_tokens = len(step.input_ids)
        every_row = in_order and len(holes) == num_tokens
        if num_tokens == len(step.q_seq_lens) and (not holes or every_row):
            return self._host_decode(step, previous if holes else None)
        return self._device_step(step, previous, holes, sources, in_order)

    def _host_decode(self, step: HostStep, previous: PreviousTokens | None) -> ModelInput:
        """A decode step as host tensors; with ``previous``, every id is its token of the same
        row, still on the device (the executor copies them in with the rest)."""
        # no paged-KV arrays: a decode graph stages none, an eager decode's backend plans from
        # the host lengths
        q, kv, slots = _array(step.q_seq_lens), _array(step.kv_seq_lens), _array(step.slot_mapping)
        metadata = host_metadata(q, kv, step.block_tables, slots, kind=BatchKind.DECODE)
        if self.check:
            metadata.validate()
        n = slots.size
        ids = torch.from_numpy(_array(step.input_ids)) if previous is None else previous.tokens[:n]
        return ModelInput(
            ids,
            torch.from_numpy(_array(step.positions)),
            metadata,
            torch.from_numpy(_array(step.selected_idxes)),
            step.sampled_request_ids,
            *_scored(step),
        )

    def _device_step(
        self,
        step: HostStep,
        previous: PreviousTokens | None,
        holes: list[int],
        sources: list[int],
        in_order: bool,
    ) -> ModelInput:
        """``step`` on the device in one packed copy, its metadata in the C++ layout normalized by
        the adapter; its placeholders filled or gathered on the device from ``previous``."""
        extra = {
            "input_ids": step.input_ids,
            "positions": step.positions,
            "selected_idxes": step.selected_idxes,
        }
        # The placeholders are the step's first n tokens and the previous step's first n rows,
        # in order (decodes ahead of a prompt chunk), so one copy fills them; otherwise a gather
        # through uploaded indices (five small device ops, each a launch on a GPU)
        if holes and not in_order:
            extra |= {"holes": holes, "sources": sources}
        view, dev = to_xllm_step(
            step.q_seq_lens,
            step.kv_seq_lens,
            step.block_tables,
            step.slot_mapping,
            self.convention,
            self.device,
            block_size=self._paged_block_size,
            extra=extra,
        )
        metadata = from_xllm(view, self.convention, check=self.check)
        if holes:
            assert previous is not None
            if in_order:  # int64 tokens (or int32 ones) into the int32 ids, by one copy
                dev["input_ids"][: len(holes)].copy_(previous.tokens[: len(holes)])
            else:
                tokens = previous.tokens.index_select(0, dev["sources"].long())
                dev["input_ids"].index_copy_(0, dev["holes"].long(), tokens.to(torch.int32))
        return ModelInput(
            dev["input_ids"],
            dev["positions"],
            metadata,
            dev["selected_idxes"],
            step.sampled_request_ids,
            *_scored(step),
        )


def _scored(step: HostStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The prompt rows and targets as host tensors (None when no prompt is scored)."""
    if step.prompt_rows is None:
        return None, None
    return torch.from_numpy(step.prompt_rows), torch.from_numpy(step.prompt_targets)


def _array(values: np.ndarray | Sequence[int]) -> np.ndarray:
    """int32 numpy values as they are; a host that filled a ``HostStep`` with lists (the C++
    host's Python twin, examples/cpp_host) gets them converted once."""
    if isinstance(values, np.ndarray) and values.dtype == np.int32:
        return values
    return np.asarray(values, dtype=np.int32)


def _int32(values: list[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int32, count=len(values))  # a fifth faster than np.array


def require_previous(step: HostStep, previous: PreviousTokens | None) -> None:
    """``ValueError`` when ``step`` has placeholders and no ``previous`` tokens to fill them."""
    if step.placeholder_idxes and previous is None:
        raise ValueError("the step feeds tokens sampled by a previous step, but none was given")


def _rows(step: HostStep, previous: PreviousTokens | None) -> list[int]:
    """Each placeholder's row in ``previous.tokens``."""
    require_previous(step, previous)
    wanted = step.placeholder_request_ids
    if list(previous.request_ids[: len(wanted)]) == wanted:  # steady decode: the same order
        return list(range(len(wanted)))
    row_of = {rid: i for i, rid in enumerate(previous.request_ids)}
    missing = [r for r in step.placeholder_request_ids if r not in row_of]
    if missing:
        raise ValueError(f"the previous step sampled no token for {missing}")
    return [row_of[r] for r in step.placeholder_request_ids]
