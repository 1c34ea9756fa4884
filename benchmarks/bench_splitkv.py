"""Split-KV Triton decode (``kernels/splitkv_decode.py``) against FlashInfer's decode and the old
one-program-per-token Triton kernel, on the GPU, in one run:

1. correctness: every backend's output against a float64 reference (ragged and 2K contexts,
   strided q), and the split-KV graph replayed again after its timing with new queries written
   in place (a counter left above 0 by any earlier replay would break it);
2. per-layer time of a decode layer (KV write + attention) inside a CUDA graph of ``L`` layers,
   each layer with its own cache so the graph streams ``L`` x the KV bytes past L2, against the
   read floor (KV + q + out bytes over the read ceiling measured in this run) and FlashInfer;
3. a sweep of split counts and launch shapes at the small batches, which the split rule in
   ``kernels/splitkv_decode.py`` and the bucket rule in ``solutions.py`` come from.

    python -m benchmarks.bench_splitkv [--batches 1 4 16 64] [--no-sweep]

Shapes (bf16, pages of 16, ctx 2048): Llama-3-8B attention (32 q / 8 kv heads, D=128), the
Qwen3-30B-A3B MoE's (32 / 4, D=128), Llama-3.2-1B's (32 / 8, D=64).
"""

from __future__ import annotations

import argparse
import time

import torch

import xhal
from benchmarks.bench_attention_solutions import make_decode, reference
from benchmarks.common import capture_graph, read_bandwidth, table, time_cuda, time_graph
from xhal.interfaces import AttentionSpec, LayerCache

SHAPES = {"8b": (32, 8, 128), "moe": (32, 4, 128), "1b": (32, 8, 64)}
CTX, PAGE = 2048, 16
DTYPE = torch.bfloat16


def _backends(spec: AttentionSpec) -> dict[str, object]:
    from xhal.platforms.cuda.triton_attention import TritonAttention

    out = {"splitkv": xhal.platforms.get("cuda-triton").attention_backend(spec)}
    cuda = xhal.platforms.get("cuda")
    if any(s.name == "flashinfer" and cuda.kernels.unmet(s, DTYPE) is None
           for s in cuda.kernels.solutions("paged_decode_attention")):  # fmt: skip
        with cuda.kernels.forcing("paged_decode_attention", "flashinfer"):
            out["flashinfer"] = cuda.attention_backend(spec)
    out["triton-per-token"] = TritonAttention(spec)
    return out


