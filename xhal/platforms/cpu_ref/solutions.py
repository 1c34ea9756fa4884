"""The CPU reference's solutions: every op's "reference" (plain torch, obviously right), and the
vectorized sampling the device backends share as a second sampling solution."""

from __future__ import annotations

from xhal.solutions.op_names import ATTENTION_OPS, DEVICE_OPS
from xhal.solutions.solution import Requirement, Solution

_CPU = Requirement(device_type="cpu")


class ReferenceAttention:
    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def attention_backend(spec):
        from xhal.platforms.cpu_ref.attention import CpuAttention

        return CpuAttention(spec)


def reference_ops(platform: object):
    from xhal.platforms.cpu_ref.ops import CpuOps

    return CpuOps()


SOLUTIONS = (
    *(
        Solution(
            op, "reference", "xhal.platforms.cpu_ref.solutions:reference_ops", _CPU, priority=0
        )
        for op in DEVICE_OPS
    ),
    *(
        Solution(op, "reference", "xhal.platforms.cpu_ref.solutions:ReferenceAttention", _CPU)
        for op in ATTENTION_OPS
    ),
    Solution(
        "sampling",
        "torch",
        "xhal.platforms.common.torch_ops:TorchOps",
        _CPU,
        priority=-10,
        description="the vectorized, sync-free sampler the GPU and NPU use "
                    "(xhal.platforms.common.sampling)",
    ),
)
