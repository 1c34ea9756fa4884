"""Decode steps of a Qwen3-30B-A3B-shaped mixture of experts with random bf16 weights (48 layers,
128 experts, top-8, hidden 2048, expert intermediate 768, 32 / 4 heads of 128) on the GPU, graph
and eager, against the step's honest floor, and transformers on the same shape in the same run.

The floor is the bytes the step must read over the streaming-read rate measured here: the experts
the step's tokens actually route to (counted per layer from the same inputs' router logits), the
attention and router weights, the LM head and one embedding row per token, and the KV cache.

    python -m benchmarks.bench_moe [--batches 1 16 64] [--layers 48] [--hf-batches 1] [--no-hf]
                                   [--sweep-batches 1 2 4 8 16] [--no-sweep] [--profile]
                                   [--pdl off early late auto] [--pdl-batches 1] [--check]
                                   [--phase-clock]

``--profile`` prints each graph's kernels and what each adds to the step's critical path
(``kernel_profile.critical_path``); ``--phase-clock`` the split-KV attention's and the router's
phase clocks at the smallest batch (``phase_clock.py``). ``--pdl`` adds the decode graphs
captured once per programmatic dependent launch setting (``pdl_variants.py``), timed in the same
process against the same floors, at every batch or at ``--pdl-batches``. ``--check`` first runs
``check_moe_small``: the batch-1 router and pair-GEMV chain per PDL setting of the pair GEMVs,
against float64 and timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

import xhal
from benchmarks import pdl_variants, phase_clock
from benchmarks.bench_model import decode_metadata
from benchmarks.common import (
    ceilings,
    graph_and_eager_executors,
    table,
    time_cuda,
    time_cuda_pipelined,
    time_graph,
)
from benchmarks.hf_peer import prefilled_step
from benchmarks.kernel_profile import profile_kernels
from models import load_model
from xhal.executor import ModelExecutor

CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
)
BLOCK, CTX = 16, 2048
BF16 = 2  # bytes


def build_model(config: dict, device: torch.device):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return load_model(
            tmp, dtype=torch.bfloat16, device=device, load_format="dummy", progress=False
        )


def routed_experts(model, executor: ModelExecutor, ids, pos, meta) -> list[int]:
    """The number of distinct experts each layer's tokens route to in this step (eager run)."""
    counts: list[int] = []
    hooks = []
    for layer in model.model.layers:
        moe = layer.mlp.experts

        def record(module, args, out, moe=moe) -> None:
            # the router's fused path returns a Routing, its logits first
            logits = out[0] if isinstance(out, tuple) else out
            _, chosen = xhal.ops.moe_route(logits, moe.top_k, moe.renormalize)
            counts.append(int(torch.unique(chosen).numel()))

        hooks.append(layer.mlp.gate.register_forward_hook(record))
    try:
        executor.execute(ids, pos, meta)
    finally:
        for h in hooks:
            h.remove()
    return counts


def floor_bytes(config: dict, batch: int, experts_per_layer: list[int]) -> dict[str, int]:
    hidden, heads, kv_heads, dim = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    layers, inter, num_experts = (
        config["num_hidden_layers"],
        config["moe_intermediate_size"],
        config["num_experts"],
    )
    expert = 3 * hidden * inter * BF16
    attention = (
        hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 2 * dim + 2 * hidden
    ) * BF16
    router = num_experts * hidden * BF16
    return {
        "experts": expert * sum(experts_per_layer),
        "attention+router": layers * (attention + router),
        "lm_head+embed": config["vocab_size"] * hidden * BF16
        + batch * hidden * BF16
        + hidden * BF16,
        "kv": batch * CTX * layers * kv_heads * dim * 2 * BF16,
    }


SWEEP = [(16, 32, 128), (16, 64, 64), (16, 64, 128), (32, 64, 64), (64, 64, 64)]  # (M, N, K) tiles
# the small path's alternatives to its heuristic: (up rows, up K, down rows, down K, warps, up /
# down stages)
SMALL_SWEEP = [
    (8, 512, 8, 256, 4, 3, 5),
    (16, 256, 16, 256, 4, 3, 5),
    (8, 512, 8, 512, 4, 3, 3),
    (4, 512, 4, 256, 4, 4, 8),
    (16, 512, 16, 256, 8, 3, 5),
    (4, 1024, 8, 256, 4, 2, 8),
    (8, 1024, 8, 256, 8, 2, 8),
    (4, 512, 4, 128, 4, 4, 12),
    (8, 256, 8, 128, 4, 6, 12),
    (2, 1024, 8, 256, 4, 2, 8),
    (16, 256, 8, 256, 8, 6, 8),
]
# distinct layers per timed graph: their routed experts (300+ MB) overflow L2 as in a real step
SWEEP_LAYERS = 4


