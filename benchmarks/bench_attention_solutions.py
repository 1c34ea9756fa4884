"""Decode attention and fused add+RMSNorm solutions side by side on the GPU: every solution of
paged decode attention on ``cuda`` (TileLang, the split-KV Triton kernel, the Triton fallback and
FlashInfer when installed; ``XHAL_KERNEL_PAGED_DECODE_ATTENTION`` forces each), each
checked against a float64 reference first, then timed as CUDA graph replays issued back to back,
against the read ceiling measured in the same run.

    python -m benchmarks.bench_attention_solutions [--quick]

Shapes: the attention of Llama-3-8B (32 q / 8 kv heads, head dim 128) and of Llama-3.2-1B (32 / 8,
head dim 64), bf16, batch 1 / 16 / 64, context 2K, pages of 16 and 128; the norm at hidden 4096
and 2048. A solution that does not take a shape (TileLang's decode is built for head dim 128) gets
a row saying why; without TileLang installed its rows and checks say so and the rest runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

import xhal
from benchmarks.common import (
    capture_graph,
    environment,
    read_bandwidth,
    table,
    time_cuda_pipelined,
)
from xhal.interfaces import AttentionSpec, BatchKind, LayerCache
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.cuda.platform import CudaPlatform

HEADS, KV_HEADS = 32, 8
HEAD_DIMS = {"llama3-8b": 128, "llama3.2-1b": 64}  # the shapes' attention, by model
HIDDEN = {"llama3-8b": 4096, "llama3.2-1b": 2048}


def make_decode(kv_lens: list[int], block: int, num_blocks: int, device) -> AttentionMetadata:
    """One new token per sequence; each sequence owns random distinct blocks (shuffled)."""
    pages = [-(-n // block) for n in kv_lens]
    width = max(pages)
    perm = torch.randperm(num_blocks)
    table_ = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table_[i, :n] = perm[start : start + n]
        table_[i, n:] = perm[start : start + 1]  # stale but valid ids past the row's pages
        start += n
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    pos = kv.long() - 1
    slots = (table_[torch.arange(len(kv_lens)), pos // block].long() * block + pos % block).int()
    q = torch.ones(len(kv_lens), dtype=torch.int32)
    return AttentionMetadata.from_host_lengths(
        BatchKind.DECODE, q, kv, table_.to(device), slots.to(device)
    )


def reference(q, cache: LayerCache, m: AttentionMetadata, scale: float) -> torch.Tensor:
    """float64 decode attention over each sequence's keys gathered through its block table."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block = cache.key.shape[1]
    group = q.shape[1] // cache.key.shape[2]
    for i, n in enumerate(m.kv_seq_lens_host.tolist()):
        ids = m.block_table[i, : -(-n // block)].long()
        k = cache.key[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = cache.value[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).cpu()
    return out


def decode_case(
    solution: str,
    batch: int,
    ctx: int,
    block: int,
    dtype=torch.bfloat16,
    ragged: bool = False,
    block_h: int | None = None,
    head_dim: int = 128,
):
    """(error vs float64, median us in a graph) of one KV write + decode attention layer on the
    ``cuda`` platform with paged decode attention forced to ``solution``; ``block_h`` forces
    TileLang's row tile (query heads per CTA)."""
    spec = AttentionSpec(HEADS, KV_HEADS, head_dim, dtype, block)
    with environment({"XHAL_KERNEL_PAGED_DECODE_ATTENTION": solution}):
        platform = CudaPlatform()  # a fresh one: it reads the setting when it is built
        backend = platform.attention_backend(spec)
    device = platform.device()
    if block_h is not None:
        from xhal.platforms.cuda.tilelang_attention import TileLangAttention
        from xhal.platforms.cuda.triton_attention import TritonAttention

        # the forced solution's backend may be a SplitAttention (another prefill solution),
        # which has no SM count of its own: the device's
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        backend = TileLangAttention(spec, TritonAttention(spec), sms, block_h=block_h)
    lens = torch.randint(1, ctx + 1, (batch,)).tolist() if ragged else [ctx] * batch
    num_blocks = sum(-(-n // block) for n in lens) + 8
    shape = (num_blocks, block, KV_HEADS, head_dim)
    cache = LayerCache(
        torch.randn(shape, dtype=dtype, device=device),
        torch.randn(shape, dtype=dtype, device=device),
    )
    backend.bind_kv_caches([cache])
    m = make_decode(lens, block, num_blocks, device)
    backend.plan(m)
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split(
        [HEADS, KV_HEADS, KV_HEADS], dim=1
    )  # strided views, as the models pass them
    out = backend.forward(0, q, k, v)
    err = (out.double().cpu() - reference(q, cache, m, spec.softmax_scale)).abs().max().item()
    us = _time_replays(lambda: backend.forward(0, q, k, v)) * 1e3
    return err, us


def _time_replays(fn) -> float:
    """Median ms per replay of ``fn`` captured in one CUDA graph, replays issued back to back
    (one sync per 20): a replay timed alone from an idle device (``time_graph``) also counts the
    host's graph launch, which bounded every batch-1 row of the 07:12 UTC run (docs/h200-results.md,
    twelfth session: one row's add + RMSNorm read 17.3 us)."""
    return time_cuda_pipelined(capture_graph(fn).replay)


def norm_case(name: str, rows: int, hidden: int = 4096):
    ops = xhal.platforms.get(name).ops
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.rand(hidden, dtype=torch.bfloat16, device="cuda") + 0.5
    normed, summed = ops.fused_add_rms_norm(x, r, w, 1e-6)
    s = (x.double() + r.double()).to(torch.bfloat16).double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = max((summed.double() - s).abs().max().item(), (normed.double() - ref).abs().max().item())
    us = _time_replays(lambda: ops.fused_add_rms_norm(x, r, w, 1e-6)) * 1e3
    return err, us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick", action="store_true", help="page 16 only, no fp16 / ragged checks"
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(HEAD_DIMS), default=sorted(HEAD_DIMS),
        help="whose attention shape (and norm width) to time",
    )  # fmt: skip
    args = parser.parse_args()
    read = read_bandwidth()["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s (read-only streaming kernel, this run)")
    has_tilelang = importlib.util.find_spec("tilelang") is not None
    if not has_tilelang:
        print("TileLang is not installed: its rows are left out (scripts/tilelang_wheels.sh)")
    # label -> (solution of paged_decode_attention, TileLang's row tile): tilelang chooses its
    # tile per step (16 query-head rows per CTA for split batches, 64 for unsplit ones), -h16 /
    # -h64 force one; triton-splitkv is the default's (FlashInfer's decode past its buckets),
    # triton the one-program-per-token fallback
    names = {
        "triton-splitkv": ("triton-splitkv", None),
        "triton": ("triton", None),
    }
    if has_tilelang:
        names = {
            "tilelang": ("tilelang", None),
            "tilelang-h16": ("tilelang", 16),
            "tilelang-h64": ("tilelang", 64),
            **names,
        }
    if importlib.util.find_spec("flashinfer") is not None:
        names["flashinfer"] = ("flashinfer", None)
    # correctness first: ragged lengths, both dtypes, both page sizes (TileLang only: the others
    # are proven by the conformance suite)
    checks = []
    for block in (16, 128) if has_tilelang else ():
        for dtype in (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16):
            for batch in (1, 7, 64):
                t0 = time.perf_counter()
                err, _ = decode_case("tilelang", batch, 3000, block, dtype, ragged=True)
                checks.append(
                    {
                        "block": block,
                        "dtype": str(dtype)[6:],
                        "batch": batch,
                        "max_err": err,
                        "s": time.perf_counter() - t0,
                    }
                )
    if checks:
        print(table(checks, "TileLang decode vs float64 (ragged contexts up to 3000, strided q)"))
    # one untimed case per solution first: the first timed case of a process read 31.8 us
    # for TileLang's batch-1 decode on the H100 (2026-12-05), 13.4-14.2 us in three repeats
    # after it, the same kernel as its forced 16-row tile
    for solution, block_h in names.values():
        if not _not_taken(solution, 128, 16):
            decode_case(solution, 1, 2048, 16, block_h=block_h)
    for model in args.models:
        head_dim = HEAD_DIMS[model]
        rows = []
        for block in (16,) if args.quick else (16, 128):
            for batch in (1, 16, 64):
                kv_bytes = batch * 2048 * KV_HEADS * head_dim * 2 * 2
                for sol, (solution, block_h) in names.items():
                    if solution in ("flashinfer", "triton-splitkv") and block != 16:
                        continue  # FlashInfer's page-128 kernels (split-KV's fallback too): a JIT
                    row = {"solution": sol, "page": block, "batch": batch}
                    why = _not_taken(solution, head_dim, block)
                    if why:
                        rows.append({**row, "us": "-", "err": "-", "TB/s": why, "of_read": "-"})
                        continue
                    err, us = decode_case(solution, batch, 2048, block, block_h=block_h,
                                          head_dim=head_dim)  # fmt: skip
                    rows.append(
                        {
                            **row,
                            "us": us,
                            "err": err,
                            "TB/s": kv_bytes / (us * 1e-6) / 1e12,
                            "of_read": kv_bytes / (us * 1e-6) / read,
                        }
                    )
        print(
            table(
                rows,
                f"decode attention layer (KV write + attention) in a CUDA graph, {model} shape: "
                f"bf16 32q/8kv D{head_dim} ctx 2048, KV bytes / time",
            )
        )
        rows = []
        hidden = HIDDEN[model]
        solutions = (("tilelang", "cuda-tilelang"),) if has_tilelang else ()
        for batch in (1, 16, 64):
            moved = batch * hidden * 2 * 4 + hidden * 2  # x, residual read; both outputs; weight
            for sol, name in (*solutions, ("triton", "cuda-triton")):
                err, us = norm_case(name, batch, hidden)
                rows.append(
                    {
                        "solution": sol,
                        "rows": batch,
                        "us": us,
                        "err": err,
                        "GB/s": moved / (us * 1e-6) / 1e9,
                    }
                )
        print(table(rows, f"fused add + RMSNorm in a CUDA graph, bf16 hidden {hidden} ({model})"))


def _not_taken(solution: str, head_dim: int, block: int) -> str | None:
    """Why ``solution`` does not take this shape (a row that says so instead of a time)."""
    if solution != "tilelang":
        return None
    from xhal.platforms.cuda import tilelang_attention

    return tilelang_attention.unsupported(
        AttentionSpec(HEADS, KV_HEADS, head_dim, torch.bfloat16, block)
    )


if __name__ == "__main__":
    main()
