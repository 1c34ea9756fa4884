"""The skinny GEMM's data layout, emulated on the CPU: the index arithmetic of
``kernels/skinny_mma.cu`` (mma.sync build) replayed lane by lane in numpy against the PTX
semantics of what it calls, so that a wrong lane mapping fails here rather than on the GPU.

What is emulated, from the PTX ISA:
- TMA with the 128-byte swizzle writes 16-byte chunk c of a 128-byte tile row r to chunk
  c ^ (r % 8) of that row (the tile starting on 1024 bytes);
- ``ldmatrix.x4``: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane t receives, in its
  register i, elements 2 (t % 4) and 2 (t % 4) + 1 of row t / 4 of matrix i;
- ``mma.m16n8k16.row.col``: with g = lane / 4 and c = lane % 4, A's registers hold A[g][2c:2c+2],
  A[g+8][2c:2c+2], A[g][2c+8:2c+10], A[g+8][2c+8:2c+10]; B's hold B[2c:2c+2][g] and
  B[2c+8:2c+10][g]; the accumulator holds D[g][2c:2c+2] and D[g+8][2c:2c+2].

The kernel's own formulas (``a_row``, ``b_row``, the chunks, the partial tile's ``r`` / ``c``,
the cluster's column shares and K ranges) are copied below from the source, which the test reads
to make sure they are still the ones it has there."""

from __future__ import annotations

import numpy as np
import pytest

from xhal.platforms.cuda.kernels import skinny_mma

# the source lines this emulation copies; a change there must be carried here
FORMULAS = (
    "const u32 a_row = warp * WR + (lane & 15), a_chunk = lane >> 4;",
    "const u32 b_row = (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;",
    "ldmatrix_x4(a[i], swizzled(wt, a_row + i * 16, 2 * kk + a_chunk));",
    "ldmatrix_x4(r, swizzled(xt, b_row + j * 16, 2 * kk + b_chunk));",
    "const u32 r = warp * WR + i * 16 + (lane >> 2) + ((e >> 1) << 3);",
    "const u32 c = j * 8 + 2 * (lane & 3) + (e & 1);",
    "part[c * PSTRIDE + r] = acc[i][j][e];",
    "const u32 q0 = rank * QUADS / KS, quads = (rank + 1) * QUADS / KS - q0;",
    "const u32 c = q / quads, r = (q0 + q % quads) * 4;",
    "const u32 first = rank * kchunks / KS, steps = (rank + 1) * kchunks / KS - first;",
    "return tile + row * 128 + ((chunk ^ (row & 7)) << 4);",
)


def test_the_emulated_formulas_are_the_sources() -> None:
    source = " ".join(skinny_mma.SOURCE.read_text().split())
    for line in FORMULAS:
        assert line in source, f"skinny_mma.cu no longer has: {line}"


def swizzled(row: int, chunk: int) -> int:
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def tma_tile(block: np.ndarray) -> np.ndarray:
    """A [rows, 64] block of 16-bit values as TMA lays it out in shared memory (16-bit words)."""
    rows = block.shape[0]
    smem = np.zeros(rows * 64, dtype=np.int64)
    for r in range(rows):
        for c in range(8):
            at = swizzled(r, c) // 2
            smem[at : at + 8] = block[r, 8 * c : 8 * c + 8]
    return smem


