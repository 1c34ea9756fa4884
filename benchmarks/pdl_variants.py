"""The programmatic dependent launch settings the decode benchmarks compare in one process
(``bench_model --pdl``, ``bench_moe --pdl``): each setting's decode graphs are captured by an
executor of their own over the same model and caches, then timed against the same floors."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator, Sequence

from benchmarks.common import environment
from xhal.executor import ExecutorConfig, ModelExecutor

# name -> (XHAL_CUDA_PDL, XHAL_CUDA_PDL_TRIGGER)
PDL_VARIANTS = {
    "off": ("0", "auto"),
    "early": ("1", "early"),
    "late": ("1", "late"),
    "auto": ("1", "auto"),
    # the size rule alone: auto before it made the add + RMSNorm GEMVs trigger late (pdl.py)
    "by-size": ("1", "by-size"),
    # auto with the stream GEMVs' launch shapes of the tree before the ninth session's table
    # (fused_gemv_config.PREVIOUS): the peer of this tree's TUNED table
    "auto-previous-gemv": ("1", "auto"),
    # auto with the gated activation as the float32 torch sequence (XHAL_CUDA_TRITON_ACTIVATION=0):
    # the peer of the Triton activation kernel
    "auto-torch-activation": ("1", "auto"),
    # auto with TUNED's tiles but plain weight loads (tma 0 in every row)
    "auto-no-tma": ("1", "auto"),
    # the tree as committed before BENCH_GEMV_TABLE loaded its rows, with the size rule alone:
    # the ninth session's behaviour (its TUNED, plain weight loads)
    "tree-before": ("1", "by-size"),
    # auto with the split-KV launch triggering right after its wait at every batch, the overlap
    # off (splitkv_decode.TRIGGER early, XHAL_CUDA_OVERLAP=0): the o GEMV's programs start beside
    # the attention and load their first weight tile while it runs, where the late trigger starts
    # them in its tail
    "auto-attn-early": ("1", "auto"),
    # auto with the MoE pair GEMVs (moe_small.py) as plain launches: the tree before they took PDL
    "auto-moe-plain": ("1", "auto"),
    # auto with the down + combine kernel triggering right after its wait: the next layer's
    # norm + qkv GEMV loads its first weight tile beside the expert stream
    "auto-moe-down-early": ("1", "auto"),
    # auto with Qwen3's q/k norms as their own launch before the split-KV decode launch
    # (XHAL_CUDA_FUSED_QK_NORM=0): the tree before the twelfth session fused them into it
    "auto-qk-norm-apart": ("1", "auto"),
    # auto with the gated MLP block as the two fused GEMVs (XHAL_CUDA_MLP_BLOCK=0): the tree
    # before the persistent block (kernels/mlp_block.cu)
    "auto-mlp-pair": ("1", "auto"),
    # auto with the one-row projections outside the MLP block on the Triton stream GEMVs
    # (XHAL_CUDA_NATIVE_GEMV=0): the tree before the native stream GEMV (kernels/gemv_stream.cu)
    "auto-triton-gemv": ("1", "auto"),
    # both: the tree before this session's native kernels
    "auto-triton-only": ("1", "auto"),
    # auto with a one-sequence decode step's attention blocks in one persistent launch each
    # (the native-block solution of paged_decode_attention, kernels/attn_block.cu)
    "auto-attn-block": ("1", "auto"),
    # auto with one token's routed experts in one persistent launch a layer (the native
    # solution of moe_experts, kernels/moe_block.cu) in place of the pair GEMVs
    "auto-moe-native": ("1", "auto"),
    # the tree before the one-row stream kernels ran beside each other (XHAL_CUDA_OVERLAP=0,
    # which auto has on: half an SM's shared memory each, the MLP block and o letting the next
    # kernel launch before their wait, o on the native stream GEMV, the one-sequence split-KV
    # launch triggering right after its wait)
    "auto-no-overlap": ("1", "auto"),
    # auto with the one-sequence split-KV launch triggering late (splitkv_decode.TRIGGER_BESIDE)
    "auto-overlap-attn-late": ("1", "auto"),
    # auto with the MLP block beside where half an SM holds its rings two deep (the 8B's and
    # Qwen2.5-7B's plans; mlp_block.BESIDE_DEPTH 2 where the tree has 3)
    "auto-overlap-mlp-shallow": ("1", "auto"),
    # auto with the MoE down + combine kernel triggering right after its wait, so the next
    # layer's norm + qkv GEMV (half an SM) lands beside the expert stream
    "auto-overlap-moe-down-early": ("1", "auto"),
    # auto with every 2- to 64-row projection on the tensor-core skinny GEMM (kernels/skinny_mma.cu,
    # XHAL_CUDA_SKINNY_MMA=1) in place of cuBLAS, and with every one on cuBLAS (=0); auto takes
    # whichever a timing on the machine found faster, shape by shape (skinny_choice.py)
    "auto-skinny-mma": ("1", "auto"),
    "auto-no-skinny": ("1", "auto"),
    # one or two parts of the overlap (env.cuda_overlap); the split-KV launch triggers early
    # where o is one of them
    "auto-overlap-o": ("1", "auto"),
    "auto-overlap-o-qkv": ("1", "auto"),
    "auto-overlap-mlp-qkv": ("1", "auto"),
    # auto with more splits of the split-KV launch where the merge cap bounds them (splitkv_splits:
    # Qwen3-30B-A3B's 4 KV heads at group 8 take 8 splits, 4 tiles a program): 16 (merged in two
    # rounds of 8), and 32 (a tile a program, four rounds)
    "auto-attn-16-splits": ("1", "auto"),
    "auto-attn-32-splits": ("1", "auto"),
    # auto with the split-KV merge's loads issued ahead (splitkv_merge.EARLY_LOADS), at the
    # tree's split counts, at 16 and 32 splits, and at 16 merged in one round of 16
    "auto-merge-early-loads": ("1", "auto"),
    "auto-attn-16-splits-early-loads": ("1", "auto"),
    "auto-attn-32-splits-early-loads": ("1", "auto"),
    "auto-attn-16-splits-one-round": ("1", "auto"),
    # auto with the split-KV launch's programs at 2 and 8 warps (splitkv_decode.NUM_WARPS, 4)
    "auto-attn-2-warps": ("1", "auto"),
    "auto-attn-8-warps": ("1", "auto"),
    # auto with the split-KV merge by the last program alone (splitkv_splits.SPREAD off: the
    # tree spreads it over a KV head's programs where one round would not hold the splits), and
    # spread over as many splits as fit one program per SM (Qwen3-30B-A3B: 33; the tree stops
    # at 16, SPREAD_MAX_SPLITS)
    "auto-no-spread": ("1", "auto"),
    "auto-attn-spread-fit": ("1", "auto"),
    # auto with 64-key tiles at head dim 128 in half precision (splitkv_splits.WIDE_TILES off:
    # the tree takes 128 where a launch has at most one program per SM, so the MoE and 8B
    # shapes' 16 splits at batch 1, ctx 2K, have one tile each, not two)
    "auto-attn-64-key-tiles": ("1", "auto"),
    # auto with two pipeline stages a split-KV program (splitkv_decode.SPLIT_STAGES, 3): the
    # same work where a program has one tile, in 72 KB of shared memory instead of 136 at
    # 128-key tiles, so o's CTA fits beside it
    "auto-attn-2-stages": ("1", "auto"),
    # auto with a MoE layer's o projection and router in one launch (the native solution of
    # linear_add_rms_norm_moe_route, gemv_stream.cu's route entry) in place of the o GEMV and
    # the fused norm + router + top-k
    "auto-o-route": ("1", "auto"),
}
# variant -> (op, solution) its executor is made, warmed up and captured with
FORCED_SOLUTION = {
    "auto-attn-block": ("paged_decode_attention", "native-block"),
    "auto-moe-native": ("moe_experts", "native"),
    "auto-o-route": ("linear_add_rms_norm_moe_route", "native"),
}
# variant -> {kernel module: {attribute: value}} its launchers read per call while it captures
# (pdl.OFF = 0, EARLY = 1, LATE = 2; the executor's warm-up before capture compiles them)
_MODULE_SETTINGS = {
    "auto-attn-early": {"splitkv_decode": {"TRIGGER": 1}},
    "auto-overlap-attn-late": {"splitkv_decode": {"TRIGGER_BESIDE": 2}},
    "auto-overlap-mlp-shallow": {"mlp_block": {"BESIDE_DEPTH": 2}},
    "auto-moe-plain": {"moe_small": {"TRIGGERS": (0, 0)}},
    "auto-moe-down-early": {"moe_small": {"TRIGGERS": (2, 1)}},
    "auto-overlap-moe-down-early": {"moe_small": {"TRIGGERS": (2, 1)}},
    "auto-attn-16-splits": {"splitkv_splits": {"MERGE_FLOATS": 16384}},
    "auto-attn-32-splits": {"splitkv_splits": {"MERGE_FLOATS": 32768, "PROGRAMS_PER_SM": 4}},
    "auto-merge-early-loads": {"splitkv_merge": {"EARLY_LOADS": True}},
    "auto-attn-16-splits-early-loads": {
        "splitkv_splits": {"MERGE_FLOATS": 16384}, "splitkv_merge": {"EARLY_LOADS": True}
    },
    "auto-attn-32-splits-early-loads": {
        "splitkv_splits": {"MERGE_FLOATS": 32768, "PROGRAMS_PER_SM": 4},
        "splitkv_merge": {"EARLY_LOADS": True},
    },
    "auto-attn-16-splits-one-round": {
        "splitkv_splits": {"MERGE_FLOATS": 16384}, "splitkv_decode": {"MERGE_FLOATS": 16384},
        "splitkv_merge": {"EARLY_LOADS": True},
    },
    "auto-attn-2-warps": {"splitkv_decode": {"NUM_WARPS": 2}},
    "auto-attn-8-warps": {"splitkv_decode": {"NUM_WARPS": 8}},
    "auto-no-spread": {"splitkv_splits": {"SPREAD": False}},
    "auto-attn-spread-fit": {"splitkv_splits": {"SPREAD_MAX_SPLITS": 64}},
    "auto-attn-64-key-tiles": {"splitkv_splits": {"WIDE_TILES": False}},
    "auto-attn-2-stages": {"splitkv_decode": {"SPLIT_STAGES": 2}},
}
PREVIOUS_GEMV = "auto-previous-gemv"
# variant -> further settings it captures under
EXTRA_ENV = {
    "auto-torch-activation": {"XHAL_CUDA_TRITON_ACTIVATION": "0"},
    "auto-qk-norm-apart": {"XHAL_CUDA_FUSED_QK_NORM": "0"},
    "auto-mlp-pair": {"XHAL_CUDA_MLP_BLOCK": "0"},
    # the trees before the native kernels, before the overlap too
    "auto-triton-gemv": {"XHAL_CUDA_NATIVE_GEMV": "0", "XHAL_CUDA_OVERLAP": "0"},
    "auto-triton-only": {
        "XHAL_CUDA_MLP_BLOCK": "0", "XHAL_CUDA_NATIVE_GEMV": "0", "XHAL_CUDA_OVERLAP": "0"
    },
    "tree-before": {"XHAL_CUDA_OVERLAP": "0"},
    "auto-attn-early": {"XHAL_CUDA_OVERLAP": "0"},
    "auto-no-overlap": {"XHAL_CUDA_OVERLAP": "0"},
    "auto-skinny-mma": {"XHAL_CUDA_SKINNY_MMA": "1"},
    "auto-no-skinny": {"XHAL_CUDA_SKINNY_MMA": "0"},
    "auto-overlap-o": {"XHAL_CUDA_OVERLAP": "o"},
    "auto-overlap-o-qkv": {"XHAL_CUDA_OVERLAP": "o,qkv"},
    "auto-overlap-mlp-qkv": {"XHAL_CUDA_OVERLAP": "mlp,qkv"},
}
_TREE_TUNED: dict = {}  # TUNED as the tree has it, before load_gemv_table


def tree_table() -> dict:
    """The stream GEMVs' TUNED table as committed, whatever ``BENCH_GEMV_TABLE`` loaded."""
    from xhal.platforms.cuda.kernels.fused_gemv_config import TUNED

    return dict(_TREE_TUNED) if _TREE_TUNED else dict(TUNED)


