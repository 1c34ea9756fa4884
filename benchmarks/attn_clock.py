"""The split-KV decode launch's phase clock inside a model's decode graph (``bench_model
--attn-clock``, ``bench_moe --attn-clock``): the graphs captured once more with
``splitkv_decode.CLOCK`` set, one step replayed, and each program's ``%globaltimer`` at the
launch's phase boundaries read back. Every layer's launch writes the same rows, so they hold the
last layer's, which ran behind the kernels of a whole step as any layer's does."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks import pdl_variants
from benchmarks.common import phase_rows, table
from xhal.executor import ExecutorConfig

MAX_PROGRAMS = 4096  # rows of the clock: a decode bucket's (sequence, KV head, split) programs


def attention_phases(
    model,
    platform,
    config: ExecutorConfig,
    caches,
    variants: Sequence[str],
    step: Callable[[object], object],
) -> dict[str, list[dict]]:
    """Per variant (``pdl_variants`` names; ``auto`` is the default), the phase rows
    (``common.phase_rows``) of the last layer's split-KV launch in one replay of ``step(executor)``
    by an executor captured with the clock on. Empty where no launch stamped (another attention
    solution)."""
    from xhal.platforms.cuda.kernels import splitkv_decode

    device = platform.device()
    phases = {}
    for name in variants:
        clock = torch.zeros(MAX_PROGRAMS, 8, dtype=torch.int64, device=device)
        saved, splitkv_decode.CLOCK = splitkv_decode.CLOCK, clock
        try:
            executor = pdl_variants.capture_per_variant(model, platform, config, caches, [name])
        finally:
            splitkv_decode.CLOCK = saved
        for _ in range(3):  # the last replay's stamps stay
            step(executor[name])
        torch.cuda.synchronize()
        stamped = clock[clock[:, 0] > 0]
        phases[name] = phase_rows(stamped, splitkv_decode.MARKS) if stamped.numel() else []
        del executor
    return phases


def print_attention_phases(
    model, platform, config: ExecutorConfig, caches, variants: Sequence[str],
    step: Callable[[object], object], title: str,
) -> None:  # fmt: skip
    """``attention_phases``' tables, one per variant."""
    for name, rows in attention_phases(model, platform, config, caches, variants, step).items():
        heading = f"split-KV launch phases, {title}, {name}: each program's clock, us from the "
        print(table(rows, heading + "earliest start (the last layer's launch of a replay)"))
