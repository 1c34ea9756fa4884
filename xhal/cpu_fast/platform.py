"""The fast CPU platform: the reference platform with ``FastCpuAttention``, declared eager."""

from __future__ import annotations

from dataclasses import replace

from xhal.cpu_fast.attention import FastCpuAttention
from xhal.cpu_fast.ops import FastCpuOps
from xhal.cpu_ref.platform import CpuPlatform
from xhal.interfaces.attention import AttentionSpec


class CpuFastPlatform(CpuPlatform):
    """``cpu-fast``: what the CPU serves with. Collectives and memory queries are the
    reference's, DeviceOps the reference's without its float32 no-op casts (``FastCpuOps``,
    bit-identical); attention is planned once per step and batched (``FastCpuAttention``). No
    graphs: on the CPU a recorded "graph" replays the same kernels with more Python around them.
    Its ops serve "cpu" tensors only when it is the first CPU platform created in the process
    (``xhal.ops.register_platform``), as in ``xhal-serve``."""

    name = "cpu-fast"
    capabilities = replace(
        CpuPlatform.capabilities,
        graphs=False,
        notes=("the reference platform with a batched SDPA attention over the paged cache; eager",),
    )

    def __init__(self) -> None:
        super().__init__()
        self._ops = FastCpuOps()

    def attention_backend(self, spec: AttentionSpec) -> FastCpuAttention:
        self.capabilities.attention.check(spec)
        return FastCpuAttention(spec)
