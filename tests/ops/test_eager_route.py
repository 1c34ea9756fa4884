"""``xhal.ops`` on plain CPU tensors in eager code calls the active CPU ops' method itself; whatever
observes the call (a ``TorchDispatchMode`` such as the CPU graph recorder, fake tensors) still
sees the custom op, and the results are the same either way."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xhal import ops
from xhal.platforms.cpu_ref.ops import CpuOps


class _Counting(CpuOps):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_rms_norm_linear(self, *args):
        self.calls.append("add_rms_norm_linear")
        return super().add_rms_norm_linear(*args)


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_cpu_calls_skip_the_dispatcher_and_observed_calls_do_not() -> None:
    g = torch.Generator().manual_seed(0)
    x, residual, norm_w = (torch.randn(2, 16, generator=g) for _ in range(3))
    weight = torch.randn(8, 16, generator=g)
    counting = _Counting()
    with ops.using("cpu", counting):
        eager = ops.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight)
        assert counting.calls == ["add_rms_norm_linear"]  # the method, once
        seen = _Seen()
        with seen:
            observed = ops.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight)
        assert "xhal.add_rms_norm_linear.default" in seen.ops  # the mode saw the custom op
        assert counting.calls == ["add_rms_norm_linear"] * 2  # its kernel called the method
    # what the reference computes, spelled out
    summed = x + residual
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    for got in (eager, observed):
        torch.testing.assert_close(got[0], normed @ weight.T)
        torch.testing.assert_close(got[1], summed)


def test_fake_tensors_take_the_fake_implementation() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    counting = _Counting()
    with ops.using("cpu", counting), FakeTensorMode():
        x = torch.empty(3, 16)
        out, summed = ops.add_rms_norm_linear(x, x, torch.empty(16), 1e-6, torch.empty(8, 16))
    assert out.shape == (3, 8) and summed.shape == (3, 16)
    assert counting.calls == []  # no real kernel ran on the fake tensors
