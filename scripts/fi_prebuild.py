"""Compile FlashInfer's JIT modules (and warm Triton's cache) for every attention configuration the
conformance suite and the benchmarks use, in parallel processes, before they run.

FlashInfer compiles a module on first use (~30 s for decode, ~70 s for prefill on the H200 host)
and the suite meets two dozen of them one after another. Each job here runs one real step through
xhal's backend, so exactly the modules the tests will load get built (into
FLASHINFER_WORKSPACE_BASE). ``gpu_run.sh pack`` then bundles the built libraries so a later,
fresh machine loads them instead of compiling (see gpu_run.sh).

    python3 scripts/fi_prebuild.py [--workers 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES = {"plain": {}, "window": {"sliding_window": 8}, "soft_cap": {"logits_soft_cap": 2.0},
            "window_soft_cap": {"sliding_window": 8, "logits_soft_cap": 2.0}}


def jobs() -> list[tuple]:
    """(dtype, head_dim, gqa group, feature, kind): decode per group (CUDA-core for 1, tensor-core
    for 4), prefill once (one module serves prefill, chunked and mixed)."""
    prefill, decode = [], []
    for dtype in ("bfloat16", "float16"):
        for head_dim in (64, 128):
            decode += [
                (dtype, head_dim, 1, "plain", "DECODE"),
                (dtype, head_dim, 4, "plain", "DECODE"),
            ]
            prefill.append((dtype, head_dim, 4, "plain", "PREFILL"))
        for feature in ("window", "soft_cap", "window_soft_cap"):
            decode.append((dtype, 128, 4, feature, "DECODE"))
            prefill.append((dtype, 128, 4, feature, "PREFILL"))
    return prefill + decode + [("ops",)]  # the slowest builds first, so the tail is short


def run_job(job: tuple) -> tuple[tuple, float, str]:
    start = time.perf_counter()
    sys.path.insert(0, ROOT)
    try:
        import random

        import torch

        import xhal
        from xhal.interfaces import AttentionSpec, BatchKind

        platform = xhal.platforms.get("cuda")
        device = platform.device()
        if job[0] == "ops":
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(4, 256, dtype=dtype, device=device)
                w = torch.ones(256, dtype=dtype, device=device)
                platform.ops.rms_norm(x, w, 1e-5)
                platform.ops.fused_add_rms_norm(x, x, w, 1e-5)
                platform.ops.silu_and_mul(x)
                platform.ops.gelu_and_mul(x, "tanh")
                platform.ops.gelu_and_mul(x, "none")
                q = x.view(4, 4, 64)
                platform.ops.rotary_embedding(
                    torch.arange(4, device=device), q, q, torch.randn(8, 64, device=device), True
                )
        else:
            from conformance_tests.batches import random_batch, random_caches, random_qkv

            dtype, head_dim, group, feature, kind = job
            spec = AttentionSpec(
                num_heads=2 * group,
                num_kv_heads=2,
                head_dim=head_dim,
                dtype=getattr(torch, dtype),
                block_size=16,
                **FEATURES[feature],
            )
            rng = random.Random(0)
            batch, num_blocks = random_batch(BatchKind[kind], 16, device, rng)
            backend = platform.attention_backend(spec)
            backend.bind_kv_caches(random_caches(1, num_blocks, spec, device, rng))
            backend.plan(batch.metadata)
            backend.forward(0, *random_qkv(batch.metadata.num_tokens, spec, device, rng))
        torch.cuda.synchronize()
        return job, time.perf_counter() - start, "ok"
    except Exception as exc:  # reported, not fatal: the suite will show the same failure
        return job, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args()
    # each build's ninja; the jobs run side by side (16 x 4 nvcc at once thrashed the host once)
    os.environ["MAX_JOBS"] = os.environ.get("PREBUILD_MAX_JOBS", "2")
    todo, start, failed = jobs(), time.perf_counter(), 0
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        for future in concurrent.futures.as_completed([pool.submit(run_job, job) for job in todo]):
            job, seconds, status = future.result()
            failed += status != "ok"
            print(
                f"  {time.perf_counter() - start:5.0f} s  {'/'.join(map(str, job)):<36} "
                f"{seconds:6.1f} s  {status}",
                flush=True,
            )
    print(
        f"prebuilt {len(todo) - failed}/{len(todo)} configurations in "
        f"{time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
