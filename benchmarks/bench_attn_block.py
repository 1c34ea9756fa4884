"""The attention block kernel (``kernels/attn_block.cu``, the ``native-block`` decode solution)
against the chain it replaces, in one process: a few layers of distinct random weights, one
decode token, ctx 2K, pages of 16, bf16. Each path runs every layer back to back inside one CUDA
graph (the chain: the norm + qkv GEMV, the split-KV attention with rotary and the KV write, the o
GEMV: what a layer runs when its backend declines the block); us per layer against the bytes a
layer reads (qkv and o weights, norm, KV) over the read ceiling measured in the same run. Then
the block once more, built with ``TIMING``: each CTA's time at the kernel's phase boundaries,
median and latest over the CTAs, from the earliest start.

    python -m benchmarks.bench_attn_block --shape llama3.2-1b
"""

from __future__ import annotations

import argparse

import torch

import xhal
from benchmarks.common import ceilings, phase_rows, table, time_cuda
from benchmarks.llama_model import decode_metadata
from xhal import ops
from xhal.interfaces import AttentionBlock, AttentionSpec, LayerCache
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.layers import Attention, RMSNorm, RotaryEmbedding

# hidden, heads, KV heads, head dim, Qwen3's q/k norms
SHAPES = {
    "llama3.2-1b": (2048, 32, 8, 64, False),
    "llama3-8b": (4096, 32, 8, 128, False),
    "qwen3-30b-a3b": (2048, 32, 4, 128, True),
}
PAGE = 16
MARKS = ("start", "after the wait", "qkv stored", "barrier 1 passed", "attention done",
         "merged", "barrier 2 passed", "end")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=2048)
    args = parser.parse_args()
    ceil = ceilings()
    platform = xhal.platforms.get("cuda")
    device = platform.device()
    hidden, heads, kv_heads, head_dim, qk = SHAPES[args.shape]
    dtype, layers = torch.bfloat16, args.layers
    spec = AttentionSpec(heads, kv_heads, head_dim, dtype, PAGE)
    with platform.kernels.forcing("paged_decode_attention", "native-block"):
        backend = platform.attention_backend(spec)
    block_backend = getattr(backend, "decode", backend)  # the decode side of a SplitAttention
    num_blocks = args.ctx // PAGE + 2
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    caches = [
        LayerCache(torch.randn(shape, dtype=dtype, device=device),
                   torch.randn(shape, dtype=dtype, device=device))
        for _ in range(layers)
    ]  # fmt: skip
    backend.bind_kv_caches(caches)
    _, positions, meta = decode_metadata(1, args.ctx, device)
    backend.plan(meta)
    assert backend.fuses_block, "the native-block backend takes a one-sequence decode step"
    rotary = RotaryEmbedding(head_dim, head_dim, 8192, 500000.0).to(device)

    def w(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(size, device=device) * scale).to(dtype)

    qkv_rows = (heads + 2 * kv_heads) * head_dim
    norms = {}
    blocks = []
    for _ in range(layers):
        if qk:
            norms = dict(q_norm_weight=w(head_dim, scale=0.1) + 1,
                         k_norm_weight=w(head_dim, scale=0.1) + 1, qk_norm_eps=1e-6)  # fmt: skip
        blocks.append(AttentionBlock(
            w(hidden, scale=0.1) + 1, 1e-5, w(qkv_rows, hidden, scale=hidden**-0.5),
            w(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
            rotary.cos_sin_cache, True, **norms,
        ))  # fmt: skip
    attns = [
        Attention(heads, head_dim, head_dim**-0.5, kv_heads, layer_id=i) for i in range(layers)
    ]
    x, residual = w(1, hidden, scale=1.0), w(1, hidden, scale=1.0)
    ctx = ForwardContext(metadata=meta, attention=dict.fromkeys(range(layers), backend),
                         collective=platform.collective(None))  # fmt: skip

    def block_chain() -> torch.Tensor:
        h, r = x, residual
        for i in range(layers):
            fused = attns[i].forward_block(blocks[i], h, r, positions)
            if fused is None:
                raise RuntimeError(f"the block kernel declined layer {i}: nothing to time")
            h, r = fused
        return h

    def head_norm(weight: torch.Tensor | None, eps: float) -> RMSNorm | None:
        if weight is None:
            return None
        norm = RMSNorm(head_dim, eps).to(device)
        norm.weight.data = weight
        return norm

    qk_norms = [(head_norm(b.q_norm_weight, b.qk_norm_eps), head_norm(b.k_norm_weight,
                 b.qk_norm_eps)) for b in blocks]  # fmt: skip
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def sequence_chain() -> torch.Tensor:
        """The layer's own path on the same backend (RopeAttention.forward_normed when the
        block is declined): the fused norm + qkv GEMV, the attention with its q/k norm,
        rotary and KV write, the o GEMV."""
        h, r = x, residual
        for i, b in enumerate(blocks):
            qkv, r = ops.add_rms_norm_linear(h, r, b.norm_weight, b.norm_eps, b.qkv_weight)
            q, k, v = qkv.split(sizes, dim=-1)
            out = attns[i](q, k, v, positions, rotary, *qk_norms[i])
            h = ops.linear(out, b.o_weight)
        return h

    per_layer = qkv_rows * hidden * 2 + hidden * heads * head_dim * 2 + hidden * 2
    per_layer += 2 * args.ctx * kv_heads * head_dim * 2
    floor_us = per_layer / ceil["read_bandwidth"] * 1e6
    rows, outputs = [], {}
    with forward_context(ctx):
        for name, chain in (("block (native-block)", block_chain), ("chain (triton-splitkv)",
                                                                     sequence_chain)):  # fmt: skip
            outputs[name] = chain().float()  # eager: builds and warms every kernel
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            ms = time_cuda(graph.replay, iters=50, warmup=5)
            us = ms * 1e3 / layers
            rows.append({"path": name, "us/layer": us, "x read floor": us / floor_us,
                         "floor us": floor_us})  # fmt: skip
        first, second = outputs.values()
        diff = float((first - second).abs().max() / second.abs().max())
        print(table(rows, f"attention block, {args.shape}, batch 1, ctx {args.ctx}, {layers} "
                          f"layers in one graph; output difference {diff:.2e} of its largest"))
        # the phases of one launch (the last layer's), the kernel rebuilt with TIMING
        from xhal.platforms.cuda.kernels import attn_block

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        timing = torch.zeros(sms, 8, dtype=torch.int64, device=device)
        saved = block_backend._kernels.get(device)
        block_backend._kernels[device] = attn_block.AttentionBlockKernel(device, timing)
        try:
            for _ in range(3):
                block_chain()
            torch.cuda.synchronize()
        finally:
            block_backend._kernels[device] = saved
    print(table(phase_rows(timing, MARKS), "one block launch, each CTA's clock at the phase "
                                           "boundaries"))


if __name__ == "__main__":
    main()
