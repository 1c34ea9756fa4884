"""An L2 prefetch from a Triton kernel: ``prefetch.global.L2`` at every address of a pointer
tensor, loading nothing into the program.

What a PDL kernel (``xhal/platforms/cuda/pdl.py``) may touch before its wait is bounded by what
is safe to *load* there; a prefetch loads nothing into registers or L1, and L2 is the GPU's point
of coherence, so a line prefetched before another kernel's store to it is simply updated by that
store. The program that prefetches reads the data with ordinary loads after its wait and gets
what is current either way: a prefetch can only make those loads faster (an L2 hit instead of a
trip to HBM), never wrong. Compiled kernels only: Triton's interpreter runs no inline assembly.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = 128  # one L2 line: one prefetch per line is enough


def line_elements(element_size: int) -> int:
    """Elements of ``element_size`` bytes per L2 line (the stride between prefetched addresses)."""
    return max(1, LINE_BYTES // element_size)


def lines(row_bytes: int) -> int:
    """L2 lines a contiguous row of ``row_bytes`` spans (a power of two, as tl.arange needs)."""
    return triton.next_power_of_2(max(1, -(-row_bytes // LINE_BYTES)))


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the line at each address of ``ptrs`` (a block of pointers, every one inside an
    allocation: point masked-off lanes at a valid address instead). Not pure, so the compiler
    keeps it although its dummy result is unused."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
