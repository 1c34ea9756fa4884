"""The split-KV decode launch's merges (``kernels/splitkv_merge.py``) against the float64
reference of ``test_splitkv_decode.py``: the last program's merge in several rounds (either
build), and the spread merge, where every program of a (sequence, KV head) merges a slice once
the last has arrived: its slices over a filled scratch (interpreted on CPU), its split counts,
and its launch (GPU only: interpreted programs run one at a time, so none could wait)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import DEVICE, NO_RUNTIME_LOOPS, RUNTIME_LOOPS, tl, triton

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from tests.platforms.cuda.test_splitkv_decode import HEAD_DIM, _case, _check, _reference
from xhal.platforms.cuda.kernels.splitkv_decode import Scratch, num_splits, splitkv_decode
from xhal.platforms.cuda.kernels.splitkv_merge import merge_slice

pytestmark = pytest.mark.skipif(not RUNTIME_LOOPS, reason=f"split-KV decode {NO_RUNTIME_LOOPS}")


@pytest.mark.parametrize("early_loads", [False, True], ids=["merge", "early-loads"])
def test_a_merge_in_several_rounds(monkeypatch, early_loads) -> None:
    """Eight splits merged two at a time (four rounds: the merge's share of registers made
    small), by either merge: the rounds' weighted sums add up to the one-round result."""
    from xhal.platforms.cuda.kernels import splitkv_decode as kernel
    from xhal.platforms.cuda.kernels import splitkv_merge

    num_heads, num_kv_heads, dtype = 8, 2, torch.float32
    monkeypatch.setattr(kernel, "MERGE_FLOATS", 2 * 4 * HEAD_DIM)  # two splits of group 4
    monkeypatch.setattr(splitkv_merge, "EARLY_LOADS", early_loads)
    kv_lens = [700, 90]  # 6 and 1 tiles of 128 keys: some splits hold nothing
    q, k_cache, v_cache, table, lens = _case(kv_lens, num_heads, num_kv_heads, dtype, seed=2)
    splits, scale = 8, HEAD_DIM**-0.5
    scratch = Scratch.make(len(kv_lens), num_kv_heads, num_heads // num_kv_heads, HEAD_DIM,
                           splits, torch.device(DEVICE))  # fmt: skip
    out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    splitkv_decode(*dev[:5], out, scratch, splits, scale)
    _check(out, _reference(q, k_cache, v_cache, table, lens, scale), dtype)
    assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)


@triton.jit
def _merge_every_slice(
    part_acc, part_max, part_sum, out, splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SLICE: tl.constexpr,
):  # fmt: skip
    """One program per (pair, slice): the spread merge's slices of a filled scratch, out
    contiguous [B, H, D] (a pair's group at pair * GROUP * HEAD_DIM)."""
    pair = tl.program_id(0)
    merge_slice(part_acc, part_max, part_sum, out, pair.to(tl.int64) * splits, splits,
                pair * GROUP * HEAD_DIM, HEAD_DIM, tl.program_id(1), GROUP, HEAD_DIM,
                SPLITS_PAD, SLICE)  # fmt: skip


