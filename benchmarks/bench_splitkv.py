"""Split-KV Triton decode (``kernels/splitkv_decode.py``) against FlashInfer's decode, on the GPU,
in one run. A decode layer here is what a model's attention runs per layer in a decode step:
rotary of q and k, the paged KV write and attention (``forward_rotary``).

1. correctness: every backend's output against a float64 reference (q and k rotated in float64;
   ragged and 2K contexts, strided q/k/v), the key it wrote against the float64 rotation, and the
   split-KV graph replayed again after its timing with new q/k/v written in place (a counter left
   above 0 by any earlier replay would break it);
2. per-layer time inside a CUDA graph of ``L`` layers, each layer with its own cache so the graph
   streams ``L`` x the KV bytes past L2, against the read floor (KV + q + out bytes over the read
   ceiling measured in this run), FlashInfer (rotary_kv.py's launch, its decode, its merge) and
   the split-KV kernel as the seventh session ran it (``splitkv-2launch``: rotary_kv.py's launch
   writes the cache, then the kernel reads the new key from it), the peer of the fused launch;
3. a sweep of split counts (and launch shapes) at batch 1, which the split rule in
   ``kernels/splitkv_decode.py`` and the bucket rule in ``solutions.py`` come from;
4. with ``--pdl`` (batches up to 16), the launch's programmatic dependent launch between the
   projections around it (``splitkv_pdl_chain.py``): PDL off, the plain launch after PDL
   GEMVs, and its PDL triggers and prefetch depths, each chain's output against PDL off's.

With PDL on (the default on sm_90), rows 1-3 run the launch's PDL path (early trigger), with
no kernel ahead of it to overlap.

    python -m benchmarks.bench_splitkv [--batches 1 4 16 64] [--no-sweep] [--pdl]

Shapes (bf16, pages of 16, ctx 2048): Llama-3-8B attention (32 q / 8 kv heads, D=128), the
Qwen3-30B-A3B MoE's (32 / 4, D=128), Llama-3.2-1B's (32 / 8, D=64).
"""

from __future__ import annotations

import argparse
import time

import torch

import xhal
from benchmarks.bench_attention_solutions import make_decode, reference
from benchmarks.common import (
    capture_graph,
    read_bandwidth,
    table,
    time_cuda,
    time_graph,
)
from benchmarks.kernel_profile import cuda_kernel_events
from xhal.interfaces import AttentionSpec, LayerCache

SHAPES = {"8b": (32, 8, 128), "moe": (32, 4, 128), "1b": (32, 8, 64)}
CTX, PAGE = 2048, 16
DTYPE = torch.bfloat16
ROPE_THETA = 500000.0  # Llama 3's


class TwoLaunchSplitKV:
    """The seventh session's decode layer, the peer of the fused launch: rotary_kv.py rotates q
    and writes the rotated key and the value into the cache, then the split-KV kernel attends
    over the cache (reading the new key back from it)."""

    fuses_rotary = True

    def __init__(self, spec: AttentionSpec, num_sms: int) -> None:
        self.spec, self.num_sms = spec, num_sms

    def bind_kv_caches(self, caches) -> None:
        self.caches = caches

    def plan(self, m, graph_key=None) -> None:
        from xhal.platforms.cuda.kernels import splitkv_decode as kernel

        s = self.spec
        self.m = m
        shape = (m.num_seqs, s.num_kv_heads, s.group_size, s.head_dim)
        self.splits = kernel.num_splits(*shape, m.max_seq_len, self.num_sms)
        self.scratch = kernel.Scratch.make(*shape, self.splits, m.block_table.device)

    def forward_rotary(self, layer, q, k, v, positions, table_, is_neox, **launch):
        from xhal.platforms.cuda.kernels import splitkv_decode as kernel
        from xhal.platforms.cuda.kernels.rotary_kv import rotary_write_kv

        c, m = self.caches[layer], self.m
        q = rotary_write_kv(positions, q, k, v, table_, is_neox, c.key, c.value, m.slot_mapping)
        out = torch.empty_like(q)
        return kernel.splitkv_decode(q, c.key, c.value, m.block_table, m.kv_seq_lens, out,
                                     self.scratch, self.splits, self.spec.softmax_scale,
                                     **launch)  # fmt: skip


def _backends(spec: AttentionSpec) -> dict[str, object]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {
        "splitkv": xhal.platforms.get("cuda-triton").attention_backend(spec),
        "splitkv-2launch": TwoLaunchSplitKV(spec, sms),
    }
    cuda = xhal.platforms.get("cuda")
    if any(s.name == "flashinfer" and cuda.kernels.unmet(s, DTYPE) is None
           for s in cuda.kernels.solutions("paged_decode_attention")):  # fmt: skip
        with cuda.kernels.forcing("paged_decode_attention", "flashinfer"):
            out["flashinfer"] = cuda.attention_backend(spec)
    for name, backend in out.items():
        if not backend.fuses_rotary:
            raise RuntimeError(f"{name} does not fuse rotary (XHAL_CUDA_FUSED=0?): unset it")
    return out


