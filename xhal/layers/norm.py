"""RMSNorm, plain or fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from xhal import ops


class RMSNorm(nn.Module):
    """``forward(x)`` returns ``rms_norm(x)``; ``forward(x, residual)`` returns
    ``(rms_norm(x + residual), x + residual)``: the new residual travels with the output (vLLM)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
