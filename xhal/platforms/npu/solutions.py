"""The NPU platform's solutions: torch_npu's fused ops ("vendor") where it has them, the
vectorized torch ones beside them where both fit (and alone for linear and gelu_and_mul)."""

from __future__ import annotations

from xhal.solutions.solution import Requirement, Solution

_NPU = Requirement(device_type="npu")
_VENDOR = "xhal.platforms.npu.solutions:npu_ops"
_TORCH = "xhal.platforms.common.torch_ops:TorchOps"


def npu_ops(platform):
    from xhal.platforms.npu.ops import NpuOps

    return NpuOps(platform.torch_npu)


class FiaAttention:
    """``npu_fused_infer_attention_score`` through the platform (its mask and update stream)."""

    def __init__(self, platform) -> None:
        self.attention_backend = platform.fia_attention


SOLUTIONS = (
    *(
        Solution(op, "vendor", _VENDOR, _NPU, 20)
        for op in (
            "rms_norm",
            "fused_add_rms_norm",
            "rotary_embedding",
            "silu_and_mul",
            "moe_route",
            "moe_experts",
            "sampling",
        )
    ),
    *(
        Solution(op, "torch", _TORCH, _NPU, 10)
        for op in (
            "linear",
            "rms_norm",
            "fused_add_rms_norm",
            "silu_and_mul",
            "gelu_and_mul",
            "sampling",
        )
    ),
    *(
        Solution(op, "vendor", "xhal.platforms.npu.solutions:FiaAttention", _NPU, 20)
        for op in ("paged_decode_attention", "paged_prefill_attention")
    ),
)