def ldmatrix_x4(smem: np.ndarray, addresses: list[int]) -> np.ndarray:
    """regs[lane][i] = the two 16-bit values lane receives from matrix i (byte addresses)."""
    regs = np.zeros((32, 4, 2), dtype=np.int64)
    for t in range(32):
        for i in range(4):
            row = addresses[8 * i + t // 4] // 2
            regs[t, i] = smem[row + 2 * (t % 4) : row + 2 * (t % 4) + 2]
    return regs


def mma16816(acc: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
    """acc[lane][4] += A (from a[lane][4][2]) . B (from b0 / b1[lane][2]), PTX fragment layout."""
    A = np.zeros((16, 16), dtype=np.int64)
    B = np.zeros((16, 8), dtype=np.int64)
    for t in range(32):
        g, c = t // 4, t % 4
        A[g, 2 * c : 2 * c + 2] = a[t, 0]
        A[g + 8, 2 * c : 2 * c + 2] = a[t, 1]
        A[g, 2 * c + 8 : 2 * c + 10] = a[t, 2]
        A[g + 8, 2 * c + 8 : 2 * c + 10] = a[t, 3]
        B[2 * c : 2 * c + 2, g] = b0[t]
        B[2 * c + 8 : 2 * c + 10, g] = b1[t]
    D = A @ B
    for t in range(32):
        g, c = t // 4, t % 4
        acc[t, 0:2] += D[g, 2 * c : 2 * c + 2]
        acc[t, 2:4] += D[g + 8, 2 * c : 2 * c + 2]


def cta_partial(w: np.ndarray, x: np.ndarray, wr: int, warps: int, mt: int, chunks) -> np.ndarray:
    """One CTA's partial tile part[c][r] over the 64-column chunks it streams."""
    bn = wr * warps
    acc = np.zeros((warps, wr // 16, mt // 8, 32, 4), dtype=np.int64)
    for chunk in chunks:
        wt = tma_tile(w[:, 64 * chunk : 64 * chunk + 64])
        xt = tma_tile(x[:, 64 * chunk : 64 * chunk + 64])
        for warp in range(warps):
            lanes = range(32)
            a_row = [warp * wr + (lane & 15) for lane in lanes]
            a_chunk = [lane >> 4 for lane in lanes]
            b_row = [(lane & 7) + ((lane >> 4) << 3) for lane in lanes]
            b_chunk = [(lane >> 3) & 1 for lane in lanes]
            for kk in range(4):
                a = []
                for i in range(wr // 16):
                    at = [swizzled(a_row[t] + i * 16, 2 * kk + a_chunk[t]) for t in lanes]
                    a.append(ldmatrix_x4(wt, at))
                b = []
                for j in range(mt // 16):
                    at = [swizzled(b_row[t] + j * 16, 2 * kk + b_chunk[t]) for t in lanes]
                    r = ldmatrix_x4(xt, at)
                    b += [(r[:, 0], r[:, 1]), (r[:, 2], r[:, 3])]
                for i in range(wr // 16):
                    for j in range(mt // 8):
                        mma16816(acc[warp, i, j], a[i], *b[j])
    part = np.zeros((mt, bn), dtype=np.int64)
    for warp in range(warps):
        for i in range(wr // 16):
            for j in range(mt // 8):
                for lane in range(32):
                    for e in range(4):
                        r = warp * wr + i * 16 + (lane >> 2) + ((e >> 1) << 3)
                        c = j * 8 + 2 * (lane & 3) + (e & 1)
                        part[c, r] = acc[warp, i, j, lane, e]
    return part


# the last: a cluster of 3 over 5 chunks and 16 float4 columns, neither split even
@pytest.mark.parametrize(
    "wr,warps,mt,ks,kchunks", [(32, 2, 16, 2, 3), (16, 4, 32, 4, 4), (16, 4, 16, 3, 5)]
)
def test_a_cluster_computes_x_times_w_transposed(wr, warps, mt, ks, kchunks) -> None:
    bn = wr * warps
    rng = np.random.default_rng(0)
    w = rng.integers(-4, 5, size=(bn, 64 * kchunks))  # small integers: the sums are exact
    x = rng.integers(-4, 5, size=(mt, 64 * kchunks))
    parts = []
    for rank in range(ks):
        first = rank * kchunks // ks
        steps = (rank + 1) * kchunks // ks - first
        parts.append(cta_partial(w, x, wr, warps, mt, range(first, first + steps)))
    out = np.zeros((mt, bn), dtype=np.int64)
    written = np.zeros((mt, bn), dtype=np.int64)
    for rank in range(ks):  # each CTA stores its share of the columns, summed in rank order
        q0 = rank * (bn // 4) // ks
        quads = (rank + 1) * (bn // 4) // ks - q0
        for q in range(mt * quads):
            c, r = q // quads, (q0 + q % quads) * 4
            out[c, r : r + 4] = sum(p[c, r : r + 4] for p in parts)
            written[c, r : r + 4] += 1
    assert (written == 1).all()  # every element stored once, by one CTA
    np.testing.assert_array_equal(out, x @ w.T)
