"""The peer of ``bench_model.py``: Hugging Face transformers' LlamaForCausalLM decoding on the same
shape in the same run, eager and under ``torch.compile`` (CUDA graphs)."""

from __future__ import annotations

import torch

from benchmarks.common import time_cuda_pipelined
from benchmarks.llama_model import CONFIG


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
    forward = (
        torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        if compiled
        else hf.forward
    )
    return prefilled_step(hf, cache, batch, ctx, device, forward)


def prefilled_step(hf, cache, batch: int, ctx: int, device, forward=None, chunk: int | None = None):
    """Fill ``cache`` (a transformers ``StaticCache`` of ``hf``) with ``ctx - 1`` random tokens of
    ``batch`` sequences, eagerly (in prefills of ``chunk`` tokens when given: a model whose eager
    path is memory-hungry), and return the decode step at position ``ctx - 1``: a callable giving
    the logits of ``forward`` (default ``hf``'s own). The callable holds ``hf`` and ``cache``."""
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (batch, ctx - 1), device=device)
    step_len = chunk or ctx - 1
    with torch.no_grad():
        for start in range(0, ctx - 1, step_len):
            part = ids[:, start : start + step_len]
            hf(
                part,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(start, start + part.shape[1], device=device),
            )
    nxt = torch.randint(0, vocab, (batch, 1), device=device)
    position = torch.full((batch, 1), ctx - 1, device=device)
    cache_position = torch.tensor([ctx - 1], device=device)
    forward = forward or hf

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


def hf_peer_rows(
    rows: list[dict], ctx: int, device, config: dict, eager_only: bool
) -> list[dict]:
    """transformers' decode step at each batch of ``rows`` (xhal's rows, with their
    ``floor_ms`` and ``pipelined_ms``), against the same floor and as a speedup of xhal's
    pipelined graph step over it."""
    hf_rows = []
    for r in rows:
        row = {"batch": r["batch"]}
        for compiled in (False, True):
            if compiled and eager_only:
                continue
            name = "hf_compiled" if compiled else "hf_eager"
            try:
                ms = hf_decode_ms(r["batch"], ctx, device, compiled, config)
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
    return hf_rows
