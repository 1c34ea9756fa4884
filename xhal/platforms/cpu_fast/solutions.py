"""The fast CPU solutions: ``FastCpuOps``' norms, rotary, SiLU gate and the fused ops built of
them (the reference's math in fewer torch calls, equal to it to float32 rounding) and
``FastCpuAttention`` (planned once per step, every decode of a batch in one batched attention
over the paged cache, rotary fused into its KV write; eager only: it refuses a graph key). They
rank below the reference, so the ``cpu`` platform stays the oracle; ``cpu-fast`` forces them."""

from __future__ import annotations

from xhal.solutions.op_names import ATTENTION_OPS
from xhal.solutions.solution import Requirement, Solution

_CPU = Requirement(device_type="cpu")
# the gated MLP block too: FastCpuOps leaves it at DeviceOps' default, which the platform
# composes of its own chosen ops whichever solution is named (solutions.kernels); listing it
# names that choice "fast" in the start-up log
FAST_OPS = (
    "linear", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
    "add_rms_norm_linear", "silu_and_mul_linear", "add_rms_norm_gated_mlp",
)


def fast_ops(platform: object):
    from xhal.platforms.cpu_fast.ops import FastCpuOps

    return FastCpuOps()


class FastAttention:
    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def attention_backend(spec):
        from xhal.platforms.cpu_fast.attention import FastCpuAttention

        return FastCpuAttention(spec)


SOLUTIONS = (
    *(
        Solution(op, "fast", "xhal.platforms.cpu_fast.solutions:fast_ops", _CPU, priority=-5)
        for op in FAST_OPS
    ),
    *(
        Solution(
            op,
            "sdpa",
            "xhal.platforms.cpu_fast.solutions:FastAttention",
            _CPU,
            priority=-5,
            description="batched SDPA over the paged cache, eager only",
        )
        for op in ATTENTION_OPS
    ),
)