def sweep_layers(model, batches: list[int], rate: float) -> list[dict]:
    """Per-layer time of the routed experts (``fused_experts``, graph-captured over
    ``SWEEP_LAYERS`` layers, each with its own routing), grouped GEMM per tile and the pair-GEMV
    path per config, at each batch, against the bytes of the experts the batch routes to."""
    from triton.runtime.errors import OutOfResources

    from xhal.platforms.cuda.kernels import moe as kernels
    from xhal.platforms.cuda.kernels import moe_small

    layers = [layer.mlp for layer in model.model.layers[:SWEEP_LAYERS]]
    w13 = layers[0].experts.w13_weight
    per_expert = (w13[0].numel() + layers[0].experts.w2_weight[0].numel()) * w13.element_size()
    rows = []
    for batch in batches:
        g = torch.Generator(device=w13.device).manual_seed(batch)
        x = torch.randn(batch, w13.shape[2], device=w13.device, dtype=w13.dtype, generator=g)
        routed = [
            kernels.route(mlp.gate(x), mlp.experts.top_k, mlp.experts.renormalize) for mlp in layers
        ]
        distinct = sum(int(torch.unique(ids).numel()) for _, ids in routed) / len(layers)
        floor_us = distinct * per_expert / rate * 1e6

        def per_layer_us(config) -> float:
            def step() -> None:
                for mlp, (weights, ids) in zip(layers, routed):
                    kernels.fused_experts(
                        x, mlp.experts.w13_weight, mlp.experts.w2_weight, weights, ids, config
                    )

            try:
                return time_graph(step) * 1e3 / len(layers)
            except (
                OutOfResources
            ) as exc:  # a config too big for this GPU is a result, not the end of the run
                print(f"batch {batch}: {config} does not fit: {exc}")
                return float("inf")

        grouped = {f"{m}x{n}x{k}": per_layer_us(kernels.MoeConfig(m, n, k)) for m, n, k in SWEEP}
        small = {"heuristic": per_layer_us(moe_small.small_config(batch, w13.shape[2]))}
        small |= {
            "/".join(map(str, c)): per_layer_us(moe_small.SmallMoeConfig(*c)) for c in SMALL_SWEEP
        }
        default_us = per_layer_us(None)
        best_g, best_s = min(grouped, key=grouped.get), min(small, key=small.get)
        top_k = layers[0].experts.top_k
        pairs = batch * top_k
        rows.append(
            {
                "batch": batch,
                "experts": distinct,
                "floor_us": floor_us,
                "grouped_default_us": per_layer_us(kernels.default_config(pairs, w13.shape[0])),
                "grouped_best_us": grouped[best_g],
                "grouped_best": best_g,
                "small_heuristic_us": small["heuristic"],
                "small_best_us": small[best_s],
                "small_best": best_s,
                "chosen": "small"
                if moe_small.use_small_path(batch, top_k, w13.shape[0])
                else "grouped",
                "chosen_us": default_us,
                "chosen_x_floor": default_us / floor_us,
            }
        )
        print(
            f"batch {batch}: grouped "
            + ", ".join(f"{k} {v:.1f}" for k, v in grouped.items())
            + " us; small "
            + ", ".join(f"{k} {v:.1f}" for k, v in small.items())
            + " us"
        )
    return rows