class Layers:
    """``num_layers`` decode layers of one shape: own caches, one metadata, strided q/k/v."""

    def __init__(self, spec: AttentionSpec, batch: int, num_layers: int, lens: list[int]):
        self.spec, self.batch = spec, batch
        num_blocks = sum(-(-n // PAGE) for n in lens) + 8
        shape = (num_blocks, PAGE, spec.num_kv_heads, spec.head_dim)
        self.caches = [
            LayerCache(torch.randn(shape, dtype=DTYPE, device="cuda"),
                       torch.randn(shape, dtype=DTYPE, device="cuda"))
            for _ in range(num_layers)
        ]  # fmt: skip
        self.meta = make_decode(lens, PAGE, num_blocks, torch.device("cuda"))
        h, hkv = spec.num_heads, spec.num_kv_heads
        self.qkv = torch.randn(batch, h + 2 * hkv, spec.head_dim, dtype=DTYPE, device="cuda")
        self.q, self.k, self.v = self.qkv.split([h, hkv, hkv], dim=1)
        self.out: torch.Tensor | None = None

    def run(self, backend) -> torch.Tensor:
        for layer in range(len(self.caches)):
            self.out = backend.forward(layer, self.q, self.k, self.v)
        return self.out

    def error(self) -> float:
        # layer L-1's output: its cache now holds the new key too, which the reference reads
        ref = reference(self.q, self.caches[-1], self.meta, self.spec.softmax_scale)
        return (self.out.double().cpu() - ref).abs().max().item()


def _layers_for(kv_bytes: int) -> int:
    """Enough layers that the graph streams >= 256 MB (past the 60 MB L2), 2 at least."""
    return max(2, min(32, -(-(256 << 20) // kv_bytes)))


def correctness(shape: str) -> list[dict]:
    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    rows = []
    for batch, lens in ((1, [CTX]), (7, None), (3, [3000, 1, 17])):
        lens = lens or torch.randint(1, 3001, (batch,)).tolist()
        for name, backend in _backends(spec).items():
            layers = Layers(spec, len(lens), 1, lens)
            backend.bind_kv_caches(layers.caches)
            backend.plan(layers.meta)
            layers.run(backend)
            rows.append({"shape": shape, "batch": len(lens), "backend": name,
                         "max_err": layers.error()})  # fmt: skip
    return rows


def timing(shape: str, batch: int, read: float) -> tuple[list[dict], dict]:
    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    kv_bytes = batch * CTX * kv_heads * dim * 2 * 2
    moved = kv_bytes + 2 * batch * heads * dim * 2  # + q read, out written
    floor_us = moved / read * 1e6
    num_layers = _layers_for(kv_bytes)
    rows, times, replay = [], {}, {}
    for name, backend in _backends(spec).items():
        layers = Layers(spec, batch, num_layers, [CTX] * batch)
        backend.bind_kv_caches(layers.caches)
        backend.plan(layers.meta, graph_key=("decode", batch))
        graph = capture_graph(lambda b=backend, lay=layers: lay.run(b))
        us = time_cuda(graph.replay, iters=30) * 1e3 / num_layers
        times[name] = us
        if name == "splitkv":  # replayed 35 times: new queries in place, replay, check
            layers.qkv.normal_()
            backend.plan(layers.meta, graph_key=("decode", batch))
            graph.replay()
            replay = {"shape": shape, "batch": batch, "backend": "splitkv after 36 replays",
                      "max_err": layers.error()}  # fmt: skip
        rows.append({"shape": shape, "batch": batch, "solution": name, "us/layer": us,
                     "x floor": us / floor_us, "layers": num_layers})  # fmt: skip
        del graph, layers
    for row in rows:
        row["vs flashinfer"] = row["us/layer"] / times["flashinfer"] if "flashinfer" in times else 0
    rows.append({"shape": shape, "batch": batch, "solution": "read floor", "us/layer": floor_us,
                 "x floor": 1.0, "layers": num_layers, "vs flashinfer": 0})  # fmt: skip
    return rows, replay


def sweep(shape: str, batch: int, read: float) -> list[dict]:
    """The kernel alone with forced split counts and launch shapes (KV write included)."""
    from xhal.platforms.cuda.kernels import splitkv_decode as kernel
    from xhal.platforms.cuda.kernels.kv_write import write_kv

    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    kv_bytes = batch * CTX * kv_heads * dim * 2 * 2
    num_layers = _layers_for(kv_bytes)
    layers = Layers(spec, batch, num_layers, [CTX] * batch)
    m = layers.meta
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = kernel.num_splits(batch, kv_heads, heads // kv_heads, dim, CTX, sms)
    out = torch.empty(batch, heads, dim, dtype=DTYPE, device="cuda")
    rows = []
    # launch shapes (keys per tile, warps, stages): all at batch 1, the default beyond
    default = (kernel.block_keys(dim), 4, 3)
    shapes = [(64, 4, 2), (128, 4, 2), (128, 4, 3)] if batch == 1 else []
    shapes = list(dict.fromkeys([default, *shapes]))
    for splits in sorted({4, 8, 16, 32, 64, chosen} | ({1, 2} if batch > 1 else set())):
        scratch = kernel.Scratch.make(batch, kv_heads, heads // kv_heads, dim, splits,
                                      torch.device("cuda"))  # fmt: skip
        for block_n, warps, stages in shapes:
            def fn(s=splits, sc=scratch, bn=block_n, w=warps, st=stages):
                for cache in layers.caches:
                    write_kv(layers.k, layers.v, cache.key, cache.value, m.slot_mapping)
                    kernel.splitkv_decode(layers.q, cache.key, cache.value, m.block_table,
                                          m.kv_seq_lens, out, sc, s, spec.softmax_scale,
                                          num_warps=w, num_stages=st, block_n=bn)  # fmt: skip

            us = time_graph(fn, iters=30) * 1e3 / num_layers
            mark = "<-" if (splits, block_n, warps, stages) == (chosen, *default) else ""
            rows.append({"shape": shape, "batch": batch, "splits": splits, "keys": block_n,
                         "warps": warps, "stages": stages, "us/layer": us,
                         "of read": kv_bytes / (us * 1e-6) / read, "chosen": mark})  # fmt: skip
    return rows


def profile(shape: str, batch: int) -> list[dict]:
    """Device time per kernel inside the timed graph (CUPTI), to split a layer's time into its
    kernels and the gaps between them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    num_layers = _layers_for(batch * CTX * kv_heads * dim * 4)
    rows = []
    for name, backend in _backends(spec).items():
        if name == "triton-per-token":
            continue
        layers = Layers(spec, batch, num_layers, [CTX] * batch)
        backend.bind_kv_caches(layers.caches)
        backend.plan(layers.meta, graph_key=("decode", batch))
        graph = capture_graph(lambda b=backend, lay=layers: lay.run(b))
        graph.replay()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count >= 5:
                rows.append({"backend": name, "kernel": e.key[:60],
                             "calls/layer": e.count / 5 / num_layers,
                             "us each": e.device_time_total / e.count})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    read = read_bandwidth()["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s (read-only streaming kernel, this run)")
    checks, rows, tuned = [], [], []
    for shape in args.shapes:
        checks += correctness(shape)
    for shape in args.shapes:
        for batch in args.batches:
            got, replay = timing(shape, batch, read)
            rows += got
            checks.append(replay)
        if not args.no_sweep:
            for batch in [b for b in args.batches if b <= 16]:
                tuned += sweep(shape, batch, read)
    print(table(tuned, "split-KV kernel sweep: forced splits / launch shape, per layer"))
    print(table(checks, "max error against float64 (bf16 outputs; one rounding is ~4e-3)"))
    print(table(rows, "decode layer (KV write + attention), bf16 ctx 2048 page 16, in a CUDA "
                      "graph of L layers: us per layer"))  # fmt: skip
    if "8b" in args.shapes and 1 in args.batches:
        try:
            print(table(profile("8b", 1), "8B shape, batch 1: device time per kernel"))
        except Exception as e:  # noqa: BLE001  (the profile is extra; the tables above stand)
            print(f"profile failed: {e!r}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
