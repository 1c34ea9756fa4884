"""Whole-model steps on the GPU for a Llama-3-shaped model (``--shape``: 8B or 3.2-1B) with random
bf16 weights: decode (graph and eager) against its floors, prefill against its FLOP floor, host time
inside ``execute``, and Hugging Face transformers on the same shape in the same run.

Two decode floors: ``floor_ms``, every weight plus the KV at the read+write copy rate (the figure
earlier runs reported, kept comparable), and ``read_floor_ms``, the bytes a step really reads (one
embedding row per sequence instead of the whole table, unless it is tied to the LM head; every
other weight; the KV) at the read-only streaming rate measured in the same run.

``--pdl off early late auto`` adds the same model's decode graphs captured once per programmatic
dependent launch setting (``XHAL_CUDA_PDL`` / ``XHAL_CUDA_PDL_TRIGGER``, ``pdl_variants.py``) to the
same process, timed one after the other against the same floor, with their kernels per layer;
``auto-torch-activation`` is ``auto`` with the gated activation as the float32 torch sequence
(``XHAL_CUDA_TRITON_ACTIVATION=0``), the peer of the Triton activation kernel. ``--trace`` prints
every kernel of an eager decode step by the module and op that launched it (``trace_ops.py``), at
the largest batch also with ``XHAL_CUDA_TRITON_ACTIVATION=0``. ``--kernels`` prints each
graph's kernels and what each adds to the step's critical path (``kernel_profile.critical_path``);
``--phase-clock`` the split-KV attention's phase clock at the smallest batch (``phase_clock.py``).

    python -m benchmarks.bench_model \\
        [--shape llama3-8b|llama3.2-1b] [--quick] [--no-hf | --hf-eager-only] [--profile]
        [--kernels] [--pdl off early late auto auto-torch-activation] [--trace] [--phase-clock]
"""

from __future__ import annotations

import argparse

import torch

import xhal
from benchmarks import pdl_variants, phase_clock
from benchmarks.common import (
    ceilings,
    environment,
    graph_and_eager_executors,
    table,
    time_cuda,
    time_cuda_pipelined,
)
from benchmarks.hf_peer import hf_peer_rows
from benchmarks.host_timing import call_breakdown, host_breakdown, host_time_us, profile_host
from benchmarks.kernel_profile import profile_kernels
from benchmarks.llama_model import (
    BLOCK,
    CTX,
    SHAPES,
    decode_metadata,
    decode_read_bytes,
    head_dim,
    prefill_metadata,
    random_model,
)
from benchmarks.llama_model import CONFIG as CONFIG  # bench_host_emulated.py imports it here
from xhal.executor import ExecutorConfig, ModelExecutor


def pdl_peers(
    model, platform, caches, variants: list[str], config: dict, rows: list[dict], kernels: bool,
    executor_config: ExecutorConfig,
) -> list[dict]:
    """The decode graphs captured and timed once per PDL variant, against the floors of ``rows``
    (the default executor's), in variant order per batch; ``kernels`` adds each one's profile.
    ``logits_vs_first``: the largest logit difference from the first variant's step (same
    inputs and caches), relative to its largest logit."""
    device = platform.device()
    executors = pdl_variants.capture_per_variant(model, platform, executor_config, caches, variants)
    out = []
    for row in rows:
        batch = row["batch"]
        ids, pos, meta = decode_metadata(batch, CTX, device, config["vocab_size"])
        first = None
        for name, ex in executors.items():
            step = lambda ex=ex: ex.compute_logits(ex.execute(ids, pos, meta))  # noqa: E731
            logits = step().float().clone()
            first = logits if first is None else first
            r = {
                "batch": batch,
                "pdl": name,
                "logits_vs_first": ((logits - first).abs().max() / first.abs().max()).item(),
                "graph_ms": time_cuda(step, iters=30, warmup=3),
            }
            r["pipelined_ms"] = time_cuda_pipelined(step)
            r["x_read_floor"] = r["pipelined_ms"] / row["read_floor_ms"]
            out.append(r)
    if kernels:  # after every timing (CUPTI slows later CUDA calls)
        layers = config["num_hidden_layers"]
        for r in out:
            ex = executors[r["pdl"]]
            ids, pos, meta = decode_metadata(r["batch"], CTX, device, config["vocab_size"])
            launches, us = profile_kernels(
                lambda ex=ex: ex.compute_logits(ex.execute(ids, pos, meta)),
                f"graph decode, batch {r['batch']}, PDL {r['pdl']}",
                num_layers=layers,
            )
            r["launches/layer"], r["device_us/layer"] = launches / layers, us / layers
    return out


