"""A Qwen3-30B-A3B-shaped layer's o projection and router on the GPU: the route entry of
``gemv_stream.cu`` (``DeviceOps.linear_add_rms_norm_moe_route``: one launch) against the o
stream GEMV followed by the fused norm + router + top-k (two launches), each in a CUDA graph of
``LAYERS`` calls on distinct weights and inputs, with programmatic dependent launch as a decode
graph has it; then the route's phase marks in its last call.

Checked first, on the same inputs: the new residual (bitwise: o is the same sum, rounded the same
way), the normed row and the logits (the route feeds the router the normed row unrounded), and
the experts picked. Floor: o's and the router's bytes over the streaming-read rate.

    python -m benchmarks.bench_o_route
"""

from __future__ import annotations

import torch

from benchmarks.common import read_bandwidth, table, time_graph
from xhal.platforms.cuda import native
from xhal.platforms.cuda.kernels import gemv_stream, moe_router

HIDDEN, HEADS_DIM, EXPERTS, TOP_K = 2048, 32 * 128, 128, 8
LAYERS = 48  # 48 o projections of 16 MB: past L2, as in a step
BF16 = torch.bfloat16
MARKS = ("started", "waited", "streamed", "partials stored", "counted", "normed", "routed")


def _inputs(device):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=g).mul_(scale).to(BF16)

    return [
        dict(
            x=randn(1, HEADS_DIM),
            weight=randn(HIDDEN, HEADS_DIM, scale=HEADS_DIM**-0.5),
            residual=randn(1, HIDDEN),
            norm_weight=randn(HIDDEN, scale=0.1).add_(1.0),
            gate=randn(EXPERTS, HIDDEN, scale=HIDDEN**-0.5),
        )
        for _ in range(LAYERS)
    ]


def main() -> None:
    device = torch.device("cuda")
    kernels = gemv_stream.GemvStream(device)
    layers = _inputs(device)
    beside = gemv_stream.fits_beside(layers[0]["x"])

    def apart(t, early=beside):
        o, _ = kernels(t["x"], t["weight"], True, beside=early, early=early)
        return moe_router.add_rms_norm_route(
            o, t["residual"], t["norm_weight"], 1e-6, t["gate"], TOP_K, True, use_pdl=1
        )

    def fused(t, early=beside, timing=None):
        return kernels.route(
            t["x"], t["weight"], t["residual"], t["norm_weight"], 1e-6, t["gate"], TOP_K, True,
            True, beside=early, timing=timing,
        )  # fmt: skip

    want, got = apart(layers[0]), fused(layers[0])
    assert got is not None, "the route entry declined the Qwen3-30B-A3B shape"
    torch.cuda.synchronize()
    checks = {
        "summed bitwise equal": bool(torch.equal(got[2], want[2])),
        "normed max |diff|": float((got[1].float() - want[1].float()).abs().max()),
        "logits max |diff|": float((got[0].float() - want[0].float()).abs().max()),
        "same experts": bool(torch.equal(got[4].sort().values, want[4].sort().values)),
        "weights max |diff|": float((got[3] - want[3]).abs().max()),
    }
    print("checks (layer 0):", checks)

    rate = read_bandwidth()["read"]
    t0 = layers[0]
    bytes_per_call = sum(t0[k].numel() * 2 for k in ("weight", "gate", "x", "residual"))
    floor_us = bytes_per_call / rate * 1e6
    rows = []
    for name, fn in [
        ("o, then router", lambda: [apart(t) for t in layers]),
        ("route (one launch)", lambda: [fused(t) for t in layers]),
        ("o, then router, o not beside", lambda: [apart(t, False) for t in layers]),
        ("route, not beside", lambda: [fused(t, False) for t in layers]),
    ]:
        us = time_graph(fn, iters=20) * 1e3 / LAYERS
        rows.append({"variant": name, "us/call": round(us, 2), "x floor": round(us / floor_us, 2)})
    megabytes, tbps = bytes_per_call / 1e6, rate / 1e12
    print(table(rows, f"per call: floor {floor_us:.2f} us ({megabytes:.1f} MB at {tbps:.2f} TB/s)"))

    launch = gemv_stream.route_launch(
        HEADS_DIM, HIDDEN, EXPERTS, TOP_K, True, True, True, beside,
        torch.cuda.get_device_properties(device).multi_processor_count,
        native.max_shared_mem(device),
    )  # fmt: skip
    print(f"route launch: {launch}")
    ctas = launch.ctas
    timing = torch.zeros(ctas, 8, dtype=torch.int64, device=device)
    fused(layers[0], timing=timing)  # builds the clocked kernel eagerly
    time_graph(lambda: [fused(t, timing=timing) for t in layers], iters=3)
    stamps = timing.cpu().double()
    start = stamps[:, 0].min()
    marks = []
    for i, mark in enumerate(MARKS):
        reached = stamps[:, i] > 0
        if not reached.any():
            continue
        t = (stamps[reached, i] - start) / 1e3
        median, latest = round(float(t.median()), 2), round(float(t.max()), 2)
        marks.append(
            {"mark": mark, "CTAs": int(reached.sum()), "median us": median, "latest us": latest}
        )
    print(table(marks, "route phases, the last call of a replay, us from the earliest CTA's start"))


if __name__ == "__main__":
    main()
