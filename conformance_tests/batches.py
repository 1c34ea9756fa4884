"""Random attention batches for the conformance suite: paged caches and the metadata a host builds.

A sequence's blocks come from a random permutation of the cache, so they are neither contiguous nor
ordered. Block-table rows carry at least one extra column past each sequence's pages, and those
columns hold stale but valid block ids (other sequences' blocks), as the executor's persistent
decode tables do: a backend must read only the first ``ceil(kv_len / block_size)`` entries of a
row and never treat 0 as "end of row". Caches are random everywhere: whatever sits in a
sequence's blocks before a step is its cached prefix, and untouched blocks and slots let the suite
see any write that lands where it should not.

q, k and v are strided views of one fused ``[T, (H + 2 Hkv) * D]`` projection, as the models
pass them: a kernel that assumes contiguous rows reads the wrong tokens.

Padding has two forms, both with slot -1 (never written):

- trailing token rows past the last sequence (``num_padding``): ``num_tokens > q_cu_seq_lens[-1]``;
- dummy sequences (``Seq.padding``) that keep a graph bucket's shape: q_len 1, kv_len 1 and a block
  row left over from earlier steps (stale valid ids), as the executor's decode buckets pad (xLLM's
  ``padding_decode_batch_size`` and vllm-ascend pad the same way); a valid decode for every
  kernel, whose only special feature is the -1 slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from xhal.interfaces import (
    AttentionMetadata,
    AttentionSpec,
    BatchKind,
    GraphRunner,
    LayerCache,
    Platform,
)


@dataclass(frozen=True)
class Seq:
    q_len: int
    kv_len: int  # includes this step's q_len tokens, at kv positions [kv_len - q_len, kv_len)
    padding: bool = False


@dataclass
class Batch:
    seqs: list[Seq]
    block_rows: list[list[int]]  # the blocks each sequence owns, in kv order
    slots: list[int]  # per token row; -1 for padding
    real_rows: list[int]  # token rows of real sequences, in order
    metadata: AttentionMetadata


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """One intra-op CPU thread inside the block. These families run thousands of tiny CPU ops (the
    references, the CPU reference backend); OpenMP fork/join costs more than it gives, up to 15x on
    a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spec_or_skip(
    platform: Platform, dtype: torch.dtype, head_dim: int, block_size: int, group: int, **features
) -> AttentionSpec:
    """The spec to test, or a skip naming what the platform does not declare."""
    caps, name = platform.capabilities.attention, platform.name
    if dtype not in caps.dtypes:
        pytest.skip(f"{name} does not declare dtype {dtype} (declares {list(caps.dtypes)})")
    if not caps.supports_head_dim(head_dim):
        pytest.skip(
            f"{name} does not declare head_dim {head_dim} (declares {list(caps.head_dims)})"
        )
    if block_size not in caps.block_sizes:
        pytest.skip(
            f"{name} does not declare block_size {block_size} (declares {list(caps.block_sizes)})"
        )
    for feature in ("sliding_window", "logits_soft_cap"):
        if features.get(feature) is not None and not getattr(caps, feature):
            pytest.skip(f"{name} does not declare {feature}")
    num_kv_heads = 2
    return AttentionSpec(
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        **features,
    )


def runner_or_skip(platform: Platform) -> GraphRunner:
    """``platform``'s graph runner, or a skip when it declares no graph support."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graph support (capabilities.graphs is False)")
    return platform.graph_runner()


def skip_undeclared_kind(platform: Platform, kind: BatchKind) -> None:
    if kind not in platform.capabilities.attention.batch_kinds:
        pytest.skip(f"{platform.name} does not declare batch kind {kind.name}")


def declared_head_dim(platform: Platform) -> int:
    """The head dim the feature and graph cases run at (``grid.feature_head_dim``)."""
    from conformance_tests.grid import feature_head_dim

    return feature_head_dim(platform.capabilities.attention)


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rng: random.Random
) -> torch.Tensor:
    """Standard normal values truncated to [-2, 2], drawn on the CPU (the same on every device).

    Truncation keeps attention outputs (weighted means of values) within [-2, 2], where one
    bfloat16 rounding costs at most 3.9e-3: the tolerance table's O(1) outputs.
    """
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    return torch.randn(shape, generator=gen).clamp_(-2.0, 2.0).to(device=device, dtype=dtype)


def random_caches(
    num_layers: int, num_blocks: int, spec: AttentionSpec, device: torch.device, rng: random.Random
) -> list[LayerCache]:
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        LayerCache(randn(shape, spec.dtype, device, rng), randn(shape, spec.dtype, device, rng))
        for _ in range(num_layers)
    ]


def random_qkv(
    num_tokens: int, spec: AttentionSpec, device: torch.device, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[T, H, D]``, k and v ``[T, Hkv, D]``: views of one fused qkv projection, so each row is
    ``(H + 2 Hkv) * D`` elements from the next, as the models' split of ``qkv_proj`` gives."""
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = randn((num_tokens, (h + 2 * hkv) * d), spec.dtype, device, rng)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(num_tokens, h, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)


