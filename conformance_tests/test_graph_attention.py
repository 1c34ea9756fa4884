"""Conformance family "graph", attention inside a graph exactly the way the executor's decode
buckets (``xhal.executor.decode_graph``) use it:

- the bucket is captured with the executor's capture-time dummy step (every row kv_len 1, slot -1)
  and then replayed for real steps, long sequences included;
- each step's metadata is copied into the bucket's persistent device tensors, except
  ``kv_cu_seq_lens``, which the graph itself derives (a cumsum of ``kv_seq_lens``) before the
  first layer: at ``plan`` time it still holds the previous step's values; for a backend that
  declares ``reads_kv_cu_seq_lens`` false it is never written and keeps the capture step's;
- block-table columns past a row's pages, and the rows of padding sequences, hold stale but valid
  block ids; ``max_seq_len`` is the bucket's constant, not the step's maximum;
- ``plan(graph_key=...)`` runs on the host before capture and before every replay, then
  ``before_replay``; the step's q/k/v (strided views of a fused projection) are copied into static
  buffers, then the graph replays. Padding sequences never change real rows.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator

import pytest
import torch

from conformance_tests import coverage, grid, reference
from conformance_tests.batches import (
    Batch,
    Seq,
    allocate_blocks,
    build_batch,
    decode_bucket,
    one_cpu_thread,
    random_batch,
    random_caches,
    random_qkv,
    runner_or_skip,
    skip_undeclared_kind,
    spec_or_skip,
)
from conformance_tests.tolerances import tolerance
from xhal.interfaces import AttentionMetadata, BatchKind, LayerCache

BUCKET = 4  # decode sequences per captured graph
# the metadata's device tensors: a graph bucket gets the same ones at capture and every replay
PERSISTENT = (
    "q_cu_seq_lens",
    "kv_cu_seq_lens",
    "q_seq_lens",
    "kv_seq_lens",
    "block_table",
    "slot_mapping",
)
KEY = ("decode", BUCKET)
NUM_LAYERS = 2


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # attention-in-graph cases: every declared dtype and block size (conformance_tests.grid)
    if "case" in metafunc.fixturenames:
        caps = grid.platform_of(metafunc.config).capabilities.attention
        grid.parametrize_cases(metafunc, grid.per_dtype_block_cases(caps, BatchKind.DECODE))


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


class DecodeCase:
    """One attention group over ``NUM_LAYERS`` random caches with a decode bucket captured the
    executor's way: static q/k/v per layer, metadata in persistent device tensors rewritten in
    place every step (``kv_cu_seq_lens`` derived inside the graph, if the backend reads it),
    ``plan(graph_key=KEY)``, one graph over every layer, captured on the executor's dummy step."""

    def __init__(self, platform, device: torch.device, case, seed: str, max_kv: int = 0) -> None:
        self.runner = runner_or_skip(platform)
        self.spec = spec_or_skip(platform, case.dtype, case.head_dim, case.block_size, 4)
        skip_undeclared_kind(platform, BatchKind.DECODE)
        self.platform, self.device, self.rng = platform, device, random.Random(seed)
        bs = case.block_size
        # kv lengths up to (max_blocks - 1) * block_size
        self.max_blocks = math.ceil(max_kv / bs) + 1 if max_kv else (4 if bs < 64 else 3)
        num_blocks = BUCKET * (self.max_blocks - 1) + 4
        self.caches = random_caches(NUM_LAYERS, num_blocks, self.spec, device, self.rng)
        self.backend = platform.attention_backend(self.spec)
        self.backend.bind_kv_caches(self.caches)
        self.statics = self.qkv(BUCKET)
        dummy = self.dummy_step()
        self.persistent = {name: getattr(dummy.metadata, name).clone() for name in PERSISTENT}
        self.backend.plan(self.staged(dummy.metadata), graph_key=KEY)
        lens, cu = self.persistent["kv_seq_lens"], self.persistent["kv_cu_seq_lens"]
        derive = self.backend.reads_kv_cu_seq_lens

        def step() -> list[torch.Tensor]:  # as the executor's decode step: prefix sums first
            if derive:
                torch.cumsum(lens, 0, dtype=torch.int32, out=cu[1:])
            return [self.backend.forward(i, *x) for i, x in enumerate(self.statics)]

        self.runner.capture(KEY, step)

    def dummy_step(self) -> Batch:
        """The executor's capture-time step: every row a 1-token sequence with slot -1."""
        seqs = [Seq(1, 1, padding=True)] * BUCKET
        rows = [[] for _ in seqs]
        bs = self.spec.block_size
        return build_batch(
            BatchKind.DECODE, seqs, rows, bs, self.device, max_blocks=self.max_blocks
        )

    def bucket(self, num_real: int) -> tuple[Batch, Batch]:
        """A new decode step of ``num_real`` sequences: (padded to the bucket, unpadded)."""
        num_blocks, bs = self.caches[0].num_blocks, self.spec.block_size
        return decode_bucket(
            num_real, BUCKET, bs, num_blocks, self.max_blocks, self.device, self.rng
        )

    def qkv(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [random_qkv(num_tokens, self.spec, self.device, self.rng) for _ in range(NUM_LAYERS)]

    def staged(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """``metadata`` with its device tensors copied into the bucket's persistent ones, except
        ``kv_cu_seq_lens`` (the graph derives it), and the bucket's constant ``max_seq_len``."""
        for name, static in self.persistent.items():
            if name != "kv_cu_seq_lens":
                static.copy_(getattr(metadata, name))
        max_seq_len = (self.max_blocks - 1) * self.spec.block_size
        return dataclasses.replace(metadata, max_seq_len=max_seq_len, **self.persistent)

    def replay(self, batch: Batch, inputs: list) -> list[torch.Tensor]:
        self.backend.plan(self.staged(batch.metadata), graph_key=KEY)
        self.backend.before_replay(KEY)
        for static, new in zip(self.statics, inputs):
            for s, n in zip(static, new):
                s.copy_(n)
        return list(self.runner.replay(KEY))

    def eager_twin(self, before: list, batch: Batch, inputs: list) -> list[torch.Tensor]:
        """Outputs of an eager step on a fresh backend over copies of the caches ``before``."""
        caches = [
            LayerCache(k.to(self.device, copy=True), v.to(self.device, copy=True))
            for k, v in before
        ]
        backend = self.platform.attention_backend(self.spec)
        backend.bind_kv_caches(caches)
        backend.plan(batch.metadata)
        return [backend.forward(layer, *x) for layer, x in enumerate(inputs)]


def test_attention_in_graph(platform, device, record_error, record_coverage, case):
    """Replays for new steps (other lengths, block tables and slots, same bucket shape) equal an
    eager run on a fresh backend with the same caches, and the float64 reference."""
    dtype, block_size = case.dtype, case.block_size
    case = DecodeCase(platform, device, case, f"graph attention {case.id}")
    spec, caches, tol = case.spec, case.caches, tolerance("attention", dtype)
    # an eager step on the same backend between capture and replay, as the executor runs prefills
    batch, _ = random_batch(
        BatchKind.MIXED, block_size, device, case.rng, num_blocks=caches[0].num_blocks
    )
    worst = reference.check_step(
        case.backend, spec, batch, caches, case.qkv(batch.metadata.num_tokens)
    )
    for _ in range(2):
        batch, _ = case.bucket(BUCKET)
        inputs, before = case.qkv(BUCKET), reference.snapshot(caches)
        outs = case.replay(batch, inputs)
        worst = max(worst, reference.check_layers(outs, inputs, before, caches, batch, spec))
        # a device's graph kernel may split work unlike its eager one: compare within tolerance
        for layer, (out, ref) in enumerate(zip(outs, case.eager_twin(before, batch, inputs))):
            err = reference.max_error(out, ref.detach().cpu()[batch.real_rows], batch.real_rows)
            assert err <= tol, f"layer {layer}: replay differs from eager by {err:.3e} > {tol:.1e}"
    record_error(worst)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"
    record_coverage(f"graph attention dtype {coverage.dtype_name(dtype)}")


def test_long_sequences_after_dummy_capture(platform, device, record_error, case):
    """A bucket captured on the dummy step replays decodes of 600 to 1,300 keys: nothing sized
    at capture (lengths, page counts, split counts) may limit what a replay reads."""
    dtype = case.dtype
    case = DecodeCase(platform, device, case, f"graph long {case.id}", max_kv=1300)
    spec, caches, tol, worst = case.spec, case.caches, tolerance("attention", dtype), 0.0
    for num_real in (BUCKET, BUCKET - 1):
        real = [Seq(1, case.rng.randint(600, 1300)) for _ in range(num_real)]
        rows = allocate_blocks(real, spec.block_size, caches[0].num_blocks, case.rng)
        padded = real + [Seq(1, 1, padding=True)] * (BUCKET - num_real)
        rows += [[] for _ in range(BUCKET - num_real)]
        batch = build_batch(
            BatchKind.DECODE, padded, rows, spec.block_size, device, max_blocks=case.max_blocks
        )
        inputs, before = case.qkv(BUCKET), reference.snapshot(caches)
        outs = case.replay(batch, inputs)
        worst = max(worst, reference.check_layers(outs, inputs, before, caches, batch, spec))
    record_error(worst)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"


@pytest.mark.parametrize("mode", ("eager", "graph"))
def test_bucket_padding_keeps_real_rows(platform, device, record_error, case, mode):
    """n real decodes padded with dummy sequences (slot -1) to the bucket give the real rows of the
    unpadded batch, and write nothing but the real tokens' K/V."""
    dtype = case.dtype
    case = DecodeCase(platform, device, case, f"padding {case.id} {mode}")
    spec, caches, tol, worst = case.spec, case.caches, tolerance("attention", dtype), 0.0
    for num_real in (1, BUCKET - 1):
        padded, unpadded = case.bucket(num_real)
        inputs, before = case.qkv(BUCKET), reference.snapshot(caches)
        if mode == "graph":
            outs = case.replay(padded, inputs)
        else:
            case.backend.plan(padded.metadata)
            outs = [case.backend.forward(layer, *x) for layer, x in enumerate(inputs)]
        worst = max(worst, reference.check_layers(outs, inputs, before, caches, padded, spec))
        real_inputs = [tuple(t[:num_real].clone() for t in x) for x in inputs]
        for layer, (out, ref) in enumerate(
            zip(outs, case.eager_twin(before, unpadded, real_inputs))
        ):
            err = reference.max_error(out, ref.detach().cpu(), padded.real_rows)
            assert err <= tol, (
                f"layer {layer}, {num_real} real rows: padded != unpadded ({err:.3e})"
            )
    record_error(worst)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"


def test_decode_steps_within_pages(platform, device, record_error, case):
    """Consecutive replays whose sequences each grow by one token inside their last page keep the
    page counts of the step before while lengths, page ids and slots change: a backend that
    reuses work keyed on the page layout (FlashInfer's schedule) must still read the new step."""
    dtype, block_size = case.dtype, case.block_size
    case = DecodeCase(platform, device, case, f"within pages {case.id}")
    spec, caches, tol, worst = case.spec, case.caches, tolerance("attention", dtype), 0.0
    bs, rng = block_size, case.rng
    # every sequence starts 3 tokens short of a page boundary, so 3 steps stay in the same pages
    start = [rng.randint(0, case.max_blocks - 2) * bs + bs - 3 for _ in range(BUCKET)]
    seqs = [Seq(1, n) for n in start]
    for step in range(3):
        grown = [Seq(1, s.kv_len + step) for s in seqs]
        rows = allocate_blocks(grown, bs, caches[0].num_blocks, rng)  # new page ids every step
        batch = build_batch(BatchKind.DECODE, grown, rows, bs, device, max_blocks=case.max_blocks)
        inputs, before = case.qkv(BUCKET), reference.snapshot(caches)
        outs = case.replay(batch, inputs)
        worst = max(worst, reference.check_layers(outs, inputs, before, caches, batch, spec))
    record_error(worst)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"


def test_graph_key_reads_the_persistent_tensors(platform, device, record_error, case):
    """The graph-key policy of ``AttentionBackend``: a captured bucket reads the persistent
    metadata tensors in place, so a plan for its key with other device tensors (equal shapes and
    values) is refused with a ``ValueError``, and the persistent tensors, rewritten in place,
    still replay right afterwards."""
    dtype = case.dtype
    case = DecodeCase(platform, device, case, f"graph key policy {case.id}")
    spec, caches, tol = case.spec, case.caches, tolerance("attention", dtype)
    batch, _ = case.bucket(BUCKET)
    staged = case.staged(batch.metadata)
    moved = dataclasses.replace(staged, **{name: t.clone() for name, t in case.persistent.items()})
    with pytest.raises(ValueError):
        case.backend.plan(moved, graph_key=KEY)
    inputs, before = case.qkv(BUCKET), reference.snapshot(caches)
    outs = case.replay(batch, inputs)
    worst = reference.check_layers(outs, inputs, before, caches, batch, spec)
    record_error(worst)
    assert worst <= tol, f"max abs error {worst:.3e} > tolerance {tol:.1e} for {spec}"
