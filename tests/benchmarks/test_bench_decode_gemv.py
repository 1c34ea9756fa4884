"""``benchmarks/bench_decode_gemv.py``'s sweep grid and the table ``BENCH_GEMV_TABLE`` loads into
the model benchmarks (``pdl_variants.load_gemv_table``, and the peers' tables), on the CPU (the
timings need the H200)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_decode_gemv, pdl_variants
from xhal.platforms.cuda.kernels import fused_gemv
from xhal.platforms.cuda.kernels.gemv import GemvConfig


@pytest.mark.parametrize("key", sorted(bench_decode_gemv.PROJECTIONS.values()), ids=str)
def test_the_grid_starts_with_the_tree_shape_then_tries_tma_tiles(key) -> None:
    prologue, n, k = key
    grid = bench_decode_gemv.candidates(prologue, n, k, 132)
    assert grid[0] == tuple(fused_gemv.fused_gemv_config(1, n, k, 132, prologue))
    assert len(set(grid)) == len(grid)
    for c in grid:
        assert len(c) == 6 and all(v >= 1 for v in c[:5]) and c[5] in (0, 1)
        assert c[0] & (c[0] - 1) == 0 and c[1] & (c[1] - 1) == 0
    tma = [c for c in grid if c[5]]
    assert tma and all(c[4] >= 2 for c in tma)  # a pipeline needs two stages or more
    assert tuple(grid[0][:4]) in {c[:4] for c in tma}  # the tree's own tiles through TMA


def test_a_table_file_replaces_the_rows_it_names(tmp_path, monkeypatch) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps([[1, 640, 4096, 2, 2048, 1, 4, 3, 1]]))
    monkeypatch.setenv("BENCH_GEMV_TABLE", str(path))
    saved = dict(fused_gemv.TUNED)
    try:
        pdl_variants.load_gemv_table()
        got = fused_gemv.fused_gemv_config(1, 640, 4096, 132, 1)
        assert got == GemvConfig(2, 2048, 1, 4, 3, tma=1)
        assert {k: v for k, v in fused_gemv.TUNED.items() if k != (1, 640, 4096)} == saved
        # the peer's table: the tree's as committed
        assert pdl_variants.tree_table() == saved
    finally:
        fused_gemv.TUNED.clear()
        fused_gemv.TUNED.update(saved)
        pdl_variants._TREE_TUNED.clear()