def random_seqs(kind: BatchKind, block_size: int, rng: random.Random) -> list[Seq]:
    """A few sequences of ``kind`` in random order, with lengths on and around block boundaries."""
    bs = block_size
    if kind == BatchKind.PREFILL:
        seqs = [Seq(n, n) for n in (rng.randint(1, 40), rng.randint(1, 40), bs + rng.randint(1, 8))]
    elif kind == BatchKind.DECODE:
        kv_lens = (1, bs, bs + 1, rng.randint(2, 40), 2 * bs + rng.randint(1, 5))
        seqs = [Seq(1, n) for n in kv_lens]
    elif kind == BatchKind.CHUNKED_PREFILL:
        prefixes = (bs - 3, 2 * bs + 1, rng.randint(1, 30))
        seqs = [
            Seq(c, p + c) for p, c in zip(prefixes, (7, rng.randint(2, 20), rng.randint(2, 20)))
        ]
    elif kind == BatchKind.MIXED:
        chunk, prompt = rng.randint(3, 12), rng.randint(2, 30)
        seqs = [
            Seq(1, bs + 1),
            Seq(1, rng.randint(2, 40)),
            Seq(chunk, bs - 2 + chunk),
            Seq(prompt, prompt),
        ]
    else:
        raise ValueError(f"no random batch for kind {kind!r}")
    rng.shuffle(seqs)
    return seqs


def num_pages(seq: Seq, block_size: int) -> int:
    return 0 if seq.padding else math.ceil(seq.kv_len / block_size)


def allocate_blocks(
    seqs: list[Seq], block_size: int, num_blocks: int, rng: random.Random
) -> list[list[int]]:
    """Each sequence's blocks: consecutive runs of a random permutation of the cache's blocks."""
    perm = rng.sample(range(num_blocks), num_blocks)
    rows, start = [], 0
    for seq in seqs:
        n = num_pages(seq, block_size)
        if start + n > num_blocks:
            raise ValueError(f"{num_blocks} blocks cannot hold {seqs} at block_size {block_size}")
        rows.append(perm[start : start + n])
        start += n
    return rows


def build_batch(
    kind: BatchKind,
    seqs: list[Seq],
    block_rows: list[list[int]],
    block_size: int,
    device: torch.device,
    *,
    num_padding: int = 0,
    max_blocks: int | None = None,
    paged_kv: bool = False,
) -> Batch:
    """What a host builds for ``seqs``: int32, host twins on the CPU, table columns past each row's
    pages (and dummy sequences' rows) filled with stale valid block ids."""
    width = max_blocks or max(len(r) for r in block_rows) + 1  # at least one padding column
    # stale ids: other sequences' blocks, as a persistent table keeps from earlier steps
    stale = [b for r in reversed(block_rows) for b in reversed(r)] or [0]
    slots, real_rows, table = [], [], []
    for seq, row in zip(seqs, block_rows):
        for pos in range(seq.kv_len - seq.q_len, seq.kv_len):
            if not seq.padding:
                real_rows.append(len(slots))
            slots.append(
                -1 if seq.padding else row[pos // block_size] * block_size + pos % block_size
            )
        table.append(row + [stale[(len(table) + j) % len(stale)] for j in range(width - len(row))])
    slots += [-1] * num_padding
    q_lens, kv_lens = [s.q_len for s in seqs], [s.kv_len for s in seqs]

    def i32(values: list[int], on: torch.device | str = device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(on)

    def cumsum(values: list[int]) -> list[int]:
        return [0, *itertools.accumulate(values)]

    extra = {}
    if paged_kv:  # what xLLM's CUDA builder supplies: the table as CSR pages
        pages = [row or [0] for row in block_rows]  # a dummy sequence reads one page: block 0
        extra = {
            "paged_kv_indptr": i32(cumsum([len(p) for p in pages])),
            "paged_kv_indices": i32([b for p in pages for b in p]),
            "paged_kv_last_page_len": i32(
                [n - (len(p) - 1) * block_size for n, p in zip(kv_lens, pages)]
            ),
        }
        # and their host twins, which FlashInfer's host plan reads
        extra["paged_kv_indptr_host"] = extra["paged_kv_indptr"].cpu()
        extra["paged_kv_last_page_len_host"] = extra["paged_kv_last_page_len"].cpu()
    metadata = AttentionMetadata.from_host_lengths(
        kind,
        i32(q_lens, "cpu"),
        i32(kv_lens, "cpu"),
        torch.tensor(table, dtype=torch.int32).to(device),
        i32(slots),
    )
    metadata = dataclasses.replace(metadata, **extra)
    metadata.validate()
    return Batch(seqs, block_rows, slots, real_rows, metadata)


def random_batch(
    kind: BatchKind,
    block_size: int,
    device: torch.device,
    rng: random.Random,
    num_blocks: int | None = None,
    **kwargs,
) -> tuple[Batch, int]:
    """A random batch of ``kind`` over ``num_blocks`` cache blocks (default: what it needs and a
    few spare); returns the batch and ``num_blocks``."""
    seqs = random_seqs(kind, block_size, rng)
    num_blocks = num_blocks or sum(num_pages(s, block_size) for s in seqs) + 4
    rows = allocate_blocks(seqs, block_size, num_blocks, rng)
    return build_batch(kind, seqs, rows, block_size, device, **kwargs), num_blocks


def decode_bucket(
    num_real: int,
    bucket: int,
    block_size: int,
    num_blocks: int,
    max_blocks: int,
    device: torch.device,
    rng: random.Random,
) -> tuple[Batch, Batch]:
    """``num_real`` random decodes padded with dummy sequences to ``bucket``: (padded, unpadded)."""
    real = [Seq(1, rng.randint(2, (max_blocks - 1) * block_size)) for _ in range(num_real)]
    rows = allocate_blocks(real, block_size, num_blocks, rng)
    padded = real + [Seq(1, 1, padding=True)] * (bucket - num_real)
    rows_padded = rows + [[] for _ in range(bucket - num_real)]
    return (
        build_batch(
            BatchKind.DECODE, padded, rows_padded, block_size, device, max_blocks=max_blocks
        ),
        build_batch(BatchKind.DECODE, real, rows, block_size, device),
    )
