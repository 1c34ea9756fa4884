"""The attention grid, derived from what the platform under test declares.

Every declared (dtype, head dim, block size) combination runs every declared batch kind, the GQA
group cycling with the kind so each combination also sees every group (1, 4, 8) without
multiplying the grid by three. Features (custom scale, sliding window, soft cap) run per dtype and
block size at one head dim (``feature_head_dim``). A platform declaring ``any_head_dim`` is
tested on its listed sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from xhal.interfaces import AttentionCapabilities, BatchKind, Platform

GQA = (1, 4, 8)
KINDS = (BatchKind.PREFILL, BatchKind.DECODE, BatchKind.CHUNKED_PREFILL, BatchKind.MIXED)
FEATURES = {
    "scale": {"scale": 0.2},
    "window": {"sliding_window": 8},
    "soft_cap": {"scale": 0.2, "logits_soft_cap": 2.0},
    "window_soft_cap": {"scale": 0.2, "sliding_window": 8, "logits_soft_cap": 2.0},
}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    block_size: int
    group: int = 4
    kind: BatchKind = BatchKind.MIXED
    feature: str | None = None

    @property
    def id(self) -> str:
        parts = [
            str(self.dtype).removeprefix("torch."),
            f"d{self.head_dim}",
            f"bs{self.block_size}",
        ]
        parts += [f"gqa{self.group}", self.kind.name.lower()]
        return "-".join(parts + ([self.feature] if self.feature else []))


def platform_of(config: pytest.Config) -> Platform:
    import xhal

    return xhal.platforms.get(config.getoption("--device"))


def declared_kinds(caps: AttentionCapabilities) -> list[BatchKind]:
    return [k for k in KINDS if k in caps.batch_kinds]


def feature_head_dim(caps: AttentionCapabilities) -> int:
    """128 where declared (the common head dim of models with windows and caps), else the largest
    declared head dim below it, else the smallest declared."""
    below = [d for d in caps.head_dims if d <= 128]
    return max(below) if below else min(caps.head_dims)


def main_cases(caps: AttentionCapabilities) -> list[Case]:
    cases = []
    for dtype in caps.dtypes:
        for head_dim in caps.head_dims:
            for block_size in caps.block_sizes:
                for i, kind in enumerate(declared_kinds(caps)):
                    cases.append(Case(dtype, head_dim, block_size, GQA[i % len(GQA)], kind))
    return cases


def feature_cases(caps: AttentionCapabilities) -> list[Case]:
    wanted = [
        name
        for name, fields in FEATURES.items()
        if ("sliding_window" not in fields or caps.sliding_window)
        and ("logits_soft_cap" not in fields or caps.logits_soft_cap)
    ]
    head_dim = feature_head_dim(caps)
    return [
        Case(dtype, head_dim, block_size, 4, kind, feature)
        for dtype in caps.dtypes
        for block_size in caps.block_sizes
        for feature in wanted
        for kind in declared_kinds(caps)
    ]


def per_dtype_block_cases(
    caps: AttentionCapabilities, kind: BatchKind = BatchKind.MIXED
) -> list[Case]:
    """One case per declared dtype and block size at ``feature_head_dim``."""
    head_dim = feature_head_dim(caps)
    return [Case(d, head_dim, b, 4, kind) for d in caps.dtypes for b in caps.block_sizes]


def parametrize_cases(metafunc: pytest.Metafunc, cases: list[Case]) -> None:
    if not cases:  # nothing declared: one skipped test says so instead of a silent empty family
        metafunc.parametrize(
            "case", [pytest.param(None, marks=pytest.mark.skip("nothing declared"))]
        )
        return
    metafunc.parametrize("case", cases, ids=[c.id for c in cases])
