"""Shared by the tests of the torch_npu emulation: the per-test ``emulated_npu`` and
``emulated_npu_platform`` fixtures, random paged batches, the FIA call as vllm-ascend makes it, and
the float64 reference to check it against.

The reference is independent of the emulation: dense attention over K/V gathered per sequence by its
block table.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import xhal
from tests.support.npu_emulation import install, is_installed, reset_state, uninstall
from tests.support.npu_emulation.wheel import WheelUnavailable, wheel_files


def require_wheel() -> None:
    """Skip the calling test module when the pinned torch-npu wheel cannot be had: the emulation
    takes its schemas and meta functions from it (npu_emulation/wheel.py)."""
    try:
        wheel_files()
    except WheelUnavailable as err:
        pytest.skip(
            f"torch-npu wheel unavailable, NPU emulation tests skipped: {err}",
            allow_module_level=True,
        )


require_wheel()  # every module that imports these helpers runs on the emulation


def assert_calls_bound_and_checked(counts: dict, where: str) -> None:
    """Every emulated op ``where`` ran was bound to its wheel schema, and every kernel run of an
    op with a meta function in the wheel passed it; prints the totals."""
    assert counts, f"{where}: no emulated torch_npu call was counted"
    lines = []
    for op, c in sorted(counts.items()):
        runs = c.get("meta", 0) + c.get("no_meta", 0)
        assert c.get("bound", 0) > 0, f"{where}: {op} ran {runs} times without a bound call"
        lines.append(
            f"{op}: bound {c.get('bound', 0)}, meta-checked {c.get('meta', 0)}, "
            f"no meta in the wheel {c.get('no_meta', 0)}"
        )
    bound = sum(c.get("bound", 0) for c in counts.values())
    meta = sum(c.get("meta", 0) for c in counts.values())
    no_meta = sum(c.get("no_meta", 0) for c in counts.values())
    print(
        f"\n[{where}] emulated torch_npu calls: {bound} bound to the wheel's schemas; kernel "
        f"runs {meta + no_meta}: {meta} passed the wheel's meta function, {no_meta} of ops "
        "without one\n  " + "\n  ".join(lines)
    )


BF16 = torch.bfloat16
MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
TOL = 2e-2  # bf16 output rounding against a float64 reference


@pytest.fixture
def emulated_npu_platform() -> Iterator[xhal.interfaces.Platform]:
    """The emulated NPU platform, its ops serving "cpu" for one test; uninstalled after (and the
    real platform registered under "npu" again)."""
    from tests.support.npu_emulation.plugin import EmulatedNpuPlatform

    platform = EmulatedNpuPlatform(activate_ops=False)
    try:
        with xhal.ops.using("cpu", platform.ops):
            yield platform
    finally:
        uninstall()
        xhal.platforms.register("npu", "xhal.platforms.npu.platform:NpuPlatform", replace=True)


@pytest.fixture
def emulated_npu():
    """The emulated torch_npu module for one test (left installed if an earlier test, e.g. an
    emulated NPU platform, installed it)."""
    installed_before = is_installed()
    mod = install()
    yield mod
    reset_state()
    if not installed_before:
        uninstall()


def make_batch(q_lens, kv_lens, *, heads=4, kv_heads=2, head_dim=128, block_size=128, seed=0):
    """Random caches ``[nb, bs, Hkv, D]`` holding every kv token, permuted block tables, q."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(q_lens), max(blocks) + 1, dtype=torch.int32)  # one padding column
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return SimpleNamespace(
        q=torch.randn(sum(q_lens), heads, head_dim, generator=g).to(BF16),
        k=torch.randn(*shape, generator=g).to(BF16),
        v=torch.randn(*shape, generator=g).to(BF16),
        table=table,
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )


def fia_kwargs(b, **overrides):
    kw = dict(
        num_heads=b.heads,
        num_key_value_heads=b.kv_heads,
        input_layout="TND",
        scale=b.head_dim**-0.5,
        block_table=b.table,
        block_size=b.block_size,
        actual_seq_lengths=list(itertools.accumulate(b.q_lens)),
        actual_seq_lengths_kv=list(b.kv_lens),
        sparse_mode=3,
        atten_mask=MASK,
    )
    return kw | overrides


def flat(cache):  # [nb, bs, Hkv, D] -> BnBsH [nb, bs, Hkv*D], as vllm-ascend passes it
    return cache.view(cache.shape[0], cache.shape[1], -1)


def call_fia(npu, b, q=None, **overrides):
    out, _ = npu.npu_fused_infer_attention_score(
        b.q if q is None else q, flat(b.k), flat(b.v), **fia_kwargs(b, **overrides)
    )
    return out


def reference(b, q=None, kv_lens=None, window=None):
    """float64, per sequence: gather K/V by block table, dense causal aligned bottom-right."""
    q = (b.q if q is None else q).double()
    kv_lens = b.kv_lens if kv_lens is None else kv_lens
    out, start, group = torch.zeros_like(q), 0, b.heads // b.kv_heads
    for i, (q_len, kv_len) in enumerate(zip(b.q_lens, kv_lens)):
        pos = torch.arange(kv_len)
        rows = b.table[i, pos // b.block_size].long()
        keys = b.k[rows, pos % b.block_size].double().repeat_interleave(group, 1)
        values = b.v[rows, pos % b.block_size].double().repeat_interleave(group, 1)
        for t in range(q_len):
            p = kv_len - q_len + t
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,khd->hk", q[start + t], keys[lo : p + 1]) * b.head_dim**-0.5
            out[start + t] = torch.einsum("hk,khd->hd", s.softmax(-1), values[lo : p + 1])
        start += q_len
    return out


def max_err(out, ref):
    return (out.double() - ref).abs().max().item()