def hf_decode_ms(config: dict, batch: int, device) -> float:
    """transformers' Qwen3MoeForCausalLM (sdpa, StaticCache prefilled with CTX - 1 tokens), one
    eager decode step issued back to back (its experts loop syncs with the host, so no graphs)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    cache = transformers.StaticCache(config=cfg, max_cache_len=CTX + 64)
    # prefill in chunks: the eager experts loop is memory-hungry
    step = prefilled_step(hf, cache, batch, CTX, device, chunk=512)
    ms = time_cuda_pipelined(step, steps=5, reps=3)
    step = hf = cache = None  # the step holds the model and its cache: all freed here
    torch.cuda.empty_cache()
    return ms


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layers", type=int, default=48, help="fewer layers to fit a time budget")
    parser.add_argument(
        "--hf-batches", type=int, nargs="*", default=[1], help="transformers' batches"
    )
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-sweep", action="store_true", help="skip the expert path / tile sweep")
    parser.add_argument(
        "--sweep-batches",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="batches of the expert sweep (grouped GEMM tiles against the pair-GEMV path)",
    )
    parser.add_argument("--profile", action="store_true", help="kernels per graph step, per batch")
    parser.add_argument(
        "--pdl-batches", type=int, nargs="+", help="batches of the --pdl graphs (default: all)"
    )
    parser.add_argument(
        "--check", action="store_true", help="the pair GEMVs' PDL settings against float64 first"
    )
    phase_clock.add_argument(parser)
    pdl_variants.add_argument(parser)
    args = parser.parse_args()
    config = {**CONFIG, "num_hidden_layers": args.layers}
    ceil = ceilings()
    rate = ceil["read_bandwidth"]
    platform = xhal.platforms.get("cuda")
    device = platform.device()
    model = build_model(config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {args.layers} layers, {weight_bytes / 1e9:.1f} GB of bf16 weights")
    if args.check:
        from benchmarks.check_moe_small import LAYERS, check_small_experts

        checked, phases = check_small_experts(model, rate)
        print(table(checked, f"batch-1 router + experts, {LAYERS} layers chained in one graph, "
                             "per PDL setting of the pair GEMVs (gate-up / down trigger) or "
                             "layout of the persistent block: "
                             "rel_err against float64, outputs against the plain kernels'"))
        print(table(phases, "the persistent block in that chain, each CTA's clock at its phase "
                            "boundaries (the last layer's launch), from the earliest start"))
    batches = sorted(args.batches)
    executors, caches = graph_and_eager_executors(model, platform, batches, BLOCK, CTX)
    capture = executors[False].capture_graphs(progress=False)
    print(f"decode graph capture: {capture['graphs']} buckets in {capture['seconds']:.1f} s")
    peer_batches = sorted(args.pdl_batches or batches)
    peer_config = dataclasses.replace(
        executors[False].config, decode_graph_sizes=tuple(peer_batches)
    )
    peers = pdl_variants.capture_per_variant(model, platform, peer_config, caches, args.pdl)
    rows, pdl_rows = [], []
    for batch in batches:
        ids, pos, meta = decode_metadata(batch, CTX, device)
        per_layer = routed_experts(model, executors[True], ids, pos, meta)
        parts = floor_bytes(config, batch, per_layer)
        floor_ms = sum(parts.values()) / rate * 1e3
        row = {
            "batch": batch,
            "experts/layer": sum(per_layer) / len(per_layer),
            "floor_GB": sum(parts.values()) / 1e9,
            "floor_ms": floor_ms,
        }
        for eager, ex in executors.items():

            def step(ex=ex):
                return ex.compute_logits(ex.execute(ids, pos, meta))

            ms = time_cuda(step, iters=10 if eager else 30, warmup=2)
            key = "eager" if eager else "graph"
            row[f"{key}_ms"], row[f"{key}_x_floor"] = ms, ms / floor_ms
            if not eager:
                row["pipelined_ms"] = time_cuda_pipelined(step, steps=10, reps=3)
                row["pipelined_x_floor"] = row["pipelined_ms"] / floor_ms
        row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
        timed = []
        if peers and batch in peer_batches:
            graph = executors[False]
            mine = graph.compute_logits(graph.execute(ids, pos, meta)).double()
        for name, peer in peers.items() if batch in peer_batches else ():
            step = lambda peer=peer: peer.compute_logits(peer.execute(ids, pos, meta))  # noqa: E731
            # the peer's logits against the default graph's: a kernel that computes the same
            # function differs by rounding only (with random weights a rounding may flip a
            # near-tied expert choice, and the logits then differ a lot)
            first = step().double()
            r = {"batch": batch, "pdl": name, "logits_rel_diff": rel_diff(first, mine)}
            r["graph_ms"] = time_cuda(step, iters=30, warmup=2)
            r["pipelined_ms"] = time_cuda_pipelined(step, steps=10, reps=3)
            r["pipelined_x_floor"] = r["pipelined_ms"] / floor_ms
            # the same inputs again after 80-odd replays: the decode kernels sum in a fixed
            # order, so anything but 0 means a race (a read ahead of the write it depends on) or
            # a kernel whose order varies
            r["replay_diff"] = rel_diff(step().double(), first)
            timed.append((r, step))
        if timed:
            again = graph.compute_logits(graph.execute(ids, pos, meta)).double()
            print(f"batch {batch}: the default graph replayed after its peers, logits rel. diff "
                  f"{rel_diff(again, mine):.3g} (0 unless a race or a varying order)")  # fmt: skip
        for r, step in timed if args.profile else ():  # after this batch's timings
            launches, us = profile_kernels(
                step, f"batch {batch}, PDL {r['pdl']}", num_layers=args.layers
            )
            r["launches/layer"], r["device_us/layer"] = launches / args.layers, us / args.layers
        pdl_rows += [r for r, _ in timed]
        if args.profile and not timed:  # --pdl profiles each of its graphs instead
            graph = executors[False]
            profile_kernels(
                lambda: graph.compute_logits(graph.execute(ids, pos, meta)),
                f"batch {batch}",
                num_layers=args.layers,
            )
        rows.append(row)
        print(
            f"batch {batch}: floor parts (GB) "
            + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items())
        )
        # as it goes, so that a run cut by its time limit keeps the batches it finished
        print(
            f"batch {batch}: floor {floor_ms:.3f} ms, graph {row['graph_ms']:.3f}, pipelined "
            f"{row['pipelined_ms']:.3f} ({row['pipelined_x_floor']:.2f}x); "
            + ", ".join(f"{r['pdl']} {r['pipelined_ms']:.3f}" for r, _ in timed)
        )
    if args.phase_clock:
        ids, pos, meta = decode_metadata(batches[0], CTX, device)
        phase_clock.print_phase_clocks(
            model, platform, executors[False].config, caches, args.pdl,
            lambda ex: ex.compute_logits(ex.execute(ids, pos, meta)), f"batch {batches[0]}",
        )  # fmt: skip
    sweep = [] if args.no_sweep else sweep_layers(model, sorted(args.sweep_batches), rate)
    hf_rows = []
    if not args.no_hf and args.hf_batches:
        del executors, caches, model
        torch.cuda.empty_cache()
        for batch in args.hf_batches:
            mine = next((r for r in rows if r["batch"] == batch), None)
            try:
                ms = hf_decode_ms(config, batch, device)
            except Exception as exc:  # an out-of-memory or API failure is a result to report
                print(f"transformers at batch {batch} failed: {type(exc).__name__}: {exc}")
                continue
            row = {"batch": batch, "hf_eager_ms": ms}
            if mine:
                row.update(
                    {"hf_x_floor": ms / mine["floor_ms"], "xhal_speedup": ms / mine["pipelined_ms"]}
                )
            hf_rows.append(row)
    title = (
        f"decode step (execute + logits), Qwen3-30B-A3B shape ({args.layers} layers), bf16, ctx "
        f"{CTX}; "
        f"floor = (routed experts + attention/router + LM head + KV bytes) / streaming read "
        f"{rate / 1e12:.2f} TB/s"
    )
    if sweep:
        print(
            table(
                sweep,
                f"routed experts per layer (fused_experts graph-captured over {SWEEP_LAYERS} "
                f"layers), "
                "us: grouped GEMM (best tile M x N x K) against the pair-GEMV path (best config); "
                "chosen = fused_experts' own pick; floor = bytes of the experts routed to / "
                "streaming read",
            )
        )
    if hf_rows:
        print(
            table(
                hf_rows,
                "peer: transformers Qwen3MoeForCausalLM (sdpa, StaticCache, eager), same shape; "
                "xhal_speedup = its step / xhal's pipelined graph step",
            )
        )
    print(table(rows, title))
    if pdl_rows:
        print(table(pdl_rows, "decode graphs per PDL setting, same process and floors as above"))


if __name__ == "__main__":
    main()
