"""How a split-KV decode launch (``splitkv_decode.py``) is sized: the split count, the keys per
tile, whether the merge is spread over a KV head's programs, and the scratch the splits merge
through.

The split count is a host choice from shapes only (``num_splits``): a graph bucket keeps one for
every replay, while each program's share of the keys is derived from the live length at run
time, so one bucket serves any context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from xhal.platforms.cuda.kernels.gemv import _num_sms

MAX_SPLITS = 64
# programs per SM the split count aims for, and the most partial floats the last program merges
# in one round (64 registers a thread at 4 warps). H200, bf16, ctx 2K, batch 1 (bench_splitkv,
# docs/h200-results.md, seventh session): 32 q / 8 kv heads D=128 took 12.0 / 14.3 / 20.4 us a
# layer at 16 / 32 / 64 splits (1, 2, 4 programs per SM), and 32 / 4 heads (group 8, where 16
# splits need two merge rounds) 15.7 / 16.1 / 19.6 us at 8 / 16 / 32; at batch 16 three or four
# splits (2-4 programs per SM) were best (47.4 us against 70.2 unsplit)
PROGRAMS_PER_SM = 2
MERGE_FLOATS = 8192
# The merge spread over a (sequence, KV head)'s programs (``splitkv_merge.merge_slice``): once
# the last split has arrived, each program merges a slice of the group's outputs, where
# otherwise the last program merges all of them in rounds of ``MERGE_FLOATS``. It is taken where
# one round would not hold the splits, and only where every program is resident at once (at
# most one program per SM), since the others wait for the last. H100, Qwen3-30B-A3B at batch 1
# (4 KV heads, group 8, ctx 2K; docs/h200-results.md, thirtieth session): the last program's
# merge of 8 splits ended the attention at 16.4 us; spread, 8 / 16 / 33 splits at 15.1 / 13.1 /
# 13.6 us, the step 3.285 ms against 3.195 / 3.153 / 3.231. Past 16 splits the partials' stores
# and counts cost more than the shorter tile loop saves, so the spread stops at
# ``SPREAD_MAX_SPLITS``. Both read per call (benchmark peers).
SPREAD = True
SPREAD_MAX_SPLITS = 16
# 128-key tiles where a key row is 256 bytes (half precision at head dim 128), in launches of at
# most one program per SM (``tile_keys``): in three stages such a program holds 136 KB of shared
# memory where 64-key tiles hold 70 KB (sm_90 builds, test_splitkv_tiles.py), so no second
# program fits its SM; float32 at head dim 128 would need 272 KB, past the SM's 227. H100,
# Qwen3-30B-A3B at batch 1 (16 spread splits, ctx 2K: one tile a program where there were two;
# docs/h200-results.md, thirtieth session): the step 3.218 -> 3.082 ms; the 8B's batch 1 (16
# splits) 5.47 -> 5.44. Read per call (benchmark peers).
WIDE_TILES = True
WIDE_TILE_ROW_BYTES = 256


def block_keys(head_dim: int) -> int:
    """Keys per tile: 64 at head dims over 64 (16 KB of K and of V per tile in half precision),
    else 128. The split count is sized by these tiles."""
    return 64 if head_dim > 64 else 128


def tile_keys(head_dim: int, element_size: int, programs: int, device: torch.device) -> int:
    """Keys per tile of a launch of ``programs`` programs: 128 with ``WIDE_TILES`` where a key
    row is at most ``WIDE_TILE_ROW_BYTES`` and there is at most one program per SM (compiled
    only), else ``block_keys``."""
    wide = (
        WIDE_TILES
        and device.type == "cuda"
        and head_dim * element_size <= WIDE_TILE_ROW_BYTES
        and programs <= _num_sms(device)
    )
    return 128 if wide else block_keys(head_dim)


def merge_rounds_cap(group: int, head_dim: int) -> int:
    """The most splits the last program merges in one round of ``MERGE_FLOATS``."""
    padded = triton.next_power_of_2(group) * max(triton.next_power_of_2(head_dim), 16)
    return max(1, MERGE_FLOATS // padded)


def num_splits(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_seq_len: int,
               num_sms: int) -> int:  # fmt: skip
    """Splits per (sequence, KV head): about ``PROGRAMS_PER_SM`` programs per SM, no more
    splits than one merge round holds (with ``SPREAD``: or than fit one program per SM, up to
    ``SPREAD_MAX_SPLITS``) or than the longest context has tiles. Shapes only, never the live
    lengths, so a graph bucket keeps its split count."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    useful = max(-(-max_seq_len // block_keys(head_dim)), 1)
    cap = merge_rounds_cap(group, head_dim)
    if SPREAD:
        cap = max(cap, min(num_sms // programs, SPREAD_MAX_SPLITS))
    return max(1, min(wanted, useful, cap, MAX_SPLITS))


def spreads(num_pairs: int, group: int, head_dim: int, splits: int,
            device: torch.device) -> bool:  # fmt: skip
    """Whether a launch of ``num_pairs`` (sequence, KV head) pairs of ``splits`` splits merges
    spread (``SPREAD``): compiled (the interpreter runs one program at a time, so a program
    waiting for another would wait forever), more splits than one merge round holds, at most
    one program per SM, and every SM the device reports this process's (``_every_sm_ours``)."""
    return (
        SPREAD
        and device.type == "cuda"
        and splits > merge_rounds_cap(group, head_dim)
        and num_pairs * splits <= _num_sms(device)
        and _every_sm_ours()
    )


def _every_sm_ours() -> bool:
    """False under CUDA MPS with an active thread percentage below 100: the device still reports
    every SM, but the process's kernels run on a share of them, so programs that wait for each
    other might never all be resident at once."""
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        return not share or float(share) >= 100
    except ValueError:  # a value MPS itself would refuse: do not bet a hang on it
        return False


@dataclass
class Scratch:
    """The partials of the splits and one arrival counter per (sequence, KV head). Counters
    start at 0 and every launch leaves them at 0; a graph bucket keeps its own scratch, since a
    captured launch reads these addresses at every replay."""

    part_acc: torch.Tensor  # float32 [capacity, group, head_dim]: (sequence, KV head, split)
    part_max: torch.Tensor  # float32 [capacity, group], log2 domain
    part_sum: torch.Tensor  # float32 [capacity, group]
    counters: torch.Tensor  # int32 [num_seqs * Hkv]
    # int32 [num_seqs * Hkv], spread merges only: the last split to arrive adds 1 to its pair's,
    # which the others wait for (any value: they compare with what they read before arriving)
    epochs: torch.Tensor

    @classmethod
    def make(cls, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, splits: int,
             device: torch.device) -> Scratch:  # fmt: skip
        parts = num_seqs * num_kv_heads * splits if splits > 1 else 0  # one split: no partials
        f32 = {"dtype": torch.float32, "device": device}
        return cls(
            torch.empty(parts, group, head_dim, **f32),
            torch.empty(parts, group, **f32),
            torch.empty(parts, group, **f32),
            torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device),
            torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device),
        )

    def fits(self, num_seqs: int, num_kv_heads: int, splits: int) -> bool:
        pairs = num_seqs * num_kv_heads
        parts = pairs * splits if splits > 1 else 0
        return self.counters.numel() >= pairs and self.part_max.shape[0] >= parts
