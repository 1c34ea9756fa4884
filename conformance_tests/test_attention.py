"""Conformance family "attention": paged KV write and attention against a float64 reference.

Every test builds random paged caches on the device (permuted block tables, padding rows with slot
-1), plans once and runs several layers, each with its own cache, on that one plan. It then checks
each layer's cache bit for bit (the new k/v at the written slots, every other slot unchanged) and
its output rows against ``reference.attention`` within ``tolerance("attention", dtype)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

import pytest
import torch

from conformance_tests import grid, reference, solution_variants
from conformance_tests.batches import (
    Batch,
    Seq,
    allocate_blocks,
    build_batch,
    one_cpu_thread,
    random_batch,
    random_caches,
    random_qkv,
    skip_undeclared_kind,
    spec_or_skip,
)
from conformance_tests.coverage import attention_labels
from conformance_tests.solution_variants import _solution_under_test  # noqa: F401
from conformance_tests.tolerances import tolerance
from xhal.interfaces import AttentionBackend, AttentionSpec, BatchKind, LayerCache, Platform

NUM_LAYERS = 3
NUM_PADDING = 3  # trailing padding rows (slot -1) in every batch


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    solution_variants.parametrize(metafunc)  # every attention solution, not only the chosen one
    # the grid is the platform's declaration (conformance_tests.grid)
    if (
        "case" not in metafunc.fixturenames
        or metafunc.function.__name__ == "test_undeclared_spec_raises"
    ):
        return
    caps = grid.platform_of(metafunc.config).capabilities.attention
    cases = {
        "test_attention": grid.main_cases,
        "test_attention_features": grid.feature_cases,
        "test_long_context": lambda c: grid.per_dtype_block_cases(c)[:: len(c.block_sizes)],
    }.get(metafunc.function.__name__, grid.per_dtype_block_cases)(caps)
    grid.parametrize_cases(metafunc, cases)


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


def run_step(
    backend: AttentionBackend,
    spec: AttentionSpec,
    batch: Batch,
    caches: list[LayerCache],
    device: torch.device,
    rng: random.Random,
) -> float:
    """One step on fresh random q/k/v per layer, checked; returns the worst output error."""
    inputs = [random_qkv(batch.metadata.num_tokens, spec, device, rng) for _ in caches]
    return reference.check_step(backend, spec, batch, caches, inputs)


def check_batch(
    platform: Platform,
    device: torch.device,
    record_error: Callable[[float], None],
    spec: AttentionSpec,
    kind: BatchKind,
    rng: random.Random,
    seqs: list[Seq] | None = None,
    num_layers: int = NUM_LAYERS,
    **batch_kwargs: bool,
) -> None:
    """One batch of ``kind`` (random, or of ``seqs``) over fresh caches, checked and recorded."""
    if seqs is None:
        batch, num_blocks = random_batch(
            kind, spec.block_size, device, rng, num_padding=NUM_PADDING, **batch_kwargs
        )
    else:
        num_blocks = sum(math.ceil(s.kv_len / spec.block_size) for s in seqs) + 4
        rows = allocate_blocks(seqs, spec.block_size, num_blocks, rng)
        batch = build_batch(
            kind, seqs, rows, spec.block_size, device, num_padding=NUM_PADDING, **batch_kwargs
        )
    caches = random_caches(num_layers, num_blocks, spec, device, rng)
    backend = platform.attention_backend(spec)
    backend.bind_kv_caches(caches)
    err = run_step(backend, spec, batch, caches, device, rng)
    record_error(err)
    tol = tolerance("attention", spec.dtype)
    assert err <= tol, f"{kind.name}: max abs error {err:.3e} > tolerance {tol:.1e} for {spec}"


def test_attention(platform, device, record_error, record_coverage, case):
    """Every declared dtype x head dim x block size, each over every declared batch kind."""
    spec = spec_or_skip(platform, case.dtype, case.head_dim, case.block_size, case.group)
    rng = random.Random(f"attention {case.id}")
    check_batch(platform, device, record_error, spec, case.kind, rng)
    record_coverage(*attention_labels(spec, case.kind))


def test_attention_features(platform, device, record_error, record_coverage, case):
    """A custom scale, a sliding window and a logits soft cap (the latter two when declared)."""
    features = grid.FEATURES[case.feature]
    spec = spec_or_skip(platform, case.dtype, case.head_dim, case.block_size, 4, **features)
    rng = random.Random(f"features {case.id}")
    check_batch(platform, device, record_error, spec, case.kind, rng)
    record_coverage(*attention_labels(spec, case.kind))


def test_host_supplied_paged_kv(platform, device, record_error, case):
    """Metadata that also carries ``paged_kv_*`` page arrays, as xLLM's CUDA builder does."""
    spec = spec_or_skip(platform, case.dtype, case.head_dim, case.block_size, 4)
    skip_undeclared_kind(platform, BatchKind.MIXED)
    rng = random.Random(f"paged_kv {case.id}")
    check_batch(platform, device, record_error, spec, BatchKind.MIXED, rng, paged_kv=True)