def trace_eager(model, ex: ModelExecutor, batches: list[int], config: dict) -> None:
    """Each batch's eager decode step, kernel by kernel, by module and op; the largest batch
    again with the gated activation as the torch sequence (read per call: eager takes it)."""
    from benchmarks.trace_ops import print_kernels_by_op

    device = ex.platform.device()
    layers = config["num_hidden_layers"]
    torch_activation = {"XHAL_CUDA_TRITON_ACTIVATION": "0"}
    cases = [(b, {}) for b in batches] + [(max(batches), torch_activation)]
    for batch, settings in cases:
        ids, pos, meta = decode_metadata(batch, CTX, device, config["vocab_size"])
        with environment(settings):
            print_kernels_by_op(
                model,
                lambda: ex.compute_logits(ex.execute(ids, pos, meta)),
                f"eager decode, batch {batch}"
                + (", XHAL_CUDA_TRITON_ACTIVATION=0" if settings else ""),
                num_layers=layers,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama3-8b",
        help="model shape (default llama3-8b)",
    )
    parser.add_argument("--quick", action="store_true", help="batches 1 and 64 only")
    parser.add_argument(
        "--batches", type=int, nargs="+", help="decode batch sizes (default 1 16 64)"
    )
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument(
        "--hf-eager-only", action="store_true", help="skip torch.compile for transformers"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the host side of execute")
    parser.add_argument(
        "--kernels", action="store_true", help="only the per-step kernel profile of --profile"
    )
    parser.add_argument(
        "--trace", action="store_true", help="every kernel of an eager decode step by module and op"
    )
    phase_clock.add_argument(parser)
    pdl_variants.add_argument(parser)
    args = parser.parse_args()
    ceil = ceilings()
    platform = xhal.platforms.get("cuda")
    device = platform.device()
    config = SHAPES[args.shape]
    model = random_model(device, config)
    vocab = config["vocab_size"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batches = args.batches or ([1, 64] if args.quick else [1, 16, 64])
    executors, caches = graph_and_eager_executors(model, platform, batches, BLOCK, CTX)
    capture = executors[False].capture_graphs()
    print(
        f"decode graph capture: {capture['graphs']} buckets in {capture['seconds']:.1f} s, "
        f"{capture.get('memory_bytes', 0) / 2**20:.0f} MiB"
    )
    if (
        args.profile
    ):  # the same operations as bench_host, in this process (model, caches, graphs loaded)
        from benchmarks.bench_host import op_costs

        print(table(op_costs(), "--- host cost per operation, in the model's process"))
    rows = []
    for batch in batches:
        ids, pos, meta = decode_metadata(batch, CTX, device, vocab)
        read = decode_read_bytes(config, weight_bytes, batch, CTX)
        floor_ms = (
            read["all"] / ceil["bandwidth"] * 1e3
        )  # the old floor: all bytes at the copy rate
        read_floor_ms = (
            read["honest"] / ceil["read_bandwidth"] * 1e3
        )  # bytes really read / read rate
        row = {"batch": batch, "ctx": CTX, "floor_ms": floor_ms, "read_floor_ms": read_floor_ms}
        for eager, ex in executors.items():
            step = lambda ex=ex: ex.compute_logits(ex.execute(ids, pos, meta))  # noqa: E731
            ms = time_cuda(step, iters=30, warmup=3)
            row["eager_ms" if eager else "graph_ms"] = ms
            row["eager_x_floor" if eager else "graph_x_floor"] = ms / floor_ms
            if not eager:
                row["pipelined_ms"] = time_cuda_pipelined(step)
                row["pipelined_x_floor"] = row["pipelined_ms"] / floor_ms
                row["pipelined_x_read_floor"] = row["pipelined_ms"] / read_floor_ms
                # same page layout every step (as 15 of 16 steps at batch 1), then alternating
                # layouts, so the attention schedule is rebuilt every step (most steps at batch 64)
                row["host_us"] = host_time_us(ex, [(ids, pos, meta)])
                row["host_busy_us"] = host_time_us(ex, [(ids, pos, meta)], mode="busy")
                row["host_spun_us"] = host_time_us(ex, [(ids, pos, meta)], mode="spun")
                row["host_inflight_us"] = host_time_us(ex, [(ids, pos, meta)], mode="inflight")
                longer = decode_metadata(batch, CTX + BLOCK, device, vocab)
                row["host_replan_us"] = host_time_us(ex, [(ids, pos, meta), longer])
        row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
        rows.append(row)
    if args.pdl:  # the PDL peers, timed before any profile
        pdl_rows = pdl_peers(
            model, platform, caches, args.pdl, config, rows, args.kernels, executors[False].config
        )
    if args.phase_clock:
        ids, pos, meta = decode_metadata(batches[0], CTX, device, vocab)
        phase_clock.print_phase_clocks(
            model, platform, executors[False].config, caches, args.pdl,
            lambda ex: ex.compute_logits(ex.execute(ids, pos, meta)), f"batch {batches[0]}",
        )  # fmt: skip
    if args.profile:  # after every timing: once CUPTI has run in a process, CUDA calls cost more
        ex = executors[False]
        for batch in batches:
            ids, pos, meta = decode_metadata(batch, CTX, device, vocab)
            print(f"--- host profile, graph decode, batch {batch}")
            profile_host(ex, ids, pos, meta)
            for mode in ("idle", "busy", "spun"):
                parts = host_breakdown(ex, ids, pos, meta, mode=mode)
                print(f"--- host parts, graph decode, batch {batch}, entered {mode}: {parts}")
            print(
                table(
                    call_breakdown(ex, ids, pos, meta),
                    f"--- host us per step by call, graph decode, batch {batch}",
                )
            )
    if args.profile or (args.kernels and not args.pdl):  # --pdl profiles each of its graphs
        ex = executors[False]
        for batch in batches:
            ids, pos, meta = decode_metadata(batch, CTX, device, vocab)
            profile_kernels(
                lambda: ex.compute_logits(ex.execute(ids, pos, meta)),
                f"graph decode, batch {batch}",
                num_layers=config["num_hidden_layers"],
            )
    if args.trace:  # eager steps, after every timing
        trace_eager(model, executors[True], batches, config)
    print(
        table(
            rows,
            f"decode step (execute + logits), {args.shape} shape, bf16, {weight_bytes / 1e9:.2f} "
            f"GB weights; "
            "floor = (weights + KV) / copy rate, read_floor = (bytes really read) / read rate",
        )
    )
    if args.pdl:
        print(
            table(
                pdl_rows,
                f"decode graphs per PDL setting, {args.shape} shape, same process and floors "
                "(launches and device us per layer from the kernel profile, with --kernels)",
            )
        )
    tokens = 4096
    ids, pos, meta = prefill_metadata(tokens, device, vocab)
    ex = executors[True]
    ms = time_cuda(
        lambda: ex.compute_logits(
            ex.execute(ids, pos, meta), torch.tensor([tokens - 1], device=device)
        ),
        iters=10,
        warmup=2,
    )
    # every weight but the embedding (a tied table is the LM head: computed once, for the last row)
    linear_flops = 2 * tokens * (weight_bytes / 2 - vocab * config["hidden_size"])
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    attn_flops = (
        layers * 2 * tokens * tokens * head_dim(config) * heads
    )  # causal: half of 4 * L^2 * D * H per layer
    flops = linear_flops + attn_flops
    print(
        table(
            [
                {
                    "tokens": tokens,
                    "ms": ms,
                    "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                    "x_floor": ms / (flops / ceil["flops"] * 1e3),
                }
            ],
            "prefill, one 4K sequence (eager)",
        )
    )
    if not args.no_hf:
        del executors, caches, model
        torch.cuda.empty_cache()
        hf_rows = hf_peer_rows(rows, CTX, device, config, args.hf_eager_only)
        print(
            table(
                hf_rows,
                "peer: Hugging Face transformers (sdpa, StaticCache; eager and torch.compile "
                "reduce-overhead), same shape; speedup = its step / xhal's pipelined graph step",
            )
        )


if __name__ == "__main__":
    main()
