"""The small ops of a Qwen3-30B-A3B-shaped decode layer on the GPU, fused against the unfused
sequence they replace, in one run: the post-attention add+RMSNorm, router GEMV and top-k
(``add_rms_norm_moe_route``: one launch against four) and Qwen3's q/k norms (``qk_rms_norm``: one
launch against two), each checked against the unfused sequence first; and the launch shapes of
the attention block's two batch-1 GEMVs (norm+qkv, o).

Each timed graph runs ``COPIES`` calls on distinct weights and inputs (more than L2 holds, as in
a step where a layer's 100 MB of experts pass between two routers), so the per-call time includes
reading the router from memory; floor = the bytes a call must read / the streaming-read rate.

    python -m benchmarks.bench_moe_ops [--batches 1 16]
"""

from __future__ import annotations

import argparse

import torch

import xhal
from benchmarks.common import read_bandwidth, table, time_graph
from xhal.interfaces.ops import DeviceOps
from xhal.platforms.cuda.kernels import moe_router, qk_norm

HIDDEN, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM = 2048, 128, 8, 32, 4, 128
COPIES = 256  # 256 routers of 0.5 MB: 128 MB, past the H200's 50 MB of L2
BF16 = torch.bfloat16


def per_call_us(fn, copies: int = COPIES) -> float:
    return time_graph(lambda: [fn(i) for i in range(copies)], iters=20) * 1e3 / copies


def router_rows(ops, batch: int, rate: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g).mul_(scale).to(BF16)

    xs = [randn(batch, HIDDEN) for _ in range(COPIES)]
    residuals = [randn(batch, HIDDEN) for _ in range(COPIES)]
    norm_w = [randn(HIDDEN, scale=0.1).add_(1.0) for _ in range(COPIES)]
    gates = [randn(EXPERTS, HIDDEN, scale=HIDDEN**-0.5) for _ in range(COPIES)]

    def unfused(i):
        return DeviceOps.add_rms_norm_moe_route(
            ops, xs[i], residuals[i], norm_w[i], 1e-6, gates[i], TOP_K, True
        )

    def fused(i, warps=None, programs=moe_router.ROW_PROGRAMS):
        return moe_router.add_rms_norm_route(
            xs[i], residuals[i], norm_w[i], 1e-6, gates[i], TOP_K, True, num_warps=warps,
            row_programs=programs,
        )

    # correctness: the fused outputs against the unfused sequence on the same inputs
    want, got = unfused(0), fused(0)
    logits_err = float((got[0].float() - want[0].float()).abs().max())
    normed_err = float((got[1].float() - want[1].float()).abs().max())
    same_ids = float((got[4] == want[4]).float().mean())
    weights_err = float((got[3] - want[3]).abs().max())
    floor_us = (EXPERTS * HIDDEN + 3 * batch * HIDDEN + HIDDEN) * 2 / rate * 1e6
    rows = []
    timed = {"unfused (add+norm, GEMV, route)": unfused}
    timed |= {f"fused, {w} warps": (lambda i, w=w: fused(i, w)) for w in (1, 2, 4, 8)}
    timed |= {f"fused, {p} programs, 1 warp": (lambda i, p=p: fused(i, 1, p)) for p in (32, 128)}
    timed["fused, default"] = fused
    for name, fn in timed.items():
        try:
            us = per_call_us(fn)
        except Exception as exc:  # a launch shape this GPU rejects is a result, not the end
            print(f"router {name}: {type(exc).__name__}: {exc}")
            continue
        rows.append({"op": "norm+router+top-k", "batch": batch, "variant": name, "us": us,
                     "x_floor": us / floor_us, "logits_err": logits_err, "normed_err": normed_err,
                     "ids_equal": same_ids, "weights_err": weights_err})
    return rows