def test_long_context(platform, device, record_error, record_coverage, case):
    """Over 1,024 keys per sequence and a 600-token prefill chunk over a 700-token prefix: where
    a split-KV kernel merges partial results (a merge that forgets to rescale by the running
    maximum is exact below one split and far off here)."""
    spec = spec_or_skip(platform, case.dtype, case.head_dim, case.block_size, 4)
    skip_undeclared_kind(platform, BatchKind.MIXED)
    rng = random.Random(f"long {case.id}")
    seqs = [Seq(1, 1100), Seq(600, 1300), Seq(1, 2049), Seq(1, 530)]
    rng.shuffle(seqs)
    check_batch(platform, device, record_error, spec, BatchKind.MIXED, rng, seqs, num_layers=1)
    record_coverage(*attention_labels(spec, BatchKind.MIXED))


def test_consecutive_steps(platform, device, record_error, case):
    """Prefill then two decodes of the same sequences on one backend: later steps read what earlier
    steps wrote, each step is planned anew, and sequences change order between steps."""
    dtype, block_size = case.dtype, case.block_size
    spec = spec_or_skip(platform, dtype, case.head_dim, block_size, 4)
    for kind in (BatchKind.PREFILL, BatchKind.DECODE):
        skip_undeclared_kind(platform, kind)
    rng = random.Random(f"steps {dtype} {block_size}")
    prompts = [rng.randint(1, 40), block_size - 1, block_size + rng.randint(1, 8)]
    final = [Seq(1, p + 2) for p in prompts]
    num_blocks = sum(math.ceil(s.kv_len / block_size) for s in final) + 3
    rows = allocate_blocks(final, block_size, num_blocks, rng)
    caches = random_caches(NUM_LAYERS, num_blocks, spec, device, rng)
    backend = platform.attention_backend(spec)
    backend.bind_kv_caches(caches)
    steps = [(BatchKind.PREFILL, [Seq(p, p) for p in prompts])]
    steps += [(BatchKind.DECODE, [Seq(1, p + i) for p in prompts]) for i in (1, 2)]
    worst = 0.0
    for kind, seqs in steps:
        order = rng.sample(range(len(seqs)), len(seqs))
        step_rows = [rows[i][: math.ceil(seqs[i].kv_len / block_size)] for i in order]
        batch = build_batch(
            kind, [seqs[i] for i in order], step_rows, block_size, device, num_padding=1
        )
        worst = max(worst, run_step(backend, spec, batch, caches, device, rng))
    record_error(worst)
    tol = tolerance("attention", dtype)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"


UNDECLARED = {  # case -> (is it declared?, the spec fields that ask for it)
    "float64": (lambda caps: torch.float64 in caps.dtypes, {"dtype": torch.float64}),
    "float16": (lambda caps: torch.float16 in caps.dtypes, {"dtype": torch.float16}),
    "head_dim_96": (lambda caps: caps.supports_head_dim(96), {"head_dim": 96}),
    "block_size_off_multiple": (
        lambda caps: caps.block_size_multiple == 1,
        {"block_size": None},  # filled in: block_size_multiple + 1
    ),
    "sliding_window": (lambda caps: caps.sliding_window, {"sliding_window": 8}),
    "logits_soft_cap": (lambda caps: caps.logits_soft_cap, {"logits_soft_cap": 30.0}),
}


@pytest.mark.parametrize("case", UNDECLARED)
def test_undeclared_spec_raises(platform, case):
    """``attention_backend`` raises ``ValueError`` for a spec outside the declared capabilities."""
    caps = platform.capabilities.attention
    declared, fields = UNDECLARED[case]
    if declared(caps):
        pytest.skip(f"{platform.name} declares {case}: nothing undeclared to ask for")
    spec = {
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": caps.head_dims[0],
        "dtype": caps.dtypes[0],
        "block_size": caps.block_sizes[0],
    }
    spec.update(fields)
    if spec["block_size"] is None:
        spec["block_size"] = caps.block_size_multiple + 1
    with pytest.raises(ValueError):
        platform.attention_backend(AttentionSpec(**spec))


def test_kv_cache_shape(platform):
    """Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``: the layout built here."""
    caps = platform.capabilities.attention
    spec = AttentionSpec(4, 2, caps.head_dims[0], caps.dtypes[0], caps.block_sizes[0])
    shape = tuple(platform.attention_backend(spec).kv_cache_shape(7))
    assert shape == (7, spec.block_size, 2, spec.head_dim)
