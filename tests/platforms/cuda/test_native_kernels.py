"""The native CUDA kernels' host side, off the GPU (the persistent MLP block, ``mlp_block``, and
the stream GEMV, ``gemv_stream``): the stage layouts each ``plan`` picks fit the kernel's shared
memory and refuse what the kernel cannot take, the driver structures ``native`` hands
``cuLaunchKernelEx`` have the C layout, and the CUDA sources compile for sm_90 without spilling
for the layouts the benchmarks and the conformance cases use (where nvcc is present), reading
nothing the kernel ahead writes before their PDL wait (``global_reads_before_the_wait``). The
kernels themselves run only on the H200: ``benchmarks/bench_mlp_block.py``,
``benchmarks/bench_stream_gemv.py`` and the conformance fused and ops families there."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xhal.platforms.cuda import native
from xhal.platforms.cuda.kernels import attn_block, gemv_stream, mlp_block, moe_block

H100_SHARED = 232448  # shared_memory_per_block_optin of sm_90


def compile_sm90(
    source, defines: dict, tmp_path, *, warnings: bool = True, arch: str = "sm_90"
) -> Path:
    """``nvcc -cubin`` of ``source`` for sm_90 (or ``arch``) with ``defines``: it builds, spills
    nothing (ptxas -v) and, unless ``warnings``, prints no warning. Returns the cubin."""
    cmd = ["nvcc", "-cubin", *native._options(arch, defines, source.parent), "-Xptxas", "-v"]
    proc = subprocess.run(
        [*cmd, "-o", str(tmp_path / "k.cubin"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    if not warnings:
        assert "warning" not in proc.stderr, proc.stderr
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    assert spills and all(s == "0" for s in spills), proc.stderr
    return tmp_path / "k.cubin"


def cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the copy Triton's wheel ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton.backends.nvidia as nvidia_backend
    except ImportError:
        return None
    path = Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def global_reads_before_the_wait(cubin: Path) -> list[str]:
    """The SASS global loads and atomics ahead of the first ``griddepcontrol.wait`` (ACQBULK).
    The MLP block, the stream GEMV and the expert block read only their weights before the PDL
    wait, and those by TMA, so any global load ahead of it reads the kernel ahead's output early.
    ptxas moved plain loads of the routing above griddepcontrol.wait in one version of
    moe_block.cu (the previous replay's routing was read: wrong outputs, then an illegal
    address), so the sources load such data through asm volatile helpers; their compile tests
    keep it that way. The attention block is not held to it: it reads the staged lengths, table,
    cos / sin and its first K / V tiles before the wait on purpose (pdl.py, rule 1)."""
    sass = subprocess.run(
        [cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, timeout=120
    ).stdout
    assert "ACQBULK" in sass, "a PDL build waits for the kernel ahead"
    ahead = sass.split("ACQBULK", 1)[0]
    reads = re.compile(r"\b(LDG|LD\.E|ATOMG|RED)")
    return [line.strip() for line in ahead.splitlines() if reads.search(line)]


# compile tests that also read the SASS (cuobjdump comes with the toolkit or Triton's wheel)
needs_nvcc_and_cuobjdump = pytest.mark.skipif(
    shutil.which("nvcc") is None or cuobjdump() is None, reason="nvcc or cuobjdump is missing"
)


def used_shared(p: mlp_block.Plan, hidden: int, inter: int, rows: int) -> int:
    """The kernel's layout (mlp_block.cu): ring, act, parts, norm sums, mbarriers."""
    ring = max(p.stages1 * 2 * p.pairs * hidden * 2, p.stages2 * p.down_rows * inter * 2)
    parts = 2 * 8 * 2 * p.pairs * rows * 4
    return ring + rows * inter * 2 + parts + 8 * rows * 4 + 8 * (p.stages1 + p.stages2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "hidden,inter", [(2048, 8192), (4096, 14336), (3584, 18944), (256, 96), (4096, 2048)]
)
def test_plans_fit_the_shared_memory(hidden, inter, rows) -> None:
    p = mlp_block.plan(hidden, inter, rows, H100_SHARED)
    assert p is not None, "every Llama / Qwen decode shape up to 4 rows has a layout"
    assert p.shared_mem == used_shared(p, hidden, inter, rows) <= H100_SHARED
    assert min(p.stages1, p.stages2) >= 2 and max(p.stages1, p.stages2) <= 8
    assert inter % p.pairs == 0 and hidden % p.down_rows == 0


