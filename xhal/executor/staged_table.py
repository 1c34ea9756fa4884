"""The decode graphs' persistent block table, staged densely and laid out inside the graph.

A caller's block table is usually narrower than the persistent one (as wide as its longest
sequence, not ``max_model_len``), and a narrow table copied into the first columns of a wider one
is not a dense destination: the multi-tensor copy that stages a step's other inputs in one launch
cannot take it, so it used to cost a second copy (one more device call per step, 5-15 us of host
time on the H200). Here the caller's table goes as it is into a dense buffer (a dense pair, so it
joins the step's one copy), together with the start of every row in that buffer for this width;
the captured graph then gathers the rows into the persistent table before its first layer.
"""

from __future__ import annotations

import torch

# (rows, width) views kept for reuse; beyond this many the cache starts over, so a long-running
# server whose batch shapes keep changing holds a bounded number of views
_MAX_VIEWS = 4096


class StagedBlockTable:
    """``table`` ``[num_rows, max_width]`` is what a captured graph reads. ``pairs`` gives the
    destination and source of a step's copy, ``lay_out`` the ops a captured step runs first.

    After ``lay_out``, row ``i < rows`` of ``table`` holds the caller's row ``i`` in its first
    ``width`` columns; its later columns and the rows past ``rows`` hold stale entries of the
    dense buffer. Every entry is a block id some step staged (or the initial 0): valid, which is
    all a padding row or a column past a sequence's pages needs (``AttentionMetadata``).
    """

    def __init__(self, num_rows: int, max_width: int, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.num_rows, self.max_width = num_rows, max_width
        self.table = torch.zeros(num_rows, max_width, **i32)
        # the caller's rows back to back; row i at row_start[i] (= i * width), so every gathered
        # index, (num_rows - 1) * width + max_width - 1 at most, stays inside the buffer
        self._dense = torch.zeros(num_rows * max_width, **i32)
        self._row_start = torch.zeros(num_rows, 1, **i32)
        self._columns = torch.arange(max_width, **i32)[None]
        self._index = torch.zeros(num_rows, max_width, **i32)
        self._starts: dict[int, torch.Tensor] = {}  # width -> its row starts (device, made once)
        self._dense_views: dict[tuple[int, int], torch.Tensor] = {}

    def pairs(self, block_table: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) that stage ``block_table`` ``[rows, width]``: both dense when
        the caller's table is (a strided one still copies right, outside the one-launch path)."""
        rows, width = block_table.shape
        dense = self._dense_views.get((rows, width))
        if dense is None:
            if len(self._dense_views) >= _MAX_VIEWS:
                self._dense_views.clear()
            dense = self._dense_views[rows, width] = self._dense[: rows * width].view(rows, width)
        starts = self._starts.get(width)
        if starts is None:  # once per width: an upload outside any graph
            starts = torch.arange(self.num_rows, dtype=torch.int32).view(-1, 1) * width
            starts = self._starts[width] = starts.to(self._dense.device)
        return [dense, self._row_start], [block_table, starts]

    def lay_out(self, bucket: int) -> None:
        """Gather the staged rows into ``table[:bucket]``; run inside the bucket's captured step
        (two small kernels there, none on the host per step)."""
        index = self._index[:bucket]
        torch.add(self._row_start[:bucket], self._columns, out=index)  # [bucket, max_width]
        torch.index_select(self._dense, 0, index.view(-1), out=self.table[:bucket].view(-1))
