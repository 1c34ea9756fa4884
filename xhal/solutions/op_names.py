"""The ops that have solutions, each with the provider attribute that implements it."""

from __future__ import annotations

# op -> the provider's attribute (a DeviceOps method, or ``attention_backend(spec)``)
OPS: dict[str, str] = {
    "linear": "linear",
    "rms_norm": "rms_norm",
    "fused_add_rms_norm": "fused_add_rms_norm",
    "rotary_embedding": "rotary_embedding",
    "silu_and_mul": "silu_and_mul",
    "gelu_and_mul": "gelu_and_mul",
    "add_rms_norm_linear": "add_rms_norm_linear",
    "silu_and_mul_linear": "silu_and_mul_linear",
    "add_rms_norm_gated_mlp": "add_rms_norm_gated_mlp",
    "qk_rms_norm": "qk_rms_norm",
    "moe_route": "moe_route",
    "moe_experts": "moe_experts",
    "add_rms_norm_moe_route": "add_rms_norm_moe_route",
    "linear_add_rms_norm_moe_route": "linear_add_rms_norm_moe_route",
    "sampling": "sample",
    "paged_decode_attention": "attention_backend",
    "paged_prefill_attention": "attention_backend",
}
DEVICE_OPS = tuple(op for op in OPS if not op.startswith("paged_"))
ATTENTION_OPS = ("paged_decode_attention", "paged_prefill_attention")


def env_name(op: str) -> str:
    """``XHAL_KERNEL_<OP>``, the setting that forces ``op``'s solution."""
    return f"XHAL_KERNEL_{op.upper()}"