def test_plan_refuses_what_the_kernel_cannot_take() -> None:
    assert mlp_block.plan(2048, 8192, 5, H100_SHARED) is None  # past MAX_ROWS
    assert mlp_block.plan(2050, 8192, 1, H100_SHARED) is None  # rows of 16-byte chunks
    assert mlp_block.plan(2048, 8190, 1, H100_SHARED) is None
    assert mlp_block.plan(2048, 8192, 1, 48 * 1024) is None  # two stages do not fit


def test_launch_structures_have_the_driver_layout() -> None:
    # cuda.h: CUlaunchAttribute {int id; char pad[4]; 64-byte union}; CUlaunchConfig {7 uints,
    # CUstream, CUlaunchAttribute *, uint}
    assert ctypes.sizeof(native._LaunchAttribute) == 72
    assert native._LaunchAttribute.value.offset == 8
    assert native._LaunchConfig.stream.offset == 32
    assert native._LaunchConfig.attrs.offset == 40
    assert native._LaunchConfig.num_attrs.offset == 48
    assert ctypes.sizeof(native._LaunchConfig) == 56


def test_nvrtc_is_looked_for_where_torch_and_cuda_keep_it() -> None:
    # only what could be a loadable libnvrtc, never its builtins library
    for path in native._nvrtc_candidates():
        assert "nvrtc" in path and "builtins" not in path


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize(
    "hidden,inter,rows,early",
    [(2048, 8192, 1, 0), (4096, 14336, 1, 0), (3584, 18944, 4, 0), (256, 96, 3, 0),
     (2048, 8192, 1, 1)],
)  # fmt: skip
def test_kernel_compiles_for_sm90_without_spills(hidden, inter, rows, early, tmp_path) -> None:
    p = (mlp_block.beside_plan if early else mlp_block.plan)(hidden, inter, rows, H100_SHARED)
    defines = {
        "DTYPE_BF16": 1, "M_ROWS": rows, "HIDDEN": hidden, "INTER": inter, "PAIRS": p.pairs,
        "DOWN_ROWS": p.down_rows, "STAGES1": p.stages1, "STAGES2": p.stages2, "USE_PDL": 1,
        "EARLY": early,
    }  # fmt: skip
    cubin = compile_sm90(mlp_block.SOURCE, defines, tmp_path)
    assert global_reads_before_the_wait(cubin) == []


@pytest.mark.parametrize("k,rows", [(2048, 1), (2048, 4), (4096, 2), (14336, 1), (64, 4)])
def test_stream_gemv_plans_fit(k, rows) -> None:
    p = gemv_stream.plan(k, rows, H100_SHARED)
    assert p is not None
    fixed = 4 * (2 * 8 * p.rows * rows + 8 * rows)
    assert p.shared_mem == p.stages * p.rows * k * 2 + fixed + 8 * p.stages <= H100_SHARED
    assert 2 <= p.stages <= 8 and p.stages * p.rows * k * 2 <= 192 * 1024


def test_stream_gemv_plan_refuses_what_the_kernel_cannot_take() -> None:
    assert gemv_stream.plan(2048, 5, H100_SHARED) is None
    assert gemv_stream.plan(2050, 1, H100_SHARED) is None
    assert gemv_stream.plan(2048, 1, H100_SHARED, ring_bytes=6 * 1024) is None  # one row, once
    assert gemv_stream.plan(14336, 2, H100_SHARED) is None  # 112 input floats a thread


def test_a_small_budget_takes_fewer_rows_a_stage_and_a_short_slice_fewer_stages() -> None:
    assert gemv_stream.plan(2048, 1, H100_SHARED, ring_bytes=40 * 1024).rows == 3
    half = native.beside_share(H100_SHARED)
    assert gemv_stream.plan(4096, 1, half).rows == 4  # three 32 KB stages, not one of 64
    assert gemv_stream.plan(2048, 1, half, units=2).stages == 2  # a 1B o slice: two units a CTA


