"""The kernels a platform chooses, checked against the choices made before kernel solutions
existed (``--expect-legacy``), and the host cost solutions add to a call. Prints a short table.

    python3 scripts/check_solutions.py --device cuda --expect-legacy
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# what xhal/platforms/cuda/ops.py and platform.py picked by hand before solutions (FlashInfer
# installed)
LEGACY = {
    "cuda": {
        "linear": "triton",
        "rms_norm": "flashinfer",
        "fused_add_rms_norm": "triton",
        "rotary_embedding": "triton",
        # since: our Triton gated activations, measured faster than FlashInfer's
        "silu_and_mul": "triton",
        "gelu_and_mul": "triton",
        "moe_route": "triton",
        "moe_experts": "triton",
        "sampling": "torch",
        # decode since: small buckets on the split-KV Triton kernel, FlashInfer beyond
        "attention bfloat16": "flashinfer+triton-splitkv",
        "attention float16": "flashinfer+triton-splitkv",
        "attention float32": "triton",
    },
    "cuda-triton": {
        "linear": "triton",
        "rms_norm": "torch",
        "fused_add_rms_norm": "triton",
        "rotary_embedding": "triton",
        "silu_and_mul": "torch",
        "gelu_and_mul": "torch",
        "moe_route": "triton",
        "moe_experts": "triton",
        "sampling": "torch",
        "attention bfloat16": "triton",
        "attention float16": "triton",
        "attention float32": "triton",
    },
}


def chosen(platform) -> dict[str, str]:
    from xhal.interfaces import AttentionSpec

    kernels = platform.kernels
    out = dict(kernels.ops.names)
    for dtype in platform.capabilities.attention.dtypes:
        spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, block_size=16)
        names = {
            kernels.attention_solution(op, spec).name
            for op in ("paged_decode_attention", "paged_prefill_attention")
        }
        out[f"attention {str(dtype).removeprefix('torch.')}"] = "+".join(sorted(names))
    return out


def call_overhead_us(platform, direct, calls: int = 2000, rounds: int = 7) -> tuple[float, float]:
    """Host microseconds per ``fused_add_rms_norm`` call: through the chosen solution, and the
    implementation called directly (the difference is what solutions add). The best of
    ``rounds`` interleaved rounds, so a busy host does not decide it."""
    dev = platform.device()
    x, r, w = (
        torch.randn(1, 64, device=dev),
        torch.randn(1, 64, device=dev),
        torch.ones(64, device=dev),
    )
    best = [float("inf"), float("inf")]
    fns = (platform.ops.fused_add_rms_norm, direct)
    for fn in fns:
        for _ in range(200):
            fn(x, r, w, 1e-6)
    for round_ in range(rounds):
        order = (0, 1) if round_ % 2 == 0 else (1, 0)  # neither always runs first
        for i in order:
            fn = fns[i]
            platform.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn(x, r, w, 1e-6)
            platform.synchronize()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best[0], best[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--expect-legacy",
        action="store_true",
        help="fail unless the choices are the pre-solution ones",
    )
    args = parser.parse_args()
    import xhal

    platform = xhal.platforms.get(args.device)
    got = chosen(platform)
    expected = LEGACY.get(args.device, {}) if args.expect_legacy else {}
    print(f"kernels of {args.device} ({platform.kernels.device.name})")
    print(f"{'op':<22} {'chosen':<16} {'expected':<12}")
    bad = []
    for op, name in got.items():
        want = expected.get(op, "-")
        mark = "" if want in ("-", name) else "  <-- differs"
        bad += [op] if mark else []
        print(f"{op:<22} {name:<16} {want:<12}{mark}")
    impl = platform.kernels.ops.impls["fused_add_rms_norm"]
    via, direct = call_overhead_us(platform, impl)
    print(
        f"fused_add_rms_norm host time per call: {via:.2f} us through solutions, {direct:.2f} us "
        f"direct "
        f"(+{via - direct:.2f} us)"
    )
    if bad:
        print(f"FAILED: {', '.join(bad)} differ from the pre-solution choices")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
