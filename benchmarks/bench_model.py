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
the largest batch also with ``XHAL_CUDA_TRITON_ACTIVATION=0``.

    python -m benchmarks.bench_model \\
        [--shape llama3-8b|llama3.2-1b] [--quick] [--no-hf | --hf-eager-only] [--profile]
        [--pdl off early late auto auto-torch-activation] [--trace]
"""

from __future__ import annotations

import argparse

import torch

import xhal
from benchmarks import pdl_variants
from benchmarks.common import (
    ceilings,
    cuda_kernel_events,
    environment,
    table,
    time_cuda,
    time_cuda_pipelined,
)
from benchmarks.host_timing import call_breakdown, host_breakdown, host_time_us, profile_host
from models.llama import LlamaForCausalLM
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces import AttentionMetadata, BatchKind

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SHAPES = {
    "llama3-8b": CONFIG,
    # Llama-3.2-1B: head dim 64, tied embeddings (the LM head reads the whole table every step)
    "llama3.2-1b": {
        **CONFIG,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
}


def head_dim(config: dict) -> int:
    return config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])


def decode_read_bytes(
    config: dict, weight_bytes: int, batch: int, ctx: int, elt: int = 2
) -> dict[str, int]:
    """Bytes one decode step reads: ``all`` (every weight + KV, the old floor's count) and
    ``honest`` (one embedding row per sequence rather than the table, unless the table is also the
    LM head, which reads all of it; K and V of ``ctx`` tokens per sequence)."""
    kv = (
        batch
        * ctx
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * head_dim(config)
        * 2
        * elt
    )
    table = config["vocab_size"] * config["hidden_size"] * elt
    rows = batch * config["hidden_size"] * elt
    embedding = 0 if config["tie_word_embeddings"] else table - rows
    return {"all": weight_bytes + kv, "honest": weight_bytes - embedding + kv}


BLOCK, CTX = 16, 2048


def random_model(device: torch.device, config: dict = CONFIG) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def decode_metadata(
    batch: int, ctx: int, device, vocab_size: int = CONFIG["vocab_size"]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``batch`` sequences with ``ctx - 1`` cached tokens each, decoding token ``ctx - 1``."""
    per_seq = ctx // BLOCK
    table_ = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    kv = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.ones(batch, dtype=torch.int32)
    slots = (table_[:, -1] * BLOCK + (ctx - 1) % BLOCK).int()
    meta = AttentionMetadata.from_host_lengths(
        BatchKind.DECODE, q, kv, table_.to(device), slots.to(device)
    )
    ids = torch.randint(0, vocab_size, (batch,), dtype=torch.int32, device=device)
    return ids, torch.full((batch,), ctx - 1, dtype=torch.int32, device=device), meta


def prefill_metadata(
    tokens: int, device, vocab_size: int = CONFIG["vocab_size"]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    blocks = -(-tokens // BLOCK)
    n = torch.tensor([tokens], dtype=torch.int32)
    meta = AttentionMetadata.from_host_lengths(
        BatchKind.PREFILL,
        n,
        n.clone(),
        torch.arange(blocks, dtype=torch.int32, device=device)[None],
        torch.arange(tokens, dtype=torch.int32, device=device),
    )
    ids = torch.randint(0, vocab_size, (tokens,), dtype=torch.int32, device=device)
    return ids, torch.arange(tokens, dtype=torch.int32, device=device), meta


def profile_kernels(
    step, title: str, iters: int = 5, num_layers: int | None = None
) -> tuple[float, float]:
    """Which kernels a step runs and their device time (CUPTI sees inside graph replays); returns
    (launches, device us) per step."""
    events = cuda_kernel_events(step, iters)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / iters
    launches = sum(e.count for e in events) / iters
    print(f"--- kernels per step, {title}: {launches:.0f} launches, {total:.0f} us of device time")
    if (
        num_layers
    ):  # the step's launches and device time per decoder layer (LM head and embedding included)
        print(f"    per layer: {launches / num_layers:.1f} launches, {total / num_layers:.1f} us")
    for e in events[:20]:
        print(
            f"  {e.count / iters:6.0f} x {e.self_device_time_total / e.count:8.2f} us = "
            f"{e.self_device_time_total / iters:8.1f} us  {e.key[:90]}"
        )
    return launches, total


def hf_decode_step(batch: int, ctx: int, device, config: dict = CONFIG, compiled: bool = False):
    """One decode step of transformers' LlamaForCausalLM (sdpa) at position ``ctx - 1`` over its
    ``StaticCache`` (prefilled with ``ctx - 1`` tokens): eager, or ``compiled`` with
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), the fast path transformers documents.
    Every call decodes position ``ctx - 1`` (newer transformers ignore ``cache_position`` and
    append: the cache has 64 spare slots for the timed calls; a static cache attends over all of
    its slots, masked, so each call does the same work). Returns a callable giving the logits."""
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=ctx + 64)
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx - 1), device=device)
    with torch.no_grad():
        hf(
            ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(ctx - 1, device=device),
        )
    nxt = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    position = torch.full((batch, 1), ctx - 1, device=device)
    cache_position = torch.tensor([ctx - 1], device=device)
    forward = (
        torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        if compiled
        else hf.forward
    )

    @torch.no_grad()
    def step() -> torch.Tensor:
        return forward(
            nxt,
            position_ids=position,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
        ).logits

    return step


def hf_decode_ms(batch: int, ctx: int, device, compiled: bool, config: dict = CONFIG) -> float:
    """Milliseconds per step issued back to back, as ``time_cuda_pipelined`` times xhal."""
    step = hf_decode_step(batch, ctx, device, config, compiled=compiled)
    for _ in range(3):  # compiles, then records the CUDA graphs
        step()
    ms = time_cuda_pipelined(step, steps=10, reps=3)
    del step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return ms


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
    num_blocks = max(batches) * CTX // BLOCK + 64
    executors = {}
    for eager in (False, True):
        cfg = ExecutorConfig(
            dtype=torch.bfloat16,
            block_size=BLOCK,
            max_num_seqs=max(batches),
            max_model_len=CTX + 64,
            enforce_eager=eager,
            decode_graph_sizes=tuple(batches),
        )
        executors[eager] = ModelExecutor(model, platform, cfg)
    caches = executors[False].allocate_kv_caches(num_blocks=num_blocks)
    for ex in executors.values():
        ex.bind_kv_caches(caches)
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
        hf_rows = []
        for r in rows:
            row = {"batch": r["batch"]}
            for compiled in (False, True):
                if compiled and args.hf_eager_only:
                    continue
                name = "hf_compiled" if compiled else "hf_eager"
                try:
                    ms = hf_decode_ms(r["batch"], CTX, device, compiled, config)
                except Exception as exc:  # a compile failure is a result to report, not a crash
                    print(
                        f"transformers {name} at batch {r['batch']} failed: {type(exc).__name__}: "
                        f"{exc}"
                    )
                    continue
                row.update(
                    {
                        f"{name}_ms": ms,
                        f"{name}_x_floor": ms / r["floor_ms"],
                        f"xhal_graph_speedup_vs_{name}": ms / r["pipelined_ms"],
                    }
                )
            hf_rows.append(row)
        print(
            table(
                hf_rows,
                "peer: Hugging Face transformers (sdpa, StaticCache; eager and torch.compile "
                "reduce-overhead), same shape; speedup = its step / xhal's pipelined graph step",
            )
        )


if __name__ == "__main__":
    main()