@pytest.mark.parametrize("hidden,inter", [(2048, 8192), (896, 4864), (576, 1536)])
def test_beside_plans_leave_room_for_the_next_kernel(hidden, inter) -> None:
    """Under env.cuda_overlap the MLP block and the next layer's norm + qkv GEMV share an SM:
    both plans fit half of it, reserves included, the block's rings BESIDE_DEPTH deep."""
    half = native.beside_share(H100_SHARED)
    assert half == 115712
    block = mlp_block.beside_plan(hidden, inter, 1, H100_SHARED)
    gemv = gemv_stream.plan(hidden, 1, half)
    sm_total = H100_SHARED + 1024
    assert block is not None and gemv is not None
    assert min(block.stages1, block.stages2) >= mlp_block.BESIDE_DEPTH
    assert block.shared_mem + gemv.shared_mem + 2 * 1024 <= sm_total


@pytest.mark.parametrize("hidden,inter", [(4096, 14336), (3584, 18944), (3072, 8192)])
def test_an_mlp_block_too_shallow_in_half_an_sm_keeps_the_whole_sm(hidden, inter) -> None:
    """Llama-3-8B, Qwen2.5-7B, Llama-3.2-3B: half an SM holds their widest stages two deep
    only, so the block takes the whole SM; the qkv GEMV still goes beside."""
    assert mlp_block.beside_plan(hidden, inter, 1, H100_SHARED) is None
    assert mlp_block.plan(hidden, inter, 1, H100_SHARED) is not None
    assert gemv_stream.plan(hidden, 1, native.beside_share(H100_SHARED)) is not None


def test_what_fits_half_an_sm_fits_the_whole_sm() -> None:
    """CudaOps asks ``fits_beside`` only of operands ``supports`` took (whole-SM plans)."""
    half = native.beside_share(H100_SHARED)
    for hidden in range(64, 8193, 64):
        for rows in (1, 2, 4):
            if gemv_stream.plan(hidden, rows, half) is not None:
                assert gemv_stream.plan(hidden, rows, H100_SHARED) is not None
            for inter in (96, 1536, 4864, 8192, 8960, 14336, 18944, 28672):
                if mlp_block.beside_plan(hidden, inter, rows, H100_SHARED) is not None:
                    assert mlp_block.plan(hidden, inter, rows, H100_SHARED) is not None


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize(
    "k,rows,norm,early",
    [(2048, 1, 1, 0), (4096, 1, 0, 0), (14336, 1, 0, 0), (64, 4, 1, 0), (2048, 1, 0, 1)],
)
def test_stream_gemv_compiles_for_sm90_without_spills(k, rows, norm, early, bf16, tmp_path) -> None:
    p = gemv_stream.plan(k, rows, H100_SHARED)
    defines = {
        "DTYPE_BF16": bf16, "M_ROWS": rows, "K": k, "R": p.rows, "STAGES": p.stages,
        "NORM": norm, "USE_PDL": 1, "EARLY": early,
    }  # fmt: skip
    cubin = compile_sm90(gemv_stream.SOURCE, defines, tmp_path, warnings=False)
    assert global_reads_before_the_wait(cubin) == []


# (K, N, experts, top_k): Qwen3-30B-A3B's o and router, Qwen2-MoE's 60 experts, Mixtral's 8 on a
# small o, and the conformance family's other shapes
ROUTE_SHAPES = [(4096, 2048, 128, 8), (2048, 2048, 60, 4), (128, 64, 8, 2), (512, 256, 60, 4),
                (128, 1152, 8, 2)]


