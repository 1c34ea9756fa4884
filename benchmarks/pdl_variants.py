"""The programmatic dependent launch settings the decode benchmarks compare in one process
(``bench_model --pdl``, ``bench_moe --pdl``): each setting's decode graphs are captured by an
executor of their own over the same model and caches, then timed against the same floors."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Sequence

from xhal.executor import ExecutorConfig, ModelExecutor

# name -> (XHAL_CUDA_PDL, XHAL_CUDA_PDL_TRIGGER)
PDL_VARIANTS = {
    "off": ("0", "auto"),
    "early": ("1", "early"),
    "late": ("1", "late"),
    "auto": ("1", "auto"),
}


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--pdl NAME ...``: the settings to capture and time besides the default executor."""
    parser.add_argument(
        "--pdl",
        nargs="+",
        choices=sorted(PDL_VARIANTS),
        default=[],
        help="also capture and time the decode graphs once per PDL setting (same process)",
    )


@contextlib.contextmanager
def pdl_variant(name: str) -> Iterator[None]:
    """``XHAL_CUDA_PDL`` and ``XHAL_CUDA_PDL_TRIGGER`` set for one of ``PDL_VARIANTS`` while the
    block runs (the kernels read them at launch, so a graph captured inside keeps them)."""
    keys = ("XHAL_CUDA_PDL", "XHAL_CUDA_PDL_TRIGGER")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(zip(keys, PDL_VARIANTS[name]))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def capture_per_variant(
    model, platform, config: ExecutorConfig, caches, variants: Sequence[str]
) -> dict[str, ModelExecutor]:
    """One executor per variant over ``caches``, its decode graphs captured under that setting."""
    executors = {}
    for name in variants:
        with pdl_variant(name):
            executors[name] = ex = ModelExecutor(model, platform, config)
            ex.bind_kv_caches(caches)
            ex.capture_graphs(progress=False)
    return executors
