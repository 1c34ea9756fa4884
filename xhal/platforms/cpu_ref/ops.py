"""Reference DeviceOps: plain torch in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xhal.interfaces.ops import DeviceOps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, R] float32; cos, sin: [T, 1, R/2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


class CpuOps(DeviceOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = (x.float() + residual.float()).to(x.dtype)
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
        out = []
        for x in (q, k):
            xf = x.float()
            rotated = _rotate(xf[..., :rotary_dim], cos, sin, is_neox)
            out.append(torch.cat([rotated, xf[..., rotary_dim:]], dim=-1).to(x.dtype))
        return out[0], out[1]

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
        # a stable sort keeps the lower expert index first among equal probabilities
        ids = probs.argsort(dim=-1, descending=True, stable=True)[:, :top_k]  # [T, k]
        weights = probs.gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.to(torch.int32)

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in range(w13.shape[0]):  # one expert at a time, over the tokens that chose it
            tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            gate, up = (x[tokens].float() @ w13[expert].float().T).chunk(2, dim=-1)  # [n, I]
            y = (F.silu(gate) * up) @ w2[expert].float().T  # [n, H]
            out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
        return out.to(x.dtype)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        tokens = []
        for i in range(logits.shape[0]):  # one row at a time: obviously right beats fast here
            row, t = logits[i].float(), float(temperature[i])
            if t == 0.0:
                tokens.append(row.argmax())
                continue
            scaled = row / t
            k = int(top_k[i])
            if 0 < k < scaled.numel():  # top-k first ...
                kth_largest = scaled.topk(k).values[-1]
                scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            # ... then top-p over what is left: keep a token while the mass of the tokens ranked
            # before it is below p (so the most likely token always stays)
            order = probs.argsort(descending=True, stable=True)
            mass_before = probs[order].cumsum(0) - probs[order]
            dropped = order[mass_before >= float(top_p[i])]
            probs[dropped] = 0.0
            tokens.append(torch.multinomial(probs / probs.sum(), 1, generator=generator)[0])
        return torch.stack(tokens).long() if tokens else torch.empty(0, dtype=torch.long)
