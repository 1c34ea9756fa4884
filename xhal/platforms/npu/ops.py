"""NPU DeviceOps: torch_npu's fused norm, rotary, SwiGLU and top-k/top-p ops, its mixture-of-experts
ops (gating top-k softmax, init routing, grouped matmul, finalize routing), vectorized torch for the
rest (no per-row loops). The rules quoted are the ops' official documentation (docs/npu-ops.md).
"""

from __future__ import annotations

from types import ModuleType

import torch

from xhal.interfaces.ops import DeviceOps
from xhal.platforms.common import sampling

TOP_K_MAX = 1024  # npu_top_k_top_p: k '值域为[1, 1024]，且最大值需要小于等于logits.size(1)'
# npu_mrope: 'BFLOAT16或FLOAT16时，rotary_dim要求是32的倍数，当输入是FLOAT32时...16的倍数'
ROPE_DIM_MULTIPLE = {torch.float16: 32, torch.bfloat16: 32, torch.float32: 16}


class NpuOps(DeviceOps):
    def __init__(self, torch_npu: ModuleType) -> None:
        self.npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # (y, rstd); gamma '数据类型需要和self保持一致', self '输入shape支持2-8维'
        x2 = x.unsqueeze(0) if x.dim() == 1 else x  # one row: [1, H]
        y, _ = self.npu.npu_rms_norm(x2, weight.to(x.dtype), eps)
        return y.view(x.shape)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (y, rstd, x1 + x2), inputs untouched: the third output is the new residual (the meta
        # function's outputs; 2.14.0 ships no doc for this op)
        y, _, summed = self.npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), eps)
        return y, summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # both ops take 2-D q/k [T, N*D] with head_size D and a [max_pos, R] cache, R <= D (partial
        # rotary passes channels R.. through). npu_mrope: 'queryIn、keyIn、cosSinCache只支持2维',
        # ''half'表示rotate_half(GPT-NeoX style)', ''interleave'表示rotate_interleaved(GPT-J
        # style)'; the cache's dtypes (BF16/FP16/FP32) are listed apart from the query's, so the
        # float32 cache the DeviceOps contract hands over is passed as it is
        num_tokens, head_dim, rotary_dim = q.shape[0], q.shape[-1], cos_sin_cache.shape[-1]
        q2 = q.reshape(num_tokens, -1)  # [T, H*D]
        k2 = k.reshape(num_tokens, -1)  # [T, Hkv*D]
        multiple = ROPE_DIM_MULTIPLE.get(q.dtype)
        if multiple is not None and rotary_dim % multiple == 0:
            q_out, k_out = self.npu.npu_mrope(
                positions.long(), q2.contiguous(), k2.contiguous(), cos_sin_cache, head_dim,
                rotary_mode="half" if is_neox else "interleave",
            )
        else:  # npu_mrope's rotary_dim rule excludes the shape; the ATB op states none
            q_out, k_out = q2.clone(), k2.clone()
            self.npu._npu_rotary_embedding(
                positions.long(), q_out, k_out, head_dim, cos_sin_cache, is_neox
            )
        return q_out.view(q.shape), k_out.view(k.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # 'swish(A) * B', A and B the halves of x along dim
        return self.npu.npu_swiglu(x.contiguous(), dim=-1)

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # y '数据类型与x需要保持一致': float32 logits keep the top-k softmax values float32;
        # k '0<k<=x的-1轴大小, k<=1024'
        weights, ids, _ = self.npu.npu_moe_gating_top_k_softmax(
            router_logits.float(), None, k=top_k
        )
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        num_experts = w13.shape[0]
        # row_idx[t, j] = j * T + t: the original-row layout init and finalize routing share
        row_idx = torch.arange(num_tokens * top_k, dtype=torch.int32, device=x.device)
        row_idx = row_idx.view(top_k, num_tokens).t().contiguous()
        expanded_x, expanded_row_idx, sorted_experts = self.npu.npu_moe_init_routing(
            x.contiguous(), row_idx, topk_ids.int(), num_tokens
        )  # expanded_x: [T*k, H], rows grouped by expert
        # each expert's end row in int32 (num_expert '取值范围为(0, 2048]'); group_list
        # '数据类型支持torch.int64', with group_list_type 0 '分组轴大小的cumsum结果'
        ends = self.npu.npu_moe_compute_expert_tokens(sorted_experts, num_experts).long()
        # group_type 0, one x and one 3-D weight: '仅支持split_item为2或3. weight中tensor需为3维',
        # '最多支持1024个group. 支持weight转置. x不支持转置': weights [E, N, K] go in as
        # transposed views [E, K, N], x contiguous
        gate_up = self.npu.npu_grouped_matmul(
            [expanded_x],
            [w13.transpose(1, 2)],
            group_list=ends,
            split_item=2,
            group_type=0,
            group_list_type=0,
        )[0]  # [T*k, 2I]
        act = self.npu.npu_swiglu(gate_up, dim=-1)  # [T*k, I]
        down = self.npu.npu_grouped_matmul(
            [act],
            [w2.transpose(1, 2)],
            group_list=ends,
            split_item=2,
            group_type=0,
            group_list_type=0,
        )[0]  # [T*k, H]
        # scales '数据类型要求与expanded_permuted_rows一致'; drop_pad_mode '取值范围为0'
        return self.npu.npu_moe_finalize_routing(
            down,
            None,
            None,
            None,
            topk_weights.to(down.dtype),
            expanded_row_idx,
            topk_ids.int(),
            drop_pad_mode=0,
            k=top_k,
        )

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        vocab = logits.shape[-1]

        def top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            # npu_top_k_top_p takes k in [1, 1024]: with every row there (or a vocab that small)
            # the op filters; otherwise the whole batch takes the torch path. One scalar read.
            if vocab <= TOP_K_MAX or bool((k <= TOP_K_MAX).all()):
                return self.npu.npu_top_k_top_p(scaled, p.to(scaled.dtype), k.to(torch.int32))
            return sampling.top_k_top_p_filter(scaled, k, p)

        # softmax, then an exponential race: a multinomial draw with no host sync (as vllm-ascend)
        return sampling.sample(logits, temperature, top_k, top_p, generator, top_k_top_p)
