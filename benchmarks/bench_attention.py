"""Attention kernels on the GPU: decode KV-read bandwidth and prefill FLOP rate, FlashInfer and the
Triton fallback side by side, against ceilings measured in the same run.

    python -m benchmarks.bench_attention [--quick]
"""

from __future__ import annotations

import argparse

import torch

import xhal
from benchmarks.common import ceilings, table, time_cuda, time_graph
from xhal.interfaces import AttentionSpec, BatchKind, LayerCache
from xhal.interfaces.metadata import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def make_step(batch: int, q_len: int, ctx: int, num_blocks: int, device) -> AttentionMetadata:
    """Each sequence owns ctx/BLOCK random distinct blocks; its last q_len tokens are new."""
    per_seq = -(-ctx // BLOCK)
    blocks = torch.randperm(num_blocks)[: batch * per_seq].view(batch, per_seq).int()
    kv = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.full((batch,), q_len, dtype=torch.int32)
    pos = torch.arange(ctx - q_len, ctx)
    slots = (blocks[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).flatten().int()
    kind = (
        BatchKind.DECODE
        if q_len == 1
        else (BatchKind.PREFILL if q_len == ctx else BatchKind.CHUNKED_PREFILL)
    )
    return AttentionMetadata.from_host_lengths(kind, q, kv, blocks.to(device), slots.to(device))


def run(
    platform_name: str, batch: int, q_len: int, ctx: int, tensor_cores: bool | None = None
) -> float:
    """Median ms of one attention forward (KV write + attention) over one layer."""
    platform = xhal.platforms.get(platform_name)
    device = platform.device()
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, BLOCK)
    backend = platform.attention_backend(spec)
    if tensor_cores is not None:  # the same backend with FlashInfer's other decode kernel
        from xhal.platforms.cuda.attention import FlashInferAttention

        backend = FlashInferAttention(spec, backend.workspace, use_tensor_cores=tensor_cores)
    num_blocks = batch * -(-ctx // BLOCK) + 8
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    cache = LayerCache(
        torch.randn(shape, dtype=torch.bfloat16, device=device),
        torch.randn(shape, dtype=torch.bfloat16, device=device),
    )
    backend.bind_kv_caches([cache])
    meta = make_step(batch, q_len, ctx, num_blocks, device)
    backend.plan(meta)
    t = batch * q_len
    q = torch.randn(t, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)

    def fn():
        return backend.forward(0, q, k, v)

    # decode runs inside CUDA graphs when served, so time it there: launch overhead excluded
    return time_graph(fn) if q_len == 1 else time_cuda(fn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    args = parser.parse_args()
    ceil = ceilings()
    rows = []
    batches, ctxs = ([1, 64], [2048]) if args.quick else ([1, 16, 64, 256], [512, 2048, 8192])
    paths = {
        "flashinfer-tc": ("cuda", None),
        "flashinfer-cc": ("cuda", False),
        "triton": ("cuda-triton", None),
    }
    if args.decode_only:
        paths = {"flashinfer-tc": paths["flashinfer-tc"], "flashinfer-cc": paths["flashinfer-cc"]}
    for path, (name, tc) in paths.items():
        for batch in batches:
            for ctx in ctxs:
                ms = run(name, batch, 1, ctx, tc)
                kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
                rows.append(
                    {
                        "path": path,
                        "batch": batch,
                        "ctx": ctx,
                        "us": ms * 1e3,
                        "TB/s": kv_bytes / (ms * 1e-3) / 1e12,
                        "of_copy_ceiling": kv_bytes / (ms * 1e-3) / ceil["bandwidth"],
                    }
                )
    print(
        table(
            rows,
            "decode attention in a CUDA graph (bf16, 32q/8kv heads, D=128, page 16; tc = "
            "tensor-core kernel, cc = CUDA cores): KV bytes read / time",
        )
    )
    if args.decode_only:
        return
    rows = []
    for name in ("cuda", "cuda-triton"):
        for length in [2048] if args.quick else [1024, 4096]:
            ms = run(name, 1, length, length)
            flops = 2 * length * length * HEAD_DIM * HEADS  # causal: half of 4 * L^2 * D * H
            rows.append(
                {
                    "path": "flashinfer" if name == "cuda" else "triton",
                    "tokens": length,
                    "ms": ms,
                    "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                    "of_matmul_ceiling": flops / (ms * 1e-3) / ceil["flops"],
                }
            )
    print(table(rows, "prefill attention (bf16, causal, one sequence)"))


if __name__ == "__main__":
    main()
