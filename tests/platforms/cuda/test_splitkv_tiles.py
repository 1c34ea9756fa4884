"""Keys per tile of the split-KV decode launch (``splitkv_splits.tile_keys``): 128 where a key row
is at most 256 bytes and the launch has at most one program per SM, else ``block_keys``. The
rule, a head-dim-128 launch on 128-key tiles against the float64 reference (interpreted on CPU
without a GPU), and the shared memory the sm_90 builds hold, compiled on any machine."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.triton_env import DEVICE, NO_RUNTIME_LOOPS, RUNTIME_LOOPS

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from tests.platforms.cuda import test_splitkv_decode as decode_tests
from tests.support.sm90_builds import compiled_in_child
from xhal.platforms.cuda.kernels import splitkv_splits
from xhal.platforms.cuda.kernels.splitkv_decode import Scratch, splitkv_decode

SM90_SHARED_LIMIT = 232448  # bytes a block may opt into on sm_90 (227 KB)


def test_wide_tiles_need_a_short_key_row_and_one_program_per_sm(monkeypatch) -> None:
    monkeypatch.setattr(splitkv_splits, "_num_sms", lambda device: 132)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    tile_keys = splitkv_splits.tile_keys
    # Qwen3-30B-A3B and the 8B at batch 1: 64 and 128 programs of bf16 rows at head dim 128
    assert tile_keys(128, 2, 64, cuda) == tile_keys(128, 2, 132, cuda) == 128
    assert tile_keys(128, 2, 133, cuda) == 64  # a second program on some SM
    assert tile_keys(128, 4, 64, cuda) == 64  # float32: 272 KB of shared memory
    assert tile_keys(256, 2, 8, cuda) == 64
    assert tile_keys(64, 4, 1000, cuda) == 128  # head dim 64 always had 128-key tiles
    assert tile_keys(128, 2, 64, cpu) == 64  # the interpreter keeps the split count's tiles
    monkeypatch.setattr(splitkv_splits, "WIDE_TILES", False)
    assert tile_keys(128, 2, 64, cuda) == 64


@pytest.mark.skipif(not RUNTIME_LOOPS, reason=f"split-KV decode {NO_RUNTIME_LOOPS}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_head_dim_128_launch_on_128_key_tiles(monkeypatch, dtype) -> None:
    """Group 8 at head dim 128 (the MoE shape's heads) on 128-key tiles, three splits over
    sequences ending mid-tile and mid-page: the tiles the wide rule picks on a GPU."""
    monkeypatch.setattr(decode_tests, "HEAD_DIM", 128)
    kv_lens = [300, 129, 5]
    q, k_cache, v_cache, table, lens = decode_tests._case(kv_lens, 8, 1, dtype, seed=5)
    splits, scale = 3, 128**-0.5
    scratch = Scratch.make(len(kv_lens), 1, 8, 128, splits, torch.device(DEVICE))
    out = torch.zeros(q.shape, dtype=dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]
    splitkv_decode(*dev[:5], out, scratch, splits, scale, block_n=128)
    decode_tests._check(out, decode_tests._reference(q, k_cache, v_cache, table, lens, scale),
                        dtype)  # fmt: skip


def _shared_bytes() -> dict[str, int]:
    """Shared memory of the sm_90 build of the MoE shape's launch (group 8, head dim 128, the
    merge spread, PDL), at 64- and 128-key tiles in bf16 and 128 in float32 in three stages, and
    at 128 in bf16 in two (``splitkv_decode.SPLIT_STAGES``' peer), with the alignments a real
    launch specializes (16-byte pointers, strides divisible by 16), under which the tile loop is
    pipelined through shared memory; run without the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xhal.platforms.cuda.kernels.splitkv_decode import _splitkv_decode_kernel as kernel

    constexprs = dict(
        GROUP=8, GROUP_PAD=8, ROWS=16, HEAD_DIM=128, DIM_PAD=128, PAGE=16, SPLITS_PAD=16,
        MERGE_CHUNK=8, EARLY_LOADS=False, SOFT_CAP=False, WINDOW=False, F32_DOT=False,
        NEW_KV=True, ROTARY=True, HALF=64, IS_NEOX=True, USE_PDL=1, PREFETCH=2, LINES=2, LINE=64,
        QK_NORM=True, QK_EPS=1e-6, clock_ptr=None, CLOCK=False, SPREAD=True, SLICE=64,
    )  # fmt: skip
    floats = ("eps", "scale_log2", "soft_cap", "QK_EPS")
    ints = {"counter_ptr", "block_table_ptr", "kv_lens_ptr", "epoch_ptr", "slot_ptr", "pos_ptr"}
    out = {}
    for name, block_n, dtype, stages in (
        ("bf16 64", 64, "bf16", 3), ("bf16 128", 128, "bf16", 3), ("fp32 128", 128, "fp32", 3),
        ("bf16 128, 2 stages", 128, "bf16", 2),
    ):  # fmt: skip
        signature, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs or arg == "BLOCK_N":
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                f32 = arg.startswith(("part_", "rot_"))
                signature[arg] = "*i32" if arg in ints else "*fp32" if f32 else f"*{dtype}"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[arg] = "fp32" if arg in floats else "i32"
                if "stride" in arg:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                           constexprs={**constexprs, "BLOCK_N": block_n})  # fmt: skip
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_stages": stages, "num_warps": 4})  # fmt: skip
        out[name] = compiled.metadata.shared
    return out


def test_a_wide_tile_program_fits_one_per_sm_and_float32_would_not_fit() -> None:
    """The sizes ``splitkv_splits.tile_keys`` and ``splitkv_decode.SPLIT_STAGES`` rest on."""
    shared = compiled_in_child(__file__)
    # two 64-key programs share an SM; a 128-key one fills most of it alone
    assert 2 * shared["bf16 64"] <= SM90_SHARED_LIMIT
    assert SM90_SHARED_LIMIT // 2 < shared["bf16 128"] <= SM90_SHARED_LIMIT
    assert shared["fp32 128"] > SM90_SHARED_LIMIT
    # in two stages a 128-key program leaves half the SM: room for o's CTA beside it
    assert 2 * shared["bf16 128, 2 stages"] <= SM90_SHARED_LIMIT


if __name__ == "__main__":
    print(json.dumps(_shared_bytes()))