@pytest.mark.parametrize("splits", [3, 8])
def test_the_spread_merge_slices_cover_the_group(splits) -> None:
    """The spread merge's slices (``merge_slice``: every program of a pair merging a slice of
    the group once all have arrived) over the partials a launch left in its scratch: together
    they write the output the last program's merge wrote. Three splits of group 4 x 64 dims
    make slices of 128 outputs, the third empty. Interpreted on CPU its waiting cannot run
    (programs run one at a time); the launch with it is tested on a GPU below."""
    num_heads, num_kv_heads, dtype = 8, 2, torch.float32
    kv_lens = [700, 90]
    q, k_cache, v_cache, table, lens = _case(kv_lens, num_heads, num_kv_heads, dtype, seed=3)
    scale, group = HEAD_DIM**-0.5, num_heads // num_kv_heads
    scratch = Scratch.make(len(kv_lens), num_kv_heads, group, HEAD_DIM, splits,
                           torch.device(DEVICE))  # fmt: skip
    out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    splitkv_decode(*dev[:5], out, scratch, splits, scale)
    spread = torch.full_like(out, float("nan"))
    slice_ = triton.next_power_of_2(-(-group * HEAD_DIM // splits))
    _merge_every_slice[(len(kv_lens) * num_kv_heads, splits)](
        scratch.part_acc, scratch.part_max, scratch.part_sum, spread, splits, GROUP=group,
        HEAD_DIM=HEAD_DIM, SPLITS_PAD=triton.next_power_of_2(splits), SLICE=slice_,
    )  # fmt: skip
    _check(spread, _reference(q, k_cache, v_cache, table, lens, scale), dtype)
    torch.testing.assert_close(spread, out, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="the spread merge's programs wait for each other")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_spread_merge_in_one_launch(monkeypatch, dtype) -> None:
    """With ``SPREAD`` the programs of a pair wait for the last to arrive, then each merges its
    slice; twice on one scratch, so the epochs and counters carry from launch to launch."""
    from xhal.platforms.cuda.kernels import splitkv_splits

    num_heads, num_kv_heads = 8, 2
    kv_lens = [700, 90, 1]
    q, k_cache, v_cache, table, lens = _case(kv_lens, num_heads, num_kv_heads, dtype, seed=4)
    splits, scale = 7, HEAD_DIM**-0.5
    # one merge round of 1,024 floats holds 4 splits of a group of 4 at head dim 64: 7 spread
    monkeypatch.setattr(splitkv_splits, "MERGE_FLOATS", 1024)
    group = num_heads // num_kv_heads
    assert splitkv_splits.spreads(len(kv_lens) * num_kv_heads, group, HEAD_DIM, splits,
                                  torch.device(DEVICE))  # fmt: skip
    scratch = Scratch.make(len(kv_lens), num_kv_heads, num_heads // num_kv_heads, HEAD_DIM,
                           splits, torch.device(DEVICE))  # fmt: skip
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    for launch in range(2):
        out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
        splitkv_decode(*dev[:5], out, scratch, splits, scale)
        _check(out, _reference(q, k_cache, v_cache, table, lens, scale), dtype)
        assert scratch.counters.cpu().tolist() == [0] * (len(kv_lens) * num_kv_heads)
        assert scratch.epochs.cpu().tolist() == [launch + 1] * (len(kv_lens) * num_kv_heads)


def test_a_spread_merge_takes_more_splits_than_one_merge_round_holds(monkeypatch) -> None:
    from xhal.platforms.cuda.kernels import splitkv_splits

    assert splitkv_splits.SPREAD  # the default
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    cuda = torch.device("cuda")
    monkeypatch.setattr(splitkv_splits, "_num_sms", lambda device: 132)
    # Qwen3-30B-A3B at batch 1 (4 KV heads, group 8): 16 splits on 132 SMs, where one merge
    # round holds 8, and the launch spreads; as many as fit one program per SM (33) past the cap
    assert num_splits(1, 4, 8, 128, 4096, 132) == 16
    assert splitkv_splits.spreads(4, 8, 128, 16, cuda)
    monkeypatch.setattr(splitkv_splits, "SPREAD_MAX_SPLITS", 64)
    assert num_splits(1, 4, 8, 128, 4096, 132) == 33
    assert splitkv_splits.spreads(4, 8, 128, 33, cuda)
    assert not splitkv_splits.spreads(4, 8, 128, 34, cuda)  # 136 programs on 132 SMs
    # one round holds the 1B's 17 splits (8 KV heads, head dim 64, 17 tiles of 128 keys) and
    # the 8B's 16 (group 4, head dim 128): the last program merges them, as without the spread
    assert num_splits(1, 8, 4, 64, 2100, 132) == 17
    assert not splitkv_splits.spreads(8, 4, 64, 17, cuda)
    assert num_splits(1, 8, 4, 128, 4096, 132) == 16
    assert not splitkv_splits.spreads(8, 4, 128, 16, cuda)
    # batches whose pairs leave no room for more splits: the merge-round cap as before
    assert num_splits(16, 4, 8, 128, 4096, 132) == 5
    assert num_splits(16, 8, 4, 128, 4096, 132) == 3
    assert num_splits(64, 8, 4, 128, 4096, 132) == 1
    # a launch spreads only compiled: the interpreter runs one program at a time
    assert not splitkv_splits.spreads(4, 8, 128, 16, torch.device("cpu"))
    # nor under an MPS share of the SMs, where its programs might not all be resident at once
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert not splitkv_splits.spreads(4, 8, 128, 16, cuda)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    assert splitkv_splits.spreads(4, 8, 128, 16, cuda)
    monkeypatch.setattr(splitkv_splits, "SPREAD", False)
    assert num_splits(1, 4, 8, 128, 4096, 132) == 8
    assert not splitkv_splits.spreads(4, 8, 128, 16, cuda)