def _rotate64(x: torch.Tensor, positions: torch.Tensor, table_: torch.Tensor) -> torch.Tensor:
    """NeoX rotary in float64, from the definition."""
    half = table_.shape[1] // 2
    cos = table_[positions.long(), :half].double()[:, None, :]
    sin = table_[positions.long(), half:].double()[:, None, :]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], dim=-1)


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
        self.positions = (self.meta.kv_seq_lens - 1).to(torch.int32)
        d = spec.head_dim
        inv_freq = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(max(lens) + 16, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.rot = torch.cat([angles.cos(), angles.sin()], 1).float().cuda()  # [pos, D]
        h, hkv = spec.num_heads, spec.num_kv_heads
        self.qkv = torch.randn(batch, h + 2 * hkv, spec.head_dim, dtype=DTYPE, device="cuda")
        self.q, self.k, self.v = self.qkv.split([h, hkv, hkv], dim=1)
        self.out: torch.Tensor | None = None

    def run(self, backend, **launch) -> torch.Tensor:
        for layer in range(len(self.caches)):
            self.out = backend.forward_rotary(
                layer, self.q, self.k, self.v, self.positions, self.rot, True, **launch
            )
        return self.out

    def error(self) -> tuple[float, float]:
        """(attention output, written key) of layer L-1 against float64: its cache holds the
        new key, which the reference reads, so the key is checked on its own too."""
        q = _rotate64(self.q, self.positions, self.rot).to(DTYPE)
        cache = self.caches[-1]
        ref = reference(q, cache, self.meta, self.spec.softmax_scale)
        slots = self.meta.slot_mapping.long()
        written = cache.key.flatten(0, 1)[slots].double()  # [B, Hkv, D]
        want_k = _rotate64(self.k, self.positions, self.rot)
        return (
            (self.out.double().cpu() - ref).abs().max().item(),
            (written - want_k).abs().max().item(),
        )


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
            out_err, key_err = layers.error()
            rows.append({"shape": shape, "batch": len(lens), "backend": name,
                         "max_err": out_err, "key_err": key_err})  # fmt: skip
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
        if name == "splitkv":  # replayed 35 times: new q/k/v in place, replay, check
            layers.qkv.normal_()
            backend.plan(layers.meta, graph_key=("decode", batch))
            graph.replay()
            out_err, key_err = layers.error()
            replay = {"shape": shape, "batch": batch, "backend": "splitkv after 36 replays",
                      "max_err": out_err, "key_err": key_err}  # fmt: skip
        rows.append({"shape": shape, "batch": batch, "solution": name, "us/layer": us,
                     "x floor": us / floor_us, "layers": num_layers})  # fmt: skip
        del graph, layers
    for row in rows:
        row["vs 2launch"] = row["us/layer"] / times["splitkv-2launch"]
        row["vs flashinfer"] = row["us/layer"] / times["flashinfer"] if "flashinfer" in times else 0
    rows.append({"shape": shape, "batch": batch, "solution": "read floor", "us/layer": floor_us,
                 "x floor": 1.0, "layers": num_layers, "vs 2launch": 0,
                 "vs flashinfer": 0})  # fmt: skip
    return rows, replay


def sweep(shape: str, batch: int, read: float) -> list[dict]:
    """The fused layer (rotary, KV write and attention in one launch) with forced split counts
    and launch shapes."""
    from xhal.platforms.cuda.kernels import splitkv_decode as kernel

    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    kv_bytes = batch * CTX * kv_heads * dim * 2 * 2
    num_layers = _layers_for(kv_bytes)
    layers = Layers(spec, batch, num_layers, [CTX] * batch)
    m = layers.meta
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = kernel.num_splits(batch, kv_heads, heads // kv_heads, dim, CTX, sms)
    out = torch.empty(batch, heads, dim, dtype=DTYPE, device="cuda")
    new = kernel.NewToken(layers.k, layers.v, m.slot_mapping)
    rotary = kernel.Rotary(layers.positions, layers.rot, True)
    rows = []
    # launch shapes (keys per tile, warps, stages): the default, and two others at batch 1
    default = (kernel.block_keys(dim), 4, 3)
    shapes = [(64, 4, 2), (128, 4, 3)] if batch == 1 else []
    shapes = list(dict.fromkeys([default, *shapes]))
    for splits in sorted({8, 16, 32, chosen} | ({2, 4} if batch > 1 else set())):
        scratch = kernel.Scratch.make(batch, kv_heads, heads // kv_heads, dim, splits,
                                      torch.device("cuda"))  # fmt: skip
        for block_n, warps, stages in shapes if splits == chosen else [default]:
            def fn(s=splits, sc=scratch, bn=block_n, w=warps, st=stages):
                for cache in layers.caches:
                    kernel.splitkv_decode(layers.q, cache.key, cache.value, m.block_table,
                                          m.kv_seq_lens, out, sc, s, spec.softmax_scale,
                                          num_warps=w, num_stages=st, block_n=bn, new=new,
                                          rotary=rotary)  # fmt: skip

            us = time_graph(fn, iters=30) * 1e3 / num_layers
            mark = "<-" if (splits, block_n, warps, stages) == (chosen, *default) else ""
            rows.append({"shape": shape, "batch": batch, "splits": splits, "keys": block_n,
                         "warps": warps, "stages": stages, "us/layer": us,
                         "of read": kv_bytes / (us * 1e-6) / read, "chosen": mark})  # fmt: skip
    return rows


def pdl_chains(shape: str, batch: int, read: float) -> tuple[list[dict], list[dict]]:
    """The split-KV launch between its layer's projections, per PDL variant (``--pdl``), and at
    batch 1 its kernels' device times with PDL off, before this launch had PDL, and now."""
    from benchmarks.splitkv_pdl_chain import HIDDEN, Chain, measure, profile

    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    kv_bytes = batch * CTX * kv_heads * dim * 2 * 2
    weights = ((heads + 2 * kv_heads) * dim + heads * dim) * HIDDEN[shape] * 2
    num_layers = max(4, min(16, -(-(512 << 20) // (weights + kv_bytes))))
    chain = Chain(shape, spec, Layers(spec, batch, num_layers, [CTX] * batch), num_layers)
    rows = measure(chain, read, kv_bytes, full=batch == 1)
    names = ("pdl off", "attn plain (tree before)", "attn early, prefetch 2")
    try:
        return rows, profile(chain, names) if batch == 1 else []
    except Exception as e:  # noqa: BLE001  (the profile is extra; the timed rows stand)
        print(f"chain profile failed: {e!r}")
        return rows, []


def profile(shape: str, batch: int) -> list[dict]:
    """Device time per kernel inside the timed graph (CUPTI), to split a layer's time into its
    kernels and the gaps between them."""
    heads, kv_heads, dim = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, dim, DTYPE, PAGE)
    num_layers = _layers_for(batch * CTX * kv_heads * dim * 4)
    rows = []
    for name, backend in _backends(spec).items():
        layers = Layers(spec, batch, num_layers, [CTX] * batch)
        backend.bind_kv_caches(layers.caches)
        backend.plan(layers.meta, graph_key=("decode", batch))
        graph = capture_graph(lambda b=backend, lay=layers: lay.run(b))
        for e in cuda_kernel_events(graph.replay, 5):
            if e.count >= 5:
                rows.append({"backend": name, "kernel": e.key[:60],
                             "calls/layer": e.count / 5 / num_layers,
                             "us each": e.device_time_total / e.count})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--pdl", action="store_true", help="time the PDL chains (batch <= 16)")
    parser.add_argument(
        "--pdl-only", action="store_true",
        help="with --pdl: only the chains (each checked against PDL off's output)",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    read = read_bandwidth()["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s (read-only streaming kernel, this run)")
    checks, rows, tuned = [], [], []
    for shape in args.shapes if not (args.pdl and args.pdl_only) else []:
        checks += correctness(shape)
    for shape in args.shapes if not (args.pdl and args.pdl_only) else []:
        for batch in args.batches:
            got, replay = timing(shape, batch, read)
            rows += got
            checks.append(replay)
        if not args.no_sweep:
            for batch in [b for b in args.batches if b == 1]:
                tuned += sweep(shape, batch, read)
    print(table(tuned, "split-KV kernel sweep: forced splits / launch shape, per layer"))
    print(table(checks, "max error against float64 (bf16 outputs; one rounding is ~4e-3), "
                        "key_err: the key written in the cache"))  # fmt: skip
    print(table(rows, "decode layer (rotary + KV write + attention), bf16 ctx 2048 page 16, in "
                      "a CUDA graph of L layers: us per layer"))  # fmt: skip
    chains, kernels = [], []
    if args.pdl:
        for shape in args.shapes:
            for batch in [b for b in args.batches if b <= 16]:
                got, prof = pdl_chains(shape, batch, read)
                chains, kernels = chains + got, kernels + prof
                print(table(got, f"{shape} batch {batch}: chain us per layer"), flush=True)
    for shape in [s for s in ("8b", "moe") if s in args.shapes and 1 in args.batches
                  and not args.pdl_only]:  # fmt: skip
        try:
            print(table(profile(shape, 1), f"{shape} shape, batch 1: device time per kernel"))
        except Exception as e:  # noqa: BLE001  (the profile is extra; the tables above stand)
            print(f"profile failed: {e!r}")
    if kernels:
        print(table(kernels, "the chain's kernels at batch 1 (device us; under PDL a kernel's "
                             "time includes its parked programs)"))  # fmt: skip
    if chains:  # last: the table this session's PDL work reads
        print(table(chains, "norm+qkv GEMV -> [q/k norm] -> split-KV -> o GEMV per layer, in a "
                            "CUDA graph of L layers: us per layer by PDL variant"))  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
