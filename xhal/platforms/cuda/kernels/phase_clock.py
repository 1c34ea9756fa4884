"""The benchmark-only phase clock of the Triton decode kernels that carry one (``splitkv_decode``,
``moe_router``): a kernel module's ``CLOCK``, an int64 ``[programs, 8]`` tensor, set while a
benchmark captures (benchmarks/phase_clock.py), builds its launches with ``CLOCK``; each program
then stores its ``%globaltimer`` (ns) at the module's ``MARKS`` in its row, and the SM it runs on
in the row's last column (``SM_COLUMN``; the marks take at most 7). A clocked build
stores its start before the PDL wait (into the clock only); the unclocked build is the kernel
without any of it."""

from __future__ import annotations

import triton
import triton.language as tl

# a clock row's last column: the program's SM, not a time (a constexpr, so the kernels read it;
# ``SM_COLUMN.value`` on the host)
SM_COLUMN = tl.constexpr(7)


@triton.jit
def stamp(clock_ptr, row, MARK: tl.constexpr, CLOCK: tl.constexpr):
    """The program's clock at mark ``MARK`` (a no-op unless built with ``CLOCK``)."""
    if CLOCK:
        tl.store(clock_ptr + row * 8 + MARK, tl.extra.cuda.globaltimer())


@triton.jit
def start(clock_ptr, row, LAST: tl.constexpr, CLOCK: tl.constexpr):
    """Mark 0 now, and mark ``LAST``, which only some programs reach, at 0 until they do; the
    program's SM in column ``SM_COLUMN``."""
    if CLOCK:
        tl.store(clock_ptr + row * 8, tl.extra.cuda.globaltimer())
        tl.store(clock_ptr + row * 8 + LAST, 0)
        tl.store(clock_ptr + row * 8 + SM_COLUMN, tl.extra.cuda.smid().to(tl.int64))
