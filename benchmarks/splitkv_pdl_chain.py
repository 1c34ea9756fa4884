"""The split-KV decode launch between the projections a decode layer runs around it, to time its
programmatic dependent launch (``bench_splitkv --pdl``): PDL hides a kernel's prologue only under
the kernel ahead of it, so attention timed alone cannot show it.

One layer here is the decode chain of a model's attention block, batch <= 16, bf16: the fused
add + RMSNorm + qkv GEMV (``fused_gemv.py``), Qwen3's q / k norm launch for the MoE shape
(``qk_norm.py``), the split-KV launch with rotary and the KV write inside it, and the o GEMV,
whose output is the next layer's input (a real dependency chain). ``L`` layers with their own
weights and caches in one CUDA graph stream their bytes past L2. Every variant runs on the same
weights, caches and inputs, so their outputs must match the PDL-off chain exactly (PDL and L2
prefetches change when things run, never what is computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.common import capture_graph, time_cuda
from benchmarks.kernel_profile import cuda_kernel_events
from xhal.interfaces import AttentionSpec

HIDDEN = {"8b": 4096, "moe": 2048, "1b": 2048}
QK_NORM = {"moe"}  # Qwen3's per-head q / k RMSNorm between the qkv GEMV and attention
EPS = 1e-6


@dataclass(frozen=True)
class Variant:
    """Triggers of one chain: ``attention`` the split-KV launch's ``use_pdl``, ``prefetch`` its
    tiles asked of L2 before the wait, ``qkv`` the norm + qkv GEMV's (``pdl.BY_SIZE`` resolves by
    its weight bytes, as ``AUTO`` did for it before it made norm GEMVs late), ``gemvs`` the o
    GEMV's and the q / k norm's (off or auto)."""

    attention: int
    prefetch: int
    qkv: int
    gemvs: int


def variants(qkv_bytes: int, tiles_per_split: int) -> dict[str, Variant]:
    """The variants worth timing for a qkv weight of ``qkv_bytes`` and a split of
    ``tiles_per_split`` tiles (more than 2: a 4-tile prefetch too): a forced qkv trigger only
    where it differs from ``AUTO``'s."""
    from xhal.platforms.cuda import pdl

    off, early, late, auto, size = pdl.OFF, pdl.EARLY, pdl.LATE, pdl.AUTO, pdl.BY_SIZE
    out = {  # the first three at every batch (``measure(full=False)``)
        "pdl off": Variant(off, 0, off, off),
        "attn plain (tree before)": Variant(off, 0, size, auto),
        "attn early, prefetch 2": Variant(early, 2, size, auto),
        "attn early, prefetch 0": Variant(early, 0, size, auto),
        "attn late, prefetch 2": Variant(late, 2, size, auto),
    }
    forced = late if pdl.gemv_trigger(size, qkv_bytes) == early else early
    out[f"attn early p2, qkv {'late' if forced == late else 'early'}"] = Variant(
        early, 2, forced, auto
    )
    if tiles_per_split > 2:
        out["attn early, prefetch 4"] = Variant(early, 4, size, auto)
    return out


