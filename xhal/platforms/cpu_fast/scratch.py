"""A reused float32 buffer for a fused op's intermediate that the op itself consumes (the gated
activation a down projection reads at once): a prefill's fresh [T, I] tensor costs its pages
being faulted in and zeroed by the kernel every layer (SmolLM2's 1,300 x 1,536 SiLU output: 2.3
against 1.35 ms into a buffer already touched, one thread), the reused buffer only once."""

from __future__ import annotations

import torch

MIN_ELEMENTS = 1 << 18  # smaller intermediates come from the allocator's cache anyway


class Scratch:
    """One growing flat buffer. ``take(rows, cols)`` views its front as ``[rows, cols]``: valid
    until the next ``take``, so only for an intermediate consumed before the op returns, never
    for a tensor handed back. Not for autograd (a later ``take`` overwrites what a backward pass
    would need): callers keep fresh tensors when grad mode is on."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        size = rows * cols
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size)
        return self._buffer[:size].view(rows, cols)


def worth_it(x: torch.Tensor, cols: int) -> bool:
    """For an intermediate of ``x.shape[0] x cols`` float32 elements, outside autograd."""
    return x.shape[0] * cols >= MIN_ELEMENTS and not torch.is_grad_enabled()
