"""The decode graphs' persistent block table, staged densely and laid out inside the graph.

A caller's block table is usually narrower than the persistent one (as wide as its longest
sequence, not ``max_model_len``), and a narrow table copied into the first columns of a wider one
is not a dense destination: it would cost a copy of its own (one more device call per step, 5-15
us of host time on the H200). Here the caller's table goes as it is into a dense buffer, with its
width in a one-value field beside it, both inside the step's one copy (``packed_inputs.py``); the
captured graph then works out every row's start from the width and gathers the rows into the
persistent table before its first layer.
"""

from __future__ import annotations

import torch

# (rows, width) views kept for reuse; beyond this many the cache starts over, so a long-running
# server whose batch shapes keep changing holds a bounded number of views
_MAX_VIEWS = 4096


class StagedBlockTable:
    """``table`` ``[num_rows, max_width]`` is what a captured graph reads; ``dense``
    ``[num_rows * max_width]`` and ``width`` ``[1]`` (device views the step's copy writes) are
    where a step stages its table, ``lay_out`` the ops a captured step runs first.

    After ``lay_out``, row ``i < rows`` of ``table`` holds the caller's row ``i`` in its first
    ``width`` columns; its later columns and the rows past ``rows`` hold stale entries of the
    dense buffer. Every entry is a block id some step staged (or the initial 0): valid, which is
    all a padding row or a column past a sequence's pages needs (``AttentionMetadata``).
    """

    def __init__(self, dense: torch.Tensor, width: torch.Tensor, max_width: int) -> None:
        device, i32 = dense.device, torch.int32
        self.num_rows, self.max_width = dense.numel() // max_width, max_width
        self.dense, self.width = dense, width
        self.table = torch.zeros(self.num_rows, max_width, dtype=i32, device=device)
        # row i starts at i * width, so every gathered index, (num_rows - 1) * width + max_width
        # - 1 at most, stays inside the dense buffer
        self._rows = torch.arange(self.num_rows, dtype=i32, device=device)[:, None]
        self._columns = torch.arange(max_width, dtype=i32, device=device)[None]
        self._index = torch.zeros(self.num_rows, max_width, dtype=i32, device=device)
        self._widths: dict[int, torch.Tensor] = {}  # width -> that value on the device, made once
        self._dense_views: dict[tuple[int, int], torch.Tensor] = {}

    def pairs(
        self, block_table: torch.Tensor, with_width: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) that stage a device ``block_table`` ``[rows, width]`` in a
        multi-tensor copy (the path of a step whose tensors are already on the device); without
        ``with_width`` the width field is left as it is (a caller that knows it holds ``width``
        already saves a pair)."""
        rows, width = block_table.shape
        dense = self._dense_views.get((rows, width))
        if dense is None:
            if len(self._dense_views) >= _MAX_VIEWS:
                self._dense_views.clear()
            dense = self._dense_views[rows, width] = self.dense[: rows * width].view(rows, width)
        if not with_width:
            return [dense], [block_table]
        value = self._widths.get(width)
        if value is None:  # once per width: an upload outside any graph
            value = self._widths[width] = torch.tensor([width], dtype=torch.int32).to(
                self.dense.device
            )
        return [dense, self.width], [block_table, value]

    def lay_out(self, bucket: int) -> None:
        """Gather the staged rows into ``table[:bucket]``; run inside the bucket's captured step
        (two small kernels there, none on the host per step)."""
        index = self._index[:bucket]  # [bucket, max_width]: row * width + column
        torch.addcmul(self._columns, self._rows[:bucket], self.width, out=index)
        torch.index_select(self.dense, 0, index.view(-1), out=self.table[:bucket].view(-1))