def load_gemv_table() -> None:
    """``BENCH_GEMV_TABLE=FILE`` (bench_decode_gemv --json) replaces the rows of the stream
    GEMVs' TUNED table it names, for every executor this process captures: the model step timed
    with configs chosen by a sweep of the same run."""
    path = os.environ.get("BENCH_GEMV_TABLE")
    if not path:
        return
    if not os.path.exists(path):
        print(f"BENCH_GEMV_TABLE={path} does not exist: the tree's TUNED table is timed")
        return
    from xhal.platforms.cuda.kernels.fused_gemv_config import TUNED
    from xhal.platforms.cuda.kernels.gemv import GemvConfig

    _TREE_TUNED.update(tree_table())
    with open(path) as f:
        for prologue, n, k, *config in json.load(f):
            TUNED[(prologue, n, k)] = GemvConfig(*config)
    print(f"stream GEMV launch shapes from {path}: {TUNED}")


def _compile_stream_gemv(prologue: int, n: int, k: int) -> None:
    """One call of the bf16 one-row stream GEMV of this shape as the current table launches it
    (the CudaOps warm-up of a shape it has seen does not launch it again)."""
    import torch

    from xhal.platforms.cuda import pdl
    from xhal.platforms.cuda.kernels import fused_gemv

    device = torch.device("cuda", torch.cuda.current_device())
    use_pdl = pdl.mode(device)
    w = torch.zeros(n, k, dtype=torch.bfloat16, device=device)
    x = torch.zeros(1, 2 * k if prologue == 2 else k, dtype=torch.bfloat16, device=device)
    if prologue == 1:
        fused_gemv.add_rms_norm_gemv(x, x, x[0], 1e-5, w, use_pdl=use_pdl)
    elif prologue == 2:
        fused_gemv.silu_and_mul_gemv(x, w, use_pdl=use_pdl)
    else:
        fused_gemv.stream_gemv(x, w, use_pdl=use_pdl)


