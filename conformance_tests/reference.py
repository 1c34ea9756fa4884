"""Float64 references, independent of every backend (the CPU reference included): the expected
cache after a KV write, and dense causal attention over each sequence's K/V gathered from the
paged cache by its block table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from conformance_tests.batches import Batch
    from xhal.interfaces import AttentionBackend, AttentionSpec, LayerCache


def written_cache(before: torch.Tensor, slots: list[int], new: torch.Tensor) -> torch.Tensor:
    """``before`` with ``new[t]`` at ``slots[t]`` for every ``slots[t] >= 0`` and nothing else."""
    # before: [num_blocks, block_size, Hkv, D]; new: [T, Hkv, D]
    expected = before.detach().cpu().clone()
    flat = expected.view(-1, *expected.shape[2:])  # [num_slots, Hkv, D]
    rows = [t for t, s in enumerate(slots) if s >= 0]
    flat[[slots[t] for t in rows]] = new.detach().cpu()[rows].to(expected.dtype)
    return expected


def cache_mismatch(actual: torch.Tensor, expected: torch.Tensor, slots: list[int]) -> str | None:
    """``None`` when the caches are bit-identical, else which slots differ and why that matters."""
    actual = actual.detach().cpu()
    if torch.equal(actual, expected):
        return None
    block_size = expected.shape[1]
    differs = (actual != expected).flatten(2).any(-1).flatten()  # [num_slots]
    bad = differs.nonzero().flatten().tolist()
    written = {s for s in slots if s >= 0}
    wrong = [s for s in bad if s in written]
    stray = [s for s in bad if s not in written]
    message = (
        f"{len(wrong)} written slots do not hold the new k/v exactly (e.g. {wrong[:5]}); "
        f"{len(stray)} slots that must stay unchanged were changed (e.g. {stray[:5]})"
    )
    last_slot = expected.shape[0] * block_size - 1
    if last_slot in stray:
        message += f"; slot {last_slot} is the last one, where a row with slot -1 lands if written"
    return message


def gather(cache: torch.Tensor, block_row: list[int], kv_len: int) -> torch.Tensor:
    """Tokens ``0 .. kv_len-1`` of one sequence, ``[kv_len, Hkv, D]``, read through its blocks."""
    block_size = cache.shape[1]
    positions = torch.arange(kv_len)
    blocks = torch.tensor(block_row, dtype=torch.long)[positions // block_size]
    return cache[blocks, positions % block_size]


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, spec: AttentionSpec
) -> torch.Tensor:
    """Expected output rows ``batch.real_rows`` of one layer, float64 ``[R, H, D]``.

    Reads the cache after the step's write, so each new token sees its own K/V. Token at kv
    position p attends to keys at positions ``(p - W, p]`` (bottom-right causal, W the sliding
    window or unbounded); query head h reads kv head ``h // (H / Hkv)``.
    """
    q64 = q.detach().cpu().double()  # [T, H, D]
    k64, v64 = k_cache.detach().cpu().double(), v_cache.detach().cpu().double()
    kv_head = torch.arange(spec.num_heads) // spec.group_size  # [H]
    window, cap = spec.sliding_window, spec.logits_soft_cap
    outs, start = [], 0
    for seq, row in zip(batch.seqs, batch.block_rows):
        rows = slice(start, start + seq.q_len)
        start += seq.q_len
        if seq.padding:
            continue
        keys = gather(k64, row, seq.kv_len)[:, kv_head]  # [L, H, D]
        values = gather(v64, row, seq.kv_len)[:, kv_head]
        scores = torch.einsum("qhd,khd->hqk", q64[rows], keys) * spec.softmax_scale  # [H, Lq, L]
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq.kv_len - seq.q_len, seq.kv_len)[:, None]
        k_pos = torch.arange(seq.kv_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outs)


def max_error(out: torch.Tensor, expected: torch.Tensor, rows: list[int]) -> float:
    """Largest absolute difference between ``out[rows]`` and ``expected`` (inf for NaN)."""
    diff = (out.detach().cpu()[rows].double() - expected.double()).abs()
    return float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0


def check_layers(
    outs: list[torch.Tensor],
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    before: list[tuple[torch.Tensor, torch.Tensor]],
    caches: list[LayerCache],
    batch: Batch,
    spec: AttentionSpec,
) -> float:
    """Assert every layer's KV write exactly; return the worst output error over all layers.

    ``before[layer]`` holds (key, value) cache copies from before the step; ``inputs[layer]`` the
    layer's (q, k, v); ``caches[layer]`` its ``LayerCache`` after the step.
    """
    worst = 0.0
    for layer, (out, (q, k, v), (k0, v0), cache) in enumerate(zip(outs, inputs, before, caches)):
        assert out.shape == q.shape, (
            f"layer {layer}: output shape {tuple(out.shape)} != q's {tuple(q.shape)}"
        )
        assert out.dtype == q.dtype, f"layer {layer}: output dtype {out.dtype} != q's {q.dtype}"
        assert out.device == q.device, f"layer {layer}: output on {out.device}, q on {q.device}"
        for name, old, new, now in (("key", k0, k, cache.key), ("value", v0, v, cache.value)):
            problem = cache_mismatch(now, written_cache(old, batch.slots, new), batch.slots)
            assert problem is None, f"layer {layer} {name} cache after the step: {problem}"
        expected = attention(q, cache.key, cache.value, batch, spec)
        worst = max(worst, max_error(out, expected, batch.real_rows))
    return worst


def check_step(
    backend: AttentionBackend,
    spec: AttentionSpec,
    batch: Batch,
    caches: list[LayerCache],
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> float:
    """One eager step: plan once, forward every layer on ``inputs[layer]``; check it as
    ``check_layers`` does and return the worst output error."""
    before = snapshot(caches)
    backend.plan(batch.metadata)
    outs = [backend.forward(layer, *qkv) for layer, qkv in enumerate(inputs)]
    return check_layers(outs, inputs, before, caches, batch, spec)


def snapshot(caches: list[LayerCache]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU copies of every layer's (key, value) cache."""
    return [(c.key.detach().cpu().clone(), c.value.detach().cpu().clone()) for c in caches]