class Chain:
    """``num_layers`` attention blocks of one shape on ``layers`` (bench_splitkv's caches and
    metadata), each with its own qkv and o weights."""

    def __init__(self, shape: str, spec: AttentionSpec, layers, num_layers: int) -> None:
        from xhal.platforms.cuda.kernels import splitkv_decode as kernel

        self.shape, self.spec, self.layers = shape, spec, layers
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        hidden, batch = HIDDEN[shape], layers.batch
        device = layers.caches[0].key.device
        bf16 = {"dtype": torch.bfloat16, "device": device}
        self.w_qkv = [torch.randn((h + 2 * hkv) * d, hidden, **bf16) * hidden**-0.5
                      for _ in range(num_layers)]  # fmt: skip
        self.w_o = [torch.randn(hidden, h * d, **bf16) * (h * d) ** -0.5 for _ in range(num_layers)]
        self.norm_w = torch.ones(hidden, **bf16)
        self.qk_w = torch.ones(d, **bf16)
        self.x = torch.randn(batch, hidden, **bf16)
        self.residual = torch.randn(batch, hidden, **bf16)
        m = layers.meta
        cuda = device.type == "cuda"  # CPU: the interpreter's smoke test of this chain
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
        self.splits = kernel.num_splits(batch, hkv, h // hkv, d, m.max_seq_len, sms)
        self.scratch = kernel.Scratch.make(batch, hkv, h // hkv, d, self.splits, device)
        self.out = torch.empty(batch, h, d, **bf16)
        self.final = self.x

    def variants(self) -> dict[str, Variant]:
        from xhal.platforms.cuda.kernels import splitkv_decode as kernel

        s = self.spec
        tiles = -(-self.layers.meta.max_seq_len // kernel.block_keys(s.head_dim))
        return variants(self.w_qkv[0].numel() * 2, -(-tiles // self.splits))

    def weight_bytes(self) -> int:
        return (self.w_qkv[0].numel() + self.w_o[0].numel()) * 2

    def run(self, v: Variant) -> torch.Tensor:
        from xhal.platforms.cuda.kernels import splitkv_decode as kernel
        from xhal.platforms.cuda.kernels.fused_gemv import add_rms_norm_gemv, stream_gemv
        from xhal.platforms.cuda.kernels.qk_norm import qk_rms_norm

        s, lay, m = self.spec, self.layers, self.layers.meta
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        x, residual = self.x, self.residual
        for i, cache in enumerate(lay.caches[: len(self.w_qkv)]):
            qkv, residual = add_rms_norm_gemv(x, residual, self.norm_w, EPS, self.w_qkv[i],
                                              use_pdl=v.qkv)  # fmt: skip
            q, k, val = qkv.split([h * d, hkv * d, hkv * d], dim=1)
            if self.shape in QK_NORM:
                q, k = qk_rms_norm(q, k, self.qk_w, self.qk_w, EPS, use_pdl=v.gemvs)
            q, k, val = q.view(-1, h, d), k.view(-1, hkv, d), val.view(-1, hkv, d)
            kernel.splitkv_decode(
                q, cache.key, cache.value, m.block_table, m.kv_seq_lens, self.out, self.scratch,
                self.splits, s.softmax_scale, new=kernel.NewToken(k, val, m.slot_mapping),
                rotary=kernel.Rotary(lay.positions, lay.rot, True), use_pdl=v.attention,
                prefetch=v.prefetch,
            )  # fmt: skip
            x = stream_gemv(self.out.view(-1, h * d), self.w_o[i], use_pdl=v.gemvs)
        self.final = x  # inside a capture: the graph's static output
        return x


def measure(chain: Chain, read: float, kv_bytes: int, full: bool = True) -> list[dict]:
    """Every variant's chain (the first three unless ``full``: each variant compiles kernels of
    its own) captured and timed (us per layer), its output against PDL off's, and the floor:
    the layer's weight and KV bytes over the read ceiling of this run."""
    num_layers = len(chain.w_qkv)
    floor_us = (chain.weight_bytes() + kv_bytes) / read * 1e6
    rows, base_us, base_out = [], 0.0, None
    for name, v in list(chain.variants().items())[: None if full else 3]:
        graph = capture_graph(lambda v=v: chain.run(v))
        us = time_cuda(graph.replay, iters=30) * 1e3 / num_layers
        graph.replay()
        got = _output(chain, name)
        if base_out is None:
            base_us, base_out = us, got
        rows.append({
            "shape": chain.shape, "batch": chain.layers.batch, "variant": name,
            "us/layer": us, "x floor": us / floor_us, "vs off": us / base_us,
            "diff vs off": (got - base_out).abs().max().item(),
        })  # fmt: skip
        del graph
    rows.append({"shape": chain.shape, "batch": chain.layers.batch, "variant": "read floor",
                 "us/layer": floor_us, "x floor": 1.0, "vs off": 0.0,
                 "diff vs off": 0.0})  # fmt: skip
    return rows


def profile(chain: Chain, names: tuple[str, ...]) -> list[dict]:
    """Device time per kernel of the chain under some variants (CUPTI): under PDL a kernel's
    time includes the time its programs sit launched before their wait, so compare the GEMVs
    across variants to see whether parked attention programs slow their weight stream."""
    rows, every = [], chain.variants()
    for name in names:
        graph = capture_graph(lambda v=every[name]: chain.run(v))
        calls = 5 * len(chain.w_qkv)
        for e in cuda_kernel_events(graph.replay, 5):
            if e.count >= calls:
                rows.append({"shape": chain.shape, "variant": name, "kernel": e.key[:40],
                             "calls/layer": e.count / calls,
                             "us each": e.device_time_total / e.count})  # fmt: skip
        del graph
    return rows


def _output(chain: Chain, name: str) -> torch.Tensor:
    """After a replay: the last layer's attention output and o projection (the graph's static
    tensors, rewritten by each replay), float32; the split counters must be back at 0."""
    torch.cuda.synchronize()
    if int(chain.scratch.counters.abs().sum()) != 0:
        raise RuntimeError(f"{name}: split counters left above 0 after a replay")
    return torch.cat([chain.out.flatten(), chain.final.flatten()]).float()
