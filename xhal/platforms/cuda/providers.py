"""What the CUDA platform's solutions (``solutions.py``) name as their implementations: the device
ops a solution serves (``cuda_ops``, ``flashinfer_ops``, ``tilelang_ops`` and the providers of one
op), and the attention backends' providers, each made with the platform it serves. The solution
table stays data that imports nothing; what it names imports its kernels when it is chosen."""

from __future__ import annotations

import torch

from xhal import env

_WORKSPACE_BYTES = 128 * 1024 * 1024


def cuda_ops(platform: object):
    from xhal.platforms.cuda.ops import CudaOps

    return CudaOps()


def flashinfer_ops(platform: object):
    from xhal.platforms.cuda.ops import FlashInferOps

    return FlashInferOps()


class TritonMlpPair:
    """The gated MLP block as the two fused Triton GEMVs (norm + gate_up, SiLU gate + down): the
    persistent block's peer, and what runs where that block cannot."""

    def __init__(self, platform: object) -> None:
        from xhal.platforms.cuda.ops import CudaOps

        self._ops = CudaOps()

    def add_rms_norm_gated_mlp(self, *args):
        from xhal.interfaces.ops import DeviceOps

        return DeviceOps.add_rms_norm_gated_mlp(self._ops, *args)


def native_moe_ops(platform: object):
    """CudaOps whose ``moe_experts`` runs the persistent expert block where it can."""
    from xhal.platforms.cuda.ops import CudaOps

    return CudaOps(native_moe_block=True)


def native_o_route_ops(platform: object):
    """CudaOps whose ``linear_add_rms_norm_moe_route`` runs gemv_stream.cu's route entry where it
    can."""
    from xhal.platforms.cuda.o_route_ops import NativeORouteOps

    return NativeORouteOps()


class GroupedMoe:
    """The fused MoE without its small-token pair path: the grouped GEMMs for every batch."""

    def __init__(self, platform: object) -> None:
        from xhal.platforms.cuda.kernels import moe

        self._moe = moe

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        config = self._moe.default_config(topk_ids.numel(), w13.shape[0])
        return self._moe.fused_experts(x, w13, w2, topk_weights, topk_ids, config)


_workspaces: dict[torch.device, torch.Tensor] = {}


def _flashinfer_workspace(device: torch.device) -> torch.Tensor:
    """One zeroed workspace per device, shared by every FlashInfer wrapper of both providers
    below (steps run one after another, and each plans before it runs)."""
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _num_sms(platform) -> int:
    return torch.cuda.get_device_properties(platform.device()).multi_processor_count


class FlashInferAttentionProvider:
    def __init__(self, platform) -> None:
        self._device = platform.device()

    def attention_backend(self, spec):
        from xhal.platforms.cuda.attention import FlashInferAttention

        prefill = env.flashinfer_prefill()
        workspace = _flashinfer_workspace(self._device)
        return FlashInferAttention(spec, workspace, prefill_backend=prefill)


def splitkv_seqs(spec) -> tuple[int, int | None]:
    """The decode batches ``triton-splitkv`` runs on the split-KV Triton kernel, ``(first,
    end)``: buckets of ``first`` up to (not including) ``end`` sequences (None: no end);
    FlashInfer's decode for the others. By GQA group, from one decode layer (rotary + KV write +
    attention, as a model runs it) in a CUDA graph, H200, bf16, ctx 2K, pages of 16, us at
    batch 1 / 4 / 16 / 64 (benchmarks/bench_splitkv.py; docs/h200-results.md, eighth session,
    17:22 UTC run; rotary and the KV write inside the split-KV launch):
    - group 4, 32 q / 8 kv heads, D=128: split-KV 10.4 / 20.0 / 42.9 / 127, FlashInfer 14.6 /
      22.3 / 54.2 / 146; D=64: 7.68 / 12.5 / 24.6 / 70.0 against 13.6 / 17.2 / 37.3 / 92.3.
      Every bucket (groups below 4 are not measured).
    - group 8, 32 / 4 heads, D=128: 13.2 / 14.5 / 32.8 / 87.6 against 13.9 / 17.3 / 35.2 /
      84.7: split-KV below 64 sequences, FlashInfer from 64 (the seventh session, with the KV
      write as its own launch, had FlashInfer ahead at batch 1 and 16 and behind at 64).
    """
    return (1, None) if spec.group_size <= 4 else (1, 64)


class SplitKVFlashInferProvider(FlashInferAttentionProvider):
    """FlashInfer attention whose small decode steps run the split-KV Triton kernel."""

    def __init__(self, platform) -> None:
        super().__init__(platform)
        self._sms = _num_sms(platform)

    def attention_backend(self, spec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode

        flashinfer = super().attention_backend(spec)
        return with_splitkv_decode(spec, flashinfer, self._sms, *splitkv_seqs(spec))


class SplitKVBlockProvider(SplitKVFlashInferProvider):
    """``triton-splitkv`` whose one-sequence decode steps run each layer's attention block in one
    persistent launch (``splitkv_block.py``)."""

    def attention_backend(self, spec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode
        from xhal.platforms.cuda.splitkv_block import SplitKVBlockAttention

        flashinfer = FlashInferAttentionProvider.attention_backend(self, spec)
        return with_splitkv_decode(
            spec, flashinfer, self._sms, *splitkv_seqs(spec), backend=SplitKVBlockAttention
        )


def tilelang_ops(platform: object):
    from xhal.platforms.cuda.tilelang_ops import TileLangOps

    return TileLangOps()


class TileLangAttentionProvider:
    """TileLang's split-KV paged decode for the specs it is built for (fp16 / bf16, head dim 128,
    no window or soft cap), the Triton kernel for the rest and for prefill steps."""

    def __init__(self, platform) -> None:
        self._sms = torch.cuda.get_device_properties(platform.device()).multi_processor_count

    def attention_backend(self, spec):
        from xhal.platforms.cuda.tilelang_attention import TileLangAttention, unsupported
        from xhal.platforms.cuda.triton_attention import TritonAttention

        fallback = TritonAttention(spec)
        if unsupported(spec) is not None:
            return fallback
        return TileLangAttention(spec, fallback, self._sms)


class TritonAttentionProvider:
    """The Triton attention: every decode step on the split-KV kernel, the rest on the paged
    attention kernel (one program per token and KV head)."""

    def __init__(self, platform) -> None:
        self._sms = _num_sms(platform)

    def attention_backend(self, spec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode
        from xhal.platforms.cuda.triton_attention import TritonAttention

        return with_splitkv_decode(spec, TritonAttention(spec), self._sms)