@pytest.mark.parametrize("beside", [True, False])
@pytest.mark.parametrize("k,n,experts,top_k", ROUTE_SHAPES)
def test_route_launches_fit_the_shared_memory(k, n, experts, top_k, beside) -> None:
    launch = gemv_stream.route_launch(k, n, experts, top_k, True, True, True, beside, 132,
                                      H100_SHARED)  # fmt: skip
    assert launch is not None
    d = launch.defines
    limit = native.beside_share(H100_SHARED) if beside else H100_SHARED
    assert launch.shared_mem <= limit
    assert d["R"] % 4 == 0 and d["CTA_ROWS"] % 4 == 0 and d["CTA_ROWS"] <= 64
    units = -(-n // d["R"])
    assert d["GRID"] == launch.ctas == min(132, units)
    assert -(-units // launch.ctas) * d["R"] == d["CTA_ROWS"]  # the rows of the fullest CTA
    assert d["EARLY"] == int(beside)


def test_route_launch_refuses_what_the_kernel_cannot_take() -> None:
    # K 6144 in half an SM: stages of 3 rows, where the gate's 8-byte loads need a multiple of 4
    assert gemv_stream.route_launch(6144, 2048, 128, 8, True, True, True, True, 132,
                                    H100_SHARED) is None  # fmt: skip
    # 16384 rows over 132 CTAs: 128 rows a CTA, past the gate columns a thread holds
    assert gemv_stream.route_launch(2048, 16384, 128, 8, True, True, True, False, 132,
                                    H100_SHARED) is None  # fmt: skip


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("beside", [True, False])
@pytest.mark.parametrize("k,n,experts,top_k", ROUTE_SHAPES)
def test_route_compiles_for_sm90_without_spills(k, n, experts, top_k, beside, bf16,
                                                tmp_path) -> None:  # fmt: skip
    """The route entry builds, spills nothing and reads nothing before its PDL wait (not even
    the router's columns, which it loads after the wait, while o's weights stream)."""
    launch = gemv_stream.route_launch(k, n, experts, top_k, True, bool(bf16), True, beside, 132,
                                      H100_SHARED)  # fmt: skip
    cubin = compile_sm90(gemv_stream.SOURCE, launch.defines, tmp_path, warnings=False)
    assert global_reads_before_the_wait(cubin) == []


def test_chunk_alignment_is_what_16_byte_reads_need() -> None:
    import torch

    wide = torch.zeros(2, 3 * 64, dtype=torch.bfloat16)
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert native.chunk_aligned([wide[:, :64], wide[:, 128:]], [w])  # rows 384 bytes apart
    assert not native.chunk_aligned([wide[:, 1:65]], [w])  # starts 2 bytes in
    assert not native.chunk_aligned([torch.zeros(2, 68, dtype=torch.bfloat16)[:, :64]], [w])
    assert not native.chunk_aligned([wide[:, :64]], [torch.zeros(65, dtype=torch.bfloat16)[1:]])
    assert not native.takes_rows(wide, 4)  # a CPU tensor


# the attention block (attn_block.cu): (hidden, heads, KV heads, head dim) of Llama-3.2-1B,
# Llama-3-8B, Qwen3-30B-A3B and the conformance family's cases
BLOCK_SHAPES = [(2048, 32, 8, 64), (4096, 32, 8, 128), (2048, 32, 4, 128), (384, 8, 2, 64),
                (384, 16, 2, 128)]  # fmt: skip


def block_shared(p, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """The kernel's layout (attn_block.cu): mbarriers, ring, K / V tiles, fp32 scratch."""
    group = heads // kv_heads
    scratch = (group + 1) * head_dim + group * 64 + 3 * group + group + 2
    scratch += 2 * 8 * 8 + 8
    return 128 + p.stages * p.slot_bytes + 4 * 64 * head_dim * 2 + 4 * scratch


@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim", BLOCK_SHAPES)
def test_attention_block_plans_fit_the_shared_memory(hidden, heads, kv_heads, head_dim) -> None:
    p = attn_block.plan(hidden, heads, kv_heads, head_dim, 132, H100_SHARED)
    assert p is not None
    assert p.shared_mem == block_shared(p, hidden, heads, kv_heads, head_dim) <= H100_SHARED
    assert 3 <= p.stages <= 8 and p.splits * kv_heads <= 132
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    assert qkv_rows % p.rows1 == 0 and p.rows1 * hidden * 2 <= p.slot_bytes
    assert hidden % p.rows3 == 0 and p.rows3 * heads * head_dim * 2 <= p.slot_bytes


def test_attention_block_plan_refuses_what_the_kernel_cannot_take() -> None:
    assert attn_block.plan(2048, 64, 4, 128, 132, H100_SHARED) is None  # GQA group 16
    assert attn_block.plan(2050, 32, 8, 64, 132, H100_SHARED) is None  # 16-byte chunks
    assert attn_block.plan(2048, 32, 8, 64, 4, H100_SHARED) is None  # fewer CTAs than KV heads
    assert attn_block.plan(2048, 32, 8, 128, 132, 96 * 1024) is None  # three stages do not fit


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("qk_norm,neox", [(0, 1), (1, 0)])
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim", BLOCK_SHAPES)
def test_attention_block_compiles_for_sm90_without_spills(
    hidden, heads, kv_heads, head_dim, qk_norm, neox, tmp_path
) -> None:
    p = attn_block.plan(hidden, heads, kv_heads, head_dim, 132, H100_SHARED)
    defines = {
        "DTYPE_BF16": 1, "HIDDEN": hidden, "NUM_HEADS": heads, "NUM_KV": kv_heads,
        "HEAD_DIM": head_dim, "ROT_DIM": head_dim, "NEOX": neox, "QK_NORM": qk_norm,
        "SPLITS": p.splits, "PAGE": 16, "ROWS1": p.rows1, "ROWS3": p.rows3,
        "STAGES": p.stages, "SLOT_BYTES": p.slot_bytes, "USE_PDL": 1,
    }  # fmt: skip
    compile_sm90(attn_block.SOURCE, defines, tmp_path, warnings=False)


# (hidden, per-rank expert intermediate, top-k): Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B,
# Qwen2-57B-A14B, the conformance cases
MOE_SHAPES = [(2048, 768, 8), (4096, 14336, 2), (4096, 1536, 8), (3584, 2560, 8), (2048, 96, 8),
              (64, 32, 2)]  # fmt: skip


def moe_shared(p: moe_block.Plan, hidden: int, inter: int, top_k: int) -> int:
    """The kernel's layout (moe_block.cu): ring, act, two buffers of per-warp partial sums, the
    routing, alignment, mbarriers."""
    ring = max(p.stages1 * 2 * p.pairs * hidden * 2, p.stages2 * p.down_rows * inter * 2)
    parts = 2 * 8 * max(2 * p.pairs, p.down_rows) * 4
    return ring + top_k * inter * 2 + parts + 8 * top_k + 8 + 8 * (p.stages1 + p.stages2)


@pytest.mark.parametrize("hidden,inter,top_k", MOE_SHAPES)
def test_moe_block_plans_fit_the_shared_memory(hidden, inter, top_k) -> None:
    p = moe_block.plan(hidden, inter, top_k, H100_SHARED, 132)
    assert p is not None
    assert p.shared_mem == moe_shared(p, hidden, inter, top_k) <= H100_SHARED
    assert 2 <= p.stages1 <= 8 and 2 <= p.stages2 <= 8
    assert inter % p.pairs == 0 and hidden % p.down_rows == 0
    assert p.down_rows * inter * 2 <= 32 * 1024
    # every CTA gets a row block of the down phase where the hidden size allows it
    assert hidden // p.down_rows >= 132 or p.down_rows == 1


def test_moe_block_plan_refuses_what_the_kernel_cannot_take() -> None:
    assert moe_block.plan(2050, 768, 8, H100_SHARED, 132) is None  # rows of 16-byte chunks
    assert moe_block.plan(2048, 764, 8, H100_SHARED, 132) is None
    assert moe_block.plan(2048, 768, 0, H100_SHARED, 132) is None
    assert moe_block.plan(8192, 28672, 8, H100_SHARED, 132) is None  # act leaves no two stages


@needs_nvcc_and_cuobjdump
@pytest.mark.parametrize("hidden,inter,top_k", MOE_SHAPES[:2] + MOE_SHAPES[-2:])
def test_moe_block_compiles_for_sm90_without_spills(hidden, inter, top_k, tmp_path) -> None:
    p = moe_block.plan(hidden, inter, top_k, H100_SHARED, 132)
    defines = {
        "DTYPE_BF16": 1, "HIDDEN": hidden, "INTER": inter, "TOP_K": top_k, "PAIRS": p.pairs,
        "DOWN_ROWS": p.down_rows, "STAGES1": p.stages1, "STAGES2": p.stages2, "USE_PDL": 1,
    }  # fmt: skip
    cubin = compile_sm90(moe_block.SOURCE, defines, tmp_path, warnings=False)
    assert global_reads_before_the_wait(cubin) == []