@contextlib.contextmanager
def _gemv_table(name: str) -> Iterator[None]:
    """Another table in place of TUNED while a variant that names one captures: the previous
    one (``PREVIOUS_GEMV``), TUNED with plain weight loads (``auto-no-tma``), the tree's as
    committed (``tree-before``)."""
    from xhal.platforms.cuda.kernels.fused_gemv_config import PREVIOUS, TUNED

    saved = dict(TUNED)
    tables = {
        PREVIOUS_GEMV: lambda: dict(PREVIOUS),
        "auto-no-tma": lambda: {k: c._replace(tma=0) for k, c in saved.items()},
        "tree-before": tree_table,
    }
    if name not in tables:
        yield
        return
    replaced = tables[name]()
    TUNED.clear()
    TUNED.update(replaced)
    for key in {**saved, **replaced}:  # the shapes whose launch changes: compiled here, since
        _compile_stream_gemv(*key)  # not under capture
    try:
        yield
    finally:
        TUNED.clear()
        TUNED.update(saved)


@contextlib.contextmanager
def _module_settings(name: str) -> Iterator[None]:
    """The kernel modules' settings of ``_MODULE_SETTINGS`` replaced while the variant captures."""
    import importlib

    saved = []
    try:
        for module_name, settings in _MODULE_SETTINGS.get(name, {}).items():
            module = importlib.import_module(f"xhal.platforms.cuda.kernels.{module_name}")
            for key, value in settings.items():
                saved.append((module, key, getattr(module, key)))
                setattr(module, key, value)
        yield
    finally:
        for module, key, value in reversed(saved):
            setattr(module, key, value)


