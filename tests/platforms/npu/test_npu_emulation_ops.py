"""The torch_npu emulation's DeviceOps (RMS norms, SwiGLU, rotary embeddings, top-k/top-p) match
float64 formulas written independently of the emulation, and reject the arguments the real ops do.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.npu_emulation_helpers import BF16, emulated_npu, max_err

npu = emulated_npu  # the fixture, under the name the tests take


def test_rms_norms_match_reference(npu):
    x, r = torch.randn(5, 64).to(BF16), torch.randn(5, 64).to(BF16)
    w = (1 + 0.1 * torch.randn(64)).to(BF16)
    xd, rd, wd = x.double(), r.double(), w.double()
    y, rstd = npu.npu_rms_norm(x, w, 1e-6)
    ref_rstd = 1 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == BF16 and rstd.dtype == torch.float32 and rstd.shape == (5, 1)
    assert max_err(y, xd * ref_rstd * wd) < 3e-2 and max_err(rstd, ref_rstd) < 1e-4
    x0, r0 = x.clone(), r.clone()
    y, _, summed = npu.npu_add_rms_norm(x, r, w, 1e-6)
    s = xd + rd
    assert max_err(summed, s) < 3e-2 and torch.equal(x, x0) and torch.equal(r, r0)
    assert max_err(y, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * wd) < 3e-2


def test_swiglu_matches_reference(npu):
    x = torch.randn(3, 4, 32)
    a, c = x.double().chunk(2, -1)
    assert max_err(npu.npu_swiglu(x), torch.nn.functional.silu(a) * c) < 1e-5
    a, c = x.double().chunk(2, 1)
    assert max_err(npu.npu_swiglu(x, dim=1), torch.nn.functional.silu(a) * c) < 1e-5
    # the doc states no contiguity rule: a strided input is taken
    a, c = x.transpose(0, 1).double().chunk(2, -1)
    assert max_err(npu.npu_swiglu(x.transpose(0, 1)), torch.nn.functional.silu(a) * c) < 1e-5


def rope_reference(positions, x, cache, neox):
    """Complex-number rotation of x [T, H, D] (independent of the chunk/interleave code)."""
    x, cache = x.double(), cache.double()
    half = cache.shape[-1] // 2
    cos, sin = cache[positions.long()].split(half, -1)
    i = torch.arange(half)
    first, second = (i, i + half) if neox else (2 * i, 2 * i + 1)
    z = torch.complex(x[..., first], x[..., second]) * torch.complex(cos, sin)[:, None]
    out = x.clone()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def rope_cache(max_pos, rot):
    inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], -1).float()


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_ops_match_reference(npu, neox):
    pos, cache = torch.tensor([5, 0, 63, 17], dtype=torch.int32), rope_cache(64, 64)
    q, k = torch.randn(4, 4, 128).to(BF16), torch.randn(4, 2, 128).to(BF16)
    mode = "half" if neox else "interleave"  # the doc's spelling
    q2, k2 = npu.npu_mrope(pos, q.view(4, -1), k.view(4, -1), cache, 128, rotary_mode=mode)
    assert max_err(q2.view(4, 4, 128), rope_reference(pos, q, cache, neox)) < 3e-2
    assert max_err(k2.view(4, 2, 128), rope_reference(pos, k, cache, neox)) < 3e-2
    qi, ki = q.view(4, -1).clone(), k.view(4, -1).clone()
    assert npu._npu_rotary_embedding(pos, qi, ki, 128, cache, neox) is None  # in place
    assert torch.equal(qi, q2) and torch.equal(ki, k2)
    # the doc: rotary_dim a multiple of 32 for bf16/fp16 (16 for fp32); head_size has no rule
    q80, k80 = torch.zeros(4, 160, dtype=BF16), torch.zeros(4, 80, dtype=BF16)
    npu.npu_mrope(pos, q80, k80, rope_cache(64, 32), 80, rotary_mode=mode)
    with pytest.raises(RuntimeError, match="rotary_dim要求是32的倍数"):
        npu.npu_mrope(pos, q80, k80, rope_cache(64, 48), 80, rotary_mode=mode)
    npu.npu_mrope(pos, q80.float(), k80.float(), rope_cache(64, 48), 80, rotary_mode=mode)
    with pytest.raises(RuntimeError, match="'interleave'"):
        npu.npu_mrope(pos, q.view(4, -1), k.view(4, -1), cache, 128, rotary_mode="interleaved")


def test_mrope_sections_pick_position_rows(npu):
    cache = rope_cache(64, 64)
    pos = torch.tensor([[1, 2, 3], [10, 20, 30], [40, 50, 60]])
    q, k = torch.randn(3, 64), torch.randn(3, 64)
    q2, _ = npu.npu_mrope(pos, q, k, cache, 64, mrope_section=[8, 12, 12])
    for t in range(3):  # each channel pair rotated by the angle of its section's position row
        row = torch.cat([torch.full((8,), 0), torch.full((12,), 1), torch.full((12,), 2)])
        angle_pos = pos[row, t]
        c, s = cache[angle_pos, torch.arange(32)], cache[angle_pos, 32 + torch.arange(32)]
        x1, x2 = q[t, :32], q[t, 32:]
        assert torch.allclose(q2[t], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]), atol=1e-5)


def top_k_top_p_reference(logits, p, k):
    out = logits.double().clone()
    for i, row in enumerate(logits.double()):
        kth = row.sort(descending=True).values[int(k[i]) - 1]
        kept = row.masked_fill(row < kth, float("-inf"))
        probs = kept.softmax(-1)
        mass_before = 0.0
        for j in probs.argsort(descending=True).tolist():
            if mass_before >= float(p[i]):
                kept[j] = float("-inf")
            mass_before += float(probs[j])
        out[i] = kept
    return out


def test_top_k_top_p_matches_reference_and_enforces_k_range(npu):
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(3))
    p, k = torch.tensor([0.9, 0.5, 1.0]), torch.tensor([1, 40, 1024], dtype=torch.int32)
    out = npu.npu_top_k_top_p(logits, p, k)
    ref = top_k_top_p_reference(logits, p, k)
    assert torch.equal(out.isinf(), ref.isinf()) and out.isfinite().sum(-1)[0] == 1
    assert torch.allclose(out[out.isfinite()].double(), ref[ref.isfinite()])
    for bad in ([0, 1, 1], [1, 1, 1025]):
        with pytest.raises(RuntimeError, match=r"\[1, 1024\]"):
            npu.npu_top_k_top_p(logits, p, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"V=50"):
        npu.npu_top_k_top_p(logits[:, :50], p, torch.tensor([1, 1, 60], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_top_k_top_p(logits, p, k.long())
