"""Float64 references for the moe family, independent of every backend (the reference platform
included): routing by an explicit sort, experts computed densely token by token.

Tolerances (absolute, on outputs of magnitude O(1)): routing weights are one float32 softmax away
from float64 (1e-5); the expert compute rounds its input, weights, the gated activation and
the output, each once in bfloat16 (relative step 3.9e-3), hence 3e-2.

| part    | float32 | bfloat16 | float16 |
|---------|---------|----------|---------|
| routing | 1e-5    | 1e-5 (weights are float32 from logits of any dtype) |
| experts | 1e-4    | 3e-2     | 8e-3    |
"""

from __future__ import annotations

import torch

ROUTING_TOLERANCE = 1e-5
EXPERTS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 8e-3}


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float64 [T, k], ids int64 [T, k])``: per token the k largest softmax
    probabilities, descending, the lower expert index first among equal ones."""
    logits = router_logits.detach().cpu().double()
    ids, weights = [], []
    for row in logits:
        p = torch.exp(row - row.max())
        p = p / p.sum()
        # an explicit key: larger probability first, then lower index
        order = sorted(range(p.numel()), key=lambda e: (-float(p[e]), e))[:top_k]
        w = p[order]
        weights.append(w / w.sum() if renormalize else w)
        ids.append(torch.tensor(order))
    if not ids:
        return torch.empty(0, top_k, dtype=torch.float64), torch.empty(0, top_k, dtype=torch.long)
    return torch.stack(weights), torch.stack(ids)


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """float64 ``[T, H]``: for each token, the weighted sum of its experts' SiLU-gated MLPs
    (the first half of ``w13[e]``'s rows is the gate, the second the up projection)."""
    x, w13, w2 = (t.detach().cpu().double() for t in (x, w13, w2))
    weights, ids = topk_weights.detach().cpu().double(), topk_ids.detach().cpu().long()
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]  # [2I]
            gate, up = h[:inter], h[inter:]
            act = gate / (1.0 + torch.exp(-gate)) * up
            out[t] += weights[t, j] * (w2[e] @ act)
    return out


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    if out.shape != expected.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != expected {tuple(expected.shape)}")
    if out.numel() == 0:
        return 0.0
    return float((out.detach().cpu().double() - expected).abs().max())