def qk_rows(ops, batch: int, rate: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(100 + batch)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkvs = [torch.randn(batch, width, device="cuda", generator=g).to(BF16) for _ in range(COPIES)]
    qw = torch.rand(HEAD_DIM, device="cuda", generator=g).add_(0.5).to(BF16)
    kw = torch.rand(HEAD_DIM, device="cuda", generator=g).add_(0.5).to(BF16)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def split(i):
        return qkvs[i][:, :q_size], qkvs[i][:, q_size : q_size + kv_size]

    def unfused(i):
        return DeviceOps.qk_rms_norm(ops, *split(i), qw, kw, 1e-6)

    def fused(i):
        return qk_norm.qk_rms_norm(*split(i), qw, kw, 1e-6)

    want, got = unfused(0), fused(0)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    floor_us = 2 * batch * (q_size + kv_size) * 2 / rate * 1e6  # read and write once
    rows = []
    for name, fn in (("unfused (two rms_norm)", unfused), ("fused, one launch", fused)):
        us = per_call_us(fn)
        rows.append({"op": "q/k norm", "batch": batch, "variant": name, "us": us,
                     "x_floor": us / floor_us, "logits_err": err, "normed_err": err,
                     "ids_equal": 1.0, "weights_err": 0.0})
    return rows


# one-row launch shapes (block_n, block_k, split_k, warps, stages) of the layer's two GEMVs
GEMV_SWEEP = [None, (4, 1024, 1, 4, 3), (4, 512, 1, 4, 4), (8, 1024, 1, 4, 2), (16, 512, 1, 4, 3),
              (16, 256, 1, 4, 4), (8, 256, 1, 4, 4), (32, 256, 1, 8, 3), (8, 512, 2, 4, 2)]
GEMV_COPIES = 8  # 8 x 21 MB of qkv, 8 x 16.8 MB of o: past L2


def gemv_rows(rate: float) -> list[dict]:
    """norm+qkv (``add_rms_norm_gemv``, N = 5120, K = 2048) and o (``stream_gemv``, N = 2048,
    K = 4096) at batch 1 per launch shape (None: the heuristic), against their weights' floor."""
    from xhal.platforms.cuda.kernels import fused_gemv

    g = torch.Generator(device="cuda").manual_seed(7)
    qkv_n, o_k = (HEADS + 2 * KV_HEADS) * HEAD_DIM, HEADS * HEAD_DIM
    qkv_w = [torch.randn(qkv_n, HIDDEN, device="cuda", generator=g).to(BF16)
             for _ in range(GEMV_COPIES)]
    o_w = [torch.randn(HIDDEN, o_k, device="cuda", generator=g).to(BF16)
           for _ in range(GEMV_COPIES)]
    x, res = (torch.randn(1, HIDDEN, device="cuda", generator=g).to(BF16) for _ in range(2))
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=BF16)
    attn = torch.randn(1, o_k, device="cuda", generator=g).to(BF16)
    summed = (x.float() + res.float()).to(BF16).float()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)
    want_qkv = normed @ qkv_w[0].float().T
    want_o = (attn.float() @ o_w[0].float().T)
    rows = []
    for config in GEMV_SWEEP:
        for name, fn, want, nbytes in (
            ("norm+qkv", lambda i, c=config: fused_gemv.add_rms_norm_gemv(
                x, res, norm_w, 1e-6, qkv_w[i], config=c)[0], want_qkv, qkv_n * HIDDEN * 2),
            ("o", lambda i, c=config: fused_gemv.stream_gemv(attn, o_w[i], config=c), want_o,
             HIDDEN * o_k * 2),
        ):
            try:
                err = float((fn(0).float() - want).abs().max() / want.abs().max())
                us = per_call_us(fn, GEMV_COPIES)
            except Exception as exc:  # a shape this GPU rejects is a result, not the end
                print(f"{name} {config}: {type(exc).__name__}: {exc}")
                continue
            floor_us = nbytes / rate * 1e6
            rows.append({"gemv": name, "config": "heuristic" if config is None else
                         "/".join(map(str, config)), "us": us, "x_floor": us / floor_us,
                         "rel_err": err})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    rate = read_bandwidth()["read"]
    ops = xhal.platforms.get("cuda").ops
    rows = []
    for batch in args.batches:
        rows += router_rows(ops, batch, rate) + qk_rows(ops, batch, rate)
    print(table(gemv_rows(rate), "batch-1 GEMVs of the attention block per launch shape "
                "(block_n/block_k/split_k/warps/stages), per call over 8 distinct weights; "
                "rel_err against a float32 product"))
    print(table(rows, f"Qwen3-30B-A3B decode ops, bf16, per call ({COPIES} distinct copies per "
                      f"graph); floor = bytes / streaming read {rate / 1e12:.2f} TB/s; errors: "
                      "fused against the unfused sequence"))


if __name__ == "__main__":
    main()
