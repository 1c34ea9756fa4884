"""Stateless device ops: linear, norms, rotary embedding, activations, mixture-of-experts routing
and expert compute, and sampling."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class DeviceOps(ABC):
    """One device's implementations of the stateless ops layers call through ``xhal.ops``.

    Every op is out of place and returns tensors in the input's dtype, computing internally in at
    least float32 and rounding the result once: in bfloat16 / float16 the suite allows 1 ulp from
    the float64 result rounded to the dtype. Inputs may be strided views (a slice of a fused
    projection). Shapes: leading dimensions are free unless stated.

    Registration: every platform ``xhal.platforms.get`` creates has its kernels registered for
    its ``device_type`` (``xhal.ops`` listens through ``xhal.platforms.on_create``), and the first
    platform created for a device type becomes the active one there. A platform whose tensors live
    on another platform's device type (an emulation on "cpu") must make its ops active while it
    runs: ``xhal.ops.activate(device_type, ops)`` from then on, or ``with
    xhal.ops.using(device_type, ops):`` for a block.
    """

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, weight ``[out, in]`` as in ``nn.Linear``. The default is
        torch's GEMM; a platform overrides it where the vendor library is weak (the skinny
        matrices of small decode batches on a GPU) and falls back to it elsewhere."""
        return F.linear(x, weight, bias)

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension."""

    @abstractmethod
    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)``: the new residual is stored in x's
        dtype and the norm is that of the stored residual (the unfused sequence's result)."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first ``rotary_dim`` channels of q ``[T, H, D]`` and k ``[T, Hkv, D]``.

        ``cos_sin_cache`` is float32 ``[max_position, rotary_dim]``: cos in the first half, sin in
        the second. NeoX style pairs channel i with i + rotary_dim/2; GPT-J style pairs 2i with
        2i + 1. Channels past ``rotary_dim`` pass through.
        """

    # The three below have vectorized torch defaults that are right on any device; a platform
    # overrides them with its kernels.

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 2d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]``."""
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    def gelu_and_mul(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """``[..., 2d] -> [..., d]``: ``gelu(x[..., :d]) * x[..., d:]`` (approximate: none|tanh)."""
        gate, up = x.float().chunk(2, dim=-1)
        return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)

    # Fused decode ops. The defaults are the plain unfused sequence (what cpu_ref computes), so a
    # platform without fused kernels is right as it is; a platform overrides one where a kernel
    # saves launches or weight passes, and may fall back to the default for shapes it skips.

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(rms_norm(x + residual), weight, bias), x + residual)``: the residual add and
        RMSNorm that precede a projection (qkv after the input norm, gate_up after the
        post-attention norm). x, residual ``[T, K]``; weight ``[N, K]``; the new residual is the
        sum stored in x's dtype, as ``fused_add_rms_norm`` returns it. A fused kernel may skip
        rounding the normed rows to the dtype before the product (the conformance fused family
        states the tolerance that allows)."""
        normed, summed = self.fused_add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), summed

    def silu_and_mul_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``linear(silu_and_mul(x), weight, bias)``: the gated activation feeding the down
        projection. x ``[T, 2I]`` (gate then up), weight ``[N, I]``."""
        return self.linear(self.silu_and_mul(x), weight, bias)

    def add_rms_norm_gated_mlp(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's gated MLP block after attention: ``(silu_and_mul_linear(
        add_rms_norm_linear(x, residual, norm_weight, eps, gate_up_weight, gate_up_bias)[0],
        down_weight, down_bias), x + residual)``. x, residual ``[T, K]``; gate_up_weight ``[2I,
        K]`` (gate rows, then up rows); down_weight ``[K, I]``. The gate/up projection and the
        activation are rounded to x's dtype as the two ops store them; a fused kernel may skip
        rounding the normed rows, as ``add_rms_norm_linear`` may. The default is those two ops
        (each fused where the platform fuses it)."""
        gate_up, summed = self.add_rms_norm_linear(
            x, residual, norm_weight, eps, gate_up_weight, gate_up_bias
        )
        return self.silu_and_mul_linear(gate_up, down_weight, down_bias), summed

    def qk_rms_norm(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of the queries and keys before rotary, one op: q ``[T, H *
        D]`` and k ``[T, Hkv * D]`` (slices of the fused qkv projection: rows may be strided),
        ``D = q_weight.numel()``; each head's D channels are normed like ``rms_norm``, q's heads
        with ``q_weight``, k's with ``k_weight``. Returns contiguous ``(q [T, H * D], k [T, Hkv
        * D])``. The default is the two norms."""
        head_dim, num_tokens = q_weight.shape[0], q.shape[0]
        q_out = self.rms_norm(q.reshape(-1, head_dim), q_weight, eps)
        k_out = self.rms_norm(k.reshape(-1, head_dim), k_weight, eps)
        return q_out.reshape(num_tokens, -1), k_out.reshape(num_tokens, -1)

    # Mixture of experts. Not abstract so that a platform without MoE models still constructs;
    # such a platform fails the conformance suite's moe family with this message.

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k routing: float ``[T, E]`` -> ``(weights float32 [T, k], ids int32 [T,
        k])``.

        Per token: ``p = softmax(logits)`` over the E experts in float32; the k experts of largest
        ``p`` in descending order, the lowest expert index first among equal probabilities; their
        ``p`` as the weights, divided by their sum when ``renormalize`` (Mixtral, Qwen3-MoE's
        ``norm_topk_prob``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement moe_route")

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' SiLU-gated MLPs, summed with the routing weights: ``[T, H]``.

        ``x [T, H]``; ``w13 [E, 2I, H]`` (each expert's gate rows then its up rows); ``w2 [E, H,
        I]``;
        ``topk_weights`` float32 and ``topk_ids`` int32 ``[T, k]`` as ``moe_route`` returns them.
        ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]``
        and ``g, u = (w13[e] @ x[t]).chunk(2)``. Every (token, expert) pair counts, however many
        tokens an expert gets; an expert no token picks contributes nothing. No host sync:
        graph-safe.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement moe_experts")

    def add_rms_norm_moe_route(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_weight: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The post-attention norm and the router of a mixture-of-experts layer, one fused op:
        ``(router_logits, normed, summed, topk_weights, topk_ids)`` where ``normed, summed =
        fused_add_rms_norm(x, residual, norm_weight, eps)``, ``router_logits = linear(normed,
        gate_weight)`` (``[T, E]`` in x's dtype, gate_weight ``[E, H]``) and the routing is
        ``moe_route(router_logits, top_k, renormalize)`` of those stored logits, so a fused kernel
        routes exactly the logits it returns. The default is that plain sequence."""
        normed, summed = self.fused_add_rms_norm(x, residual, norm_weight, eps)
        router_logits = self.linear(normed, gate_weight)
        topk_weights, topk_ids = self.moe_route(router_logits, top_k, renormalize)
        return router_logits, normed, summed, topk_weights, topk_ids

    def linear_add_rms_norm_moe_route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_weight: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's output projection with the mixture-of-experts router after it, one
        fused op: ``add_rms_norm_moe_route(linear(x, weight), residual, ...)``. A fused kernel
        may feed the router the normed rows before rounding them to the dtype (``normed`` is
        still returned rounded), so its logits may differ from the sequence's by that rounding;
        its routing is ``moe_route`` of the logits it returns, as for
        ``add_rms_norm_moe_route``. The default is the plain sequence."""
        return self.add_rms_norm_moe_route(
            self.linear(x, weight), residual, norm_weight, eps, gate_weight, top_k, renormalize
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy pick: float ``[B, V]`` -> int64 ``[B]`` (lowest index on ties)."""
        return logits.float().argmax(dim=-1)

    @abstractmethod
    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample one token per row: float ``[B, V]`` -> int64 ``[B]``.

        Per row: ``temperature`` float32 ``[B]`` (0 means greedy), ``top_k`` int32 ``[B]`` (0 or
        >= V means off), ``top_p`` float32 ``[B]`` in (0, 1] (1 means off). As in vLLM, top-k is
        applied first (keep the k largest logits; ties at the k-th value are kept), then top-p over
        the renormalized rest of the temperature-scaled probabilities, ``softmax(logits / T)``
        (keep the smallest set of most likely tokens whose probability reaches ``top_p``; the most
        likely token is always kept). Every row uses its own settings: a batch mixes requests.
        The same generator state gives the same tokens.
        """
