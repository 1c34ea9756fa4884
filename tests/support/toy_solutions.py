"""Test-only solutions for a made-up "toy" device: enough of every device op for ``Kernels`` to
build its ops (the CPU reference's implementations), plus an rms_norm whose package is missing, a
linear with a config space whose cost a fake clock can see, and two attention providers that
record which one planned a step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from xhal import solutions
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.solutions.op_names import ATTENTION_OPS, DEVICE_OPS
from xhal.solutions.solution import Config, DeviceInfo, Package, Requirement, Solution

TOY = Requirement(device_type="toy")
DEVICE = DeviceInfo(
    "toy", name="Toy Accelerator 9000", library_versions=(("torch", torch.__version__),)
)
MISSING = Package("xhal_toy_missing_pkg", "pip install xhal-toy-missing-pkg")


class FakeClock:
    """A clock that only moves when a toy kernel says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = FakeClock()


class ToyPlatform:
    """The little of a platform ``Kernels`` touches: a name and ``synchronize``."""

    name = "toy"
    device_type = "cpu"

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class TunableLinear:
    """``linear`` whose config ``cost`` advances the fake clock: the tuner must keep the cheapest.
    ``calls`` counts every call, timing runs included."""

    calls = 0

    def __init__(self, platform: object) -> None:
        del platform

    @classmethod
    def linear(cls, x, weight, bias=None, *, cost: float, work: int = 1):
        cls.calls += 1
        CLOCK.now += cost
        out = None
        for _ in range(work):  # real work, for the real-clock run
            out = torch.nn.functional.linear(x, weight, bias)
        return out


class SelfTimingLinear:
    """``linear`` that makes a choice of its own per shape bucket on first sight and keeps it in
    the platform's tuning cache under ``SELF_TIMED`` (as the CUDA linear's skinny GEMM does)."""

    def __init__(self, platform: object) -> None:
        self._platform = platform

    def linear(self, x, weight, bias=None):
        cache = self._platform.kernels.tuning_cache
        bucket = rows_bucket(x, weight)
        if cache.get(SELF_TIMED, bucket) is None:
            cache.put(SELF_TIMED, bucket, "plain")
        return torch.nn.functional.linear(x, weight, bias)


SELF_TIMED = "linear=self-timing/choice"


def rows_bucket(x, weight, bias=None) -> str:
    """Bucket: the next power of two of the rows, and the weight's shape."""
    rows = 1 << max(0, (x.shape[0] - 1).bit_length())
    return f"m{rows}-n{weight.shape[0]}-k{weight.shape[1]}"


class RecordingAttention(CpuAttention):
    plans: ClassVar[list[str]] = []  # which backend planned, in order

    def __init__(self, spec, label: str) -> None:
        super().__init__(spec)
        self.label = label

    def plan(self, metadata, graph_key=None) -> None:
        RecordingAttention.plans.append(self.label)
        super().plan(metadata, graph_key)


class DecodeAttention:
    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def attention_backend(spec):
        return RecordingAttention(spec, "decode")


class PrefillAttention:
    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def attention_backend(spec):
        return RecordingAttention(spec, "prefill")


FAKE_COST_CONFIGS = (
    Config("slow", {"cost": 3.0}),
    Config("fast", {"cost": 1.0}),
    Config("medium", {"cost": 2.0}),
)


def toy_solutions(
    *, tunable: bool = False, configs: tuple[Config, ...] = FAKE_COST_CONFIGS
) -> list[Solution]:
    out = [
        Solution(op, "reference", "xhal.platforms.cpu_ref.solutions:reference_ops", TOY)
        for op in DEVICE_OPS
    ]
    out += [
        Solution(op, "reference", "xhal.platforms.cpu_ref.solutions:ReferenceAttention", TOY)
        for op in ATTENTION_OPS
    ]
    out += [
        Solution(
            "rms_norm",
            "needs-pkg",
            "xhal.platforms.common.torch_ops:TorchOps",
            Requirement(device_type="toy", packages=(MISSING,)),
            priority=30,
        ),
        Solution(
            "rms_norm",
            "newer-device",
            "xhal.platforms.common.torch_ops:TorchOps",
            Requirement(device_type="toy", min_compute_capability=(9, 0)),
            priority=20,
        ),
        Solution("rms_norm", "torch", "xhal.platforms.common.torch_ops:TorchOps", TOY, priority=10),
        Solution(
            "paged_decode_attention",
            "fast-decode",
            "tests.support.toy_solutions:DecodeAttention",
            TOY,
            10,
        ),
        Solution(
            "paged_prefill_attention",
            "fast-prefill",
            "tests.support.toy_solutions:PrefillAttention",
            TOY,
            10,
        ),
    ]
    if tunable:
        out.append(
            Solution(
                "linear",
                "tunable",
                "tests.support.toy_solutions:TunableLinear",
                TOY,
                priority=10,
                configs=configs,
                bucket="tests.support.toy_solutions:rows_bucket",
            )
        )
    return out


def registered(items: list[Solution]) -> Iterator[list[Solution]]:
    for s in items:
        solutions.register(s)
    try:
        yield items
    finally:
        for s in items:
            solutions.unregister(s)


class CountingActivation:
    """``silu_and_mul`` that counts its calls (the reference computes the same values)."""

    calls = 0

    def __init__(self, platform: object) -> None:
        del platform

    @classmethod
    def silu_and_mul(cls, x: torch.Tensor) -> torch.Tensor:
        cls.calls += 1
        gate, up = x.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)
