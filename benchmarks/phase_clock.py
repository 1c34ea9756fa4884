"""Phase clocks of the split-KV decode launch and the MoE router inside a model's decode graph
(``bench_model --phase-clock``, ``bench_moe --phase-clock``): the graphs captured once more with
the kernels' ``CLOCK`` set (``splitkv_decode.CLOCK``, ``moe_router.CLOCK``), one step replayed,
and each program's ``%globaltimer`` at the launch's phase boundaries read back. Every layer's
launch writes the same rows, so they hold the last layer's, which ran behind the kernels of a
whole step as any layer's does."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from benchmarks import pdl_variants
from benchmarks.common import phase_rows, table
from xhal.executor import ExecutorConfig

MAX_PROGRAMS = 4096  # rows of a clock: the most programs one launch of a decode bucket has
CLOCKED = ("splitkv_decode", "moe_router")  # kernel modules with a CLOCK and its MARKS


@contextlib.contextmanager
def _clocks(device: torch.device) -> Iterator[dict]:
    """A zeroed clock set on each of ``CLOCKED`` while the block runs: {module: clock}."""
    import importlib

    modules = {n: importlib.import_module(f"xhal.platforms.cuda.kernels.{n}") for n in CLOCKED}
    saved = {n: m.CLOCK for n, m in modules.items()}
    clocks = {n: torch.zeros(MAX_PROGRAMS, 8, dtype=torch.int64, device=device) for n in CLOCKED}
    try:
        for n, m in modules.items():
            m.CLOCK = clocks[n]
        yield {n: (clocks[n], modules[n].MARKS) for n in CLOCKED}
    finally:
        for n, m in modules.items():
            m.CLOCK = saved[n]


def kernel_phases(
    model,
    platform,
    config: ExecutorConfig,
    caches,
    variants: Sequence[str],
    step: Callable[[object], object],
) -> dict[tuple[str, str], list[dict]]:
    """Per (variant, kernel module) (``pdl_variants`` names; ``auto`` is the default), the phase
    rows (``common.phase_rows``) of the last layer's launch in one replay of ``step(executor)``
    by an executor captured with the clocks on; none for a kernel the graphs do not launch."""
    phases = {}
    for name in variants:
        with _clocks(platform.device()) as clocks:
            executor = pdl_variants.capture_per_variant(model, platform, config, caches, [name])
        for clock, _ in clocks.values():  # the warm-up's and other buckets' stamps out
            clock.zero_()
        for _ in range(3):  # the last replay's stamps stay
            step(executor[name])
        torch.cuda.synchronize()
        for module, (clock, marks) in clocks.items():
            programs = (clock[:, 0] > 0).nonzero().flatten()
            if programs.numel():
                phases[name, module] = _rows(clock[programs].cpu(), programs.cpu(), marks)
        del executor
    return phases


def _rows(stamped: torch.Tensor, programs: torch.Tensor, marks: Sequence[str]) -> list[dict]:
    """``phase_rows`` of the clocked programs (rows ``programs`` of the clock), each mark's with
    the latest program to reach it and its SM (``phase_clock.SM_COLUMN``), and how many of the
    launch's programs shared that SM."""
    from xhal.platforms.cuda.kernels.phase_clock import SM_COLUMN  # triton: GPU runs only

    column = SM_COLUMN.value
    rows = phase_rows(stamped[:, :column], marks)
    sms = stamped[:, column]
    for i, row in enumerate(rows):
        reached = (stamped[:, i] > 0).nonzero().flatten()
        latest = reached[stamped[reached, i].argmax()]
        sm = int(sms[latest])
        row.update({"latest program": int(programs[latest]), "its SM": sm,
                    "programs on it": int((sms == sm).sum())})  # fmt: skip
    return rows


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--phase-clock``: the decode benchmarks' switch for ``print_phase_clocks``."""
    parser.add_argument(
        "--phase-clock", action="store_true",
        help="phase clocks of the split-KV launch and MoE router, smallest batch, default + --pdl",
    )  # fmt: skip


def print_phase_clocks(
    model, platform, config: ExecutorConfig, caches, peers: Sequence[str],
    step: Callable[[object], object], title: str,
) -> None:  # fmt: skip
    """``kernel_phases``' tables, one per kernel of the default graphs (``auto``) and of each of
    ``peers`` (``--pdl``'s names). A split-KV program is ``(sequence * KV heads + head) *
    splits + split``, a router program ``token * row blocks + block``."""
    variants = list(dict.fromkeys(["auto", *peers]))
    phases = kernel_phases(model, platform, config, caches, variants, step)
    for (name, module), rows in phases.items():
        heading = f"{module} phases, {title}, {name}: each program's clock, us from the earliest "
        print(table(rows, heading + "start (the last layer's launch of a replay)"))