@contextlib.contextmanager
def _forced_solution(platform, name: str) -> Iterator[None]:
    """The variant's solution of one op while its executor makes its backends, warms up and
    captures: an attention op through the platform's forcing (a backend keeps the solution it
    was made with), a device op by serving the platform's chosen ops with that one replaced."""
    if name not in FORCED_SOLUTION:
        yield
        return
    from xhal import ops
    from xhal.solutions.op_names import ATTENTION_OPS

    op, solution = FORCED_SOLUTION[name]
    if op in ATTENTION_OPS:
        forced = platform.kernels.forcing(op, solution)
    else:
        forced = ops.using(platform.device_type, platform.kernels.ops_with(op, solution))
    with forced:
        yield


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--pdl NAME ...``: the settings to capture and time besides the default executor. Also
    loads ``BENCH_GEMV_TABLE``, before the benchmark builds any executor."""
    load_gemv_table()
    parser.add_argument(
        "--pdl",
        nargs="+",
        choices=sorted(PDL_VARIANTS),
        default=[],
        help="also capture and time the decode graphs once per PDL setting (same process)",
    )


@contextlib.contextmanager
def pdl_variant(name: str) -> Iterator[None]:
    """``XHAL_CUDA_PDL`` and ``XHAL_CUDA_PDL_TRIGGER`` (and the variant's ``EXTRA_ENV``) set for
    one of ``PDL_VARIANTS`` while the block runs (the kernels read them at launch, so a graph
    captured inside keeps them)."""
    settings = {
        **dict(zip(("XHAL_CUDA_PDL", "XHAL_CUDA_PDL_TRIGGER"), PDL_VARIANTS[name])),
        **EXTRA_ENV.get(name, {}),
    }
    with environment(settings), _gemv_table(name), _module_settings(name):
        yield


def capture_per_variant(
    model, platform, config: ExecutorConfig, caches, variants: Sequence[str]
) -> dict[str, ModelExecutor]:
    """One executor per variant over ``caches``, its decode graphs captured under that setting."""
    executors = {}
    for name in variants:
        with pdl_variant(name), _forced_solution(platform, name):
            executors[name] = ex = ModelExecutor(model, platform, config)
            ex.bind_kv_caches(caches)
            ex.capture_graphs(progress=False)
    return executors
