"""The batch-1 MoE chain of a Qwen3-30B-A3B-shaped model on the GPU per PDL setting of the pair
GEMVs (``moe_small.py``), and with the persistent expert block (``moe_block.cu``) in their place:
each layer's fused norm + router + top-k, then the experts, layer after layer (a layer's output
is the next one's input), captured in one CUDA graph, so every PDL launch waits on the kernel it
really follows. Checked against float64 on that layer's own routed inputs after two replays with
different inputs, compared bit for bit with the plain kernels, then timed per layer against the
bytes it must read; last, the persistent block's phase clock in the same chain.

``bench_moe --check`` runs it on the benchmark's model before its steps.
"""

from __future__ import annotations

import torch

from benchmarks.common import capture_graph, phase_rows, time_cuda
from conformance_tests import moe_reference as ref
from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels import moe_block, moe_router, moe_small

LAYERS = 8  # 8 x 76 MB of routed experts per replay: past L2, as in a step
# name -> (gate-up, down) triggers of the pair GEMVs, or the persistent block under PDL with
# its stage widths (moe_block.plan's pairs / down_rows; {}: the plan's own) or late_down
SETTINGS = {
    "plain (tree before)": (pdl.OFF, pdl.OFF),
    "late / late (default)": (pdl.LATE, pdl.LATE),
    "late / early": (pdl.LATE, pdl.EARLY),
    "native block (moe_block.cu)": {},
    "native, 2 pairs a phase-1 stage": {"pairs": 2},
    "native, down stages after the barrier": {"late_down": True},
}


def experts_float64(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``[T, H]`` float64 on the device: each token's routed SiLU-gated MLPs, weighted and summed
    (the moe family's reference, ``moe_reference.experts``, on the GPU: it would copy every
    expert of a 30B layer to the host in float64)."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        chosen = ids[t].long()
        h = torch.einsum("eoh,h->eo", w13[chosen].double(), x[t].double())  # [k, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        act = gate / (1.0 + torch.exp(-gate)) * up
        down = torch.einsum("ehi,ei->eh", w2[chosen].double(), act)  # [k, H]
        out[t] = (weights[t].double()[:, None] * down).sum(0)
    return out


def check_small_experts(model, rate: float) -> tuple[list[dict], list[dict]]:
    """One row per setting: max error against float64 relative to the output's largest magnitude
    (beside the moe family's bf16 tolerance for outputs of magnitude 1), whether
    the outputs equal the plain kernels', us per layer and its ratio to the read floor. Then the
    persistent block's phase clock in the same chain."""
    mlps = [layer.mlp for layer in model.model.layers[:LAYERS]]
    norms = [layer.post_attention_layernorm for layer in model.model.layers[:LAYERS]]
    w13 = mlps[0].experts.w13_weight
    device, dtype, hidden = w13.device, w13.dtype, w13.shape[2]
    g = torch.Generator(device=device).manual_seed(11)
    x = torch.empty(1, hidden, device=device, dtype=dtype)
    residual = torch.empty_like(x)
    top_k = mlps[0].experts.top_k

    def experts_for(setting):
        """The experts' call of a setting: the pair GEMVs with its triggers, or a persistent
        block of its stage widths (kernels and sync words of its own)."""
        if not isinstance(setting, dict):
            return lambda *args: moe_small.small_experts(*args, triggers=setting)
        widths = {k: v for k, v in setting.items() if k != "late_down"}
        block = moe_block.MoeBlock(
            device,
            plan_for=lambda *shape: moe_block.plan(*shape, **widths),
            late_down=setting.get("late_down", False),
        )
        return lambda *args: block(*args, use_pdl=True)

    def fill() -> None:
        x.copy_(torch.randn(x.shape, device=device, generator=g))
        residual.copy_(torch.randn(x.shape, device=device, generator=g))

    def chain(experts) -> list[tuple]:
        hidden_in, res, saved = x, residual, []
        for mlp, norm in zip(mlps, norms):
            _, normed, summed, weights, ids = moe_router.add_rms_norm_route(
                hidden_in, res, norm.weight, norm.eps, mlp.gate.weight, top_k, True
            )
            out = experts(normed, mlp.experts.w13_weight, mlp.experts.w2_weight, weights, ids)
            saved.append((normed, weights, ids, out))
            hidden_in, res = out, summed
        return saved

    expert_bytes = top_k * (w13[0].numel() + mlps[0].experts.w2_weight[0].numel()) * 2
    floor_us = (expert_bytes + mlps[0].gate.weight.numel() * 2) / rate * 1e6
    rows, plain = [], None
    for name, setting in SETTINGS.items():
        fill()
        experts = experts_for(setting)
        chain(experts)  # compiles outside the capture
        outputs: list[tuple] = []

        def captured(experts=experts) -> None:
            outputs[:] = chain(experts)  # capture_graph runs it twice: the captured ones stay

        graph = capture_graph(captured)
        errors, results = [], []
        for replay in range(2):  # new inputs each time: the graph must not bake the routing
            g.manual_seed(100 + replay)
            fill()
            graph.replay()
            torch.cuda.synchronize()
            for (normed, weights, ids, out), mlp in zip(outputs, mlps):
                want = experts_float64(
                    normed, mlp.experts.w13_weight, mlp.experts.w2_weight, weights, ids
                )
                errors.append(float((out.double() - want).abs().max() / want.abs().max()))
            results.append([out.clone() for *_, out in outputs])
        if plain is None:
            plain = results
        same = all(torch.equal(a, b) for r, p in zip(results, plain) for a, b in zip(r, p))
        us = time_cuda(graph.replay, iters=30) * 1e3 / LAYERS
        rows.append({
            "setting": name, "rel_err": max(errors), "tol": ref.EXPERTS_TOLERANCE[dtype],
            "equal_to_plain": same, "us/layer": us, "floor_us": floor_us, "x_floor": us / floor_us,
        })
    # the block's phases in the same chain (the last layer's launch of a replay), built with TIMING
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    timing = torch.zeros(sms, 8, dtype=torch.int64, device=device)
    block = moe_block.MoeBlock(device, timing=timing)
    timed = lambda *args: block(*args, use_pdl=True)  # noqa: E731
    chain(timed)
    graph = capture_graph(lambda: chain(timed))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return rows, phase_rows(timing, moe_block.MoeBlock.MARKS)
