"""``benchmarks/trace_ops.py``'s attribution of a launch to its module and op, on a CPU profile
(the kernels themselves need the GPU), and the activation peer of ``pdl_variants``."""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

import xhal.ops  # noqa: F401  (registers the xhal:: custom ops)
from benchmarks import pdl_variants, trace_ops


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x):
        return torch.ops.xhal.silu_and_mul(self.proj(x))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), torch.nn.Linear(8, 8)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def _launchers(model, x) -> set[tuple[str, str]]:
    handles = trace_ops._wrap_modules(model)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {trace_ops._owner(e) for e in prof.events() if e.name in ("aten::addmm", "aten::mul")}


def test_a_launch_is_owned_by_its_innermost_module_and_outermost_xhal_op() -> None:
    model = _Model()
    owners = _launchers(model, torch.randn(3, 8))
    assert ("layers.N.proj", "aten::addmm") in owners  # layer 0's projection, index folded
    assert ("layers.N", "aten::addmm") in owners  # layer 1 is a Linear itself
    assert ("layers.N", "xhal::silu_and_mul > aten::mul") in owners  # inside the custom op
    assert not model._forward_pre_hooks and not model.layers[0].proj._forward_hooks


def test_the_activation_peer_captures_with_the_torch_sequence_and_restores(monkeypatch) -> None:
    monkeypatch.delenv("XHAL_CUDA_TRITON_ACTIVATION", raising=False)
    monkeypatch.setenv("XHAL_CUDA_PDL", "1")
    with pdl_variants.pdl_variant("auto-torch-activation"):
        assert os.environ["XHAL_CUDA_TRITON_ACTIVATION"] == "0"
        assert os.environ["XHAL_CUDA_PDL_TRIGGER"] == "auto"
    assert "XHAL_CUDA_TRITON_ACTIVATION" not in os.environ
    assert os.environ["XHAL_CUDA_PDL"] == "1"
    with pdl_variants.pdl_variant("off"):
        assert "XHAL_CUDA_TRITON_ACTIVATION" not in os.environ


def test_an_unclaimed_kernel_goes_to_the_innermost_module_range_around_it() -> None:
    from types import SimpleNamespace

    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    ranges = [event("mod:layers.N", 0, 100), event("mod:layers.N.attn", 10, 40)]
    assert trace_ops._innermost_range(event("k", 12, 30), ranges) == "layers.N.attn"
    assert trace_ops._innermost_range(event("k", 50, 60), ranges) == "layers.N"
    assert trace_ops._innermost_range(event("k", 90, 120), ranges) == "?"
