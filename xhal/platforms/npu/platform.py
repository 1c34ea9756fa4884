"""The Ascend NPU platform, on torch_npu. The op rules quoted across ``xhal/platforms/npu`` are from
the official documentation shipped in the torch-npu wheel (``torch_npu/_op_plugin_docs.py``),
collected with their sources in docs/npu-ops.md."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.platform import AttentionCapabilities, Capabilities, Platform
from xhal.platforms.common.collective import SingleRankCollective, resolve_group

if TYPE_CHECKING:
    from xhal.interfaces.ops import DeviceOps
    from xhal.platforms.npu.attention import NpuAttention
    from xhal.platforms.npu.graph import NpuGraphRunner

_INSTALL_HELP = (
    "the NPU platform needs torch_npu (Ascend's PyTorch adapter) on top of Ascend's CANN toolkit: "
    "install CANN, `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, then install torch and "
    "torch-npu as a matching pair, e.g. `pip install torch==2.10.0 torch-npu==2.10.0.post4` "
    "(docs/npu.md lists the pairings). Note: once torch-npu is installed, `import torch` itself "
    "fails on a machine without CANN unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set"
)


def import_torch_npu() -> ModuleType:
    """``import torch_npu``, or one ``RuntimeError`` saying what to install (without CANN the
    import fails, e.g. with ``libhccl.so: cannot open shared object file``)."""
    try:
        import torch_npu
    except (ImportError, OSError, RuntimeError) as err:
        raise RuntimeError(f"{_INSTALL_HELP} (import torch_npu failed: {err})") from err
    return torch_npu


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    metadata_convention = "npu"  # xLLM's Ascend build lays lengths out per sequence
    dist_backend = "hccl"
    capabilities = Capabilities(
        attention=AttentionCapabilities(
            # FIA page attention: '支持key、value数据类型为float16、bfloat16、int8' (int8 needs
            # quantization arguments xhal does not pass)
            dtypes=(torch.bfloat16, torch.float16),
            # the doc allows D <= 512, 16-aligned; 128 is the one head dim declared until hardware
            # runs the suite (the doc's "TND ... Q_D、K_D等于192" limits belong to its MLA block)
            head_dims=(128,),
            # FIA page attention with Q_S > 1: 'block_size最小为128, 最大为512, 且要求是128的倍数'
            # (Q_S = 1 only asks 16-aligned, <= 512; a served batch may prefill, so 128s rule)
            block_sizes=(128,),
            block_size_multiple=128,
            # FIA reads the executor's [nb, bs, Hkv, D] cache as (blocknum, blocksize, H) by a free
            # view (NHD, the default: the cache contract every host and the suite use, and
            # npu_scatter_pa_kv_cache's ND scenario); XHAL_NPU_KV_LAYOUT=HND gives the
            # [nb, Hkv, bs, D] cache FIA's doc recommends ('kv cache排布为(blocknum, KV_N,
            # blocksize, D)时性能通常优于...(blocknum, blocksize, H)') and needs past KV_N*D 65535
            kv_cache_layouts=("NHD", "HND"),
            sliding_window=True,  # FIA sparse_mode=4: '代表band模式的mask'
            logits_soft_cap=False,  # FIA has no soft cap
        ),
        ops_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        notes=(
            "attention: one npu_fused_infer_attention_score call (TND, paged) per layer and step",
            "graphs: FIA host arguments updated at every replay (graph_task_update_begin/end)",
        ),
    )
    max_block_size = 512  # FIA page attention: 'block_size最小为128, 最大为512'

    def __init__(self) -> None:
        self.torch_npu = import_torch_npu()
        self._mask: torch.Tensor | None = None
        self._update_stream = None
        from xhal.solutions.kernels import Kernels
        from xhal.solutions.solution import DeviceInfo

        versions = (
            ("torch", torch.__version__),
            ("torch_npu", str(getattr(self.torch_npu, "__version__", ""))),
        )
        self._kernels = Kernels(self, DeviceInfo("npu", name="npu", library_versions=versions))
        self._ops = self._kernels.ops

    @classmethod
    def is_available(cls) -> bool:
        try:
            npu = getattr(torch, "npu", None)  # present once torch_npu is imported (or autoloaded)
            if npu is not None:
                return bool(npu.is_available())
            # find_spec only: importing torch_npu is heavy and fails without CANN
            return importlib.util.find_spec("torch_npu") is not None
        except Exception:  # noqa: BLE001  (never raises, whatever a broken install does)
            return False

    @property
    def ops(self) -> DeviceOps:
        return self._ops

    @property
    def kernels(self):
        return self._kernels

    def check_block_size(self, spec: AttentionSpec) -> None:
        if spec.block_size % 128 or spec.block_size > self.max_block_size:
            raise ValueError(
                f"block_size {spec.block_size} is not supported on the NPU: "
                "npu_fused_infer_attention_score's paged attention needs a multiple of 128 "
                f"between 128 and {self.max_block_size} (use --block-size 128)"
            )

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        self.check_block_size(spec)
        self.capabilities.attention.check(spec)
        return self._kernels.attention_backend(spec)

    def fia_attention(self, spec: AttentionSpec) -> NpuAttention:
        """The "vendor" attention solution (``xhal/platforms/npu/solutions.py``): one FIA call per
        layer."""
        from xhal.platforms.npu.attention import NpuAttention

        layout = env.npu_kv_layout()
        if layout not in self.capabilities.attention.kv_cache_layouts:
            raise ValueError(f"XHAL_NPU_KV_LAYOUT={layout} is not a declared layout")
        return NpuAttention(
            spec, self.torch_npu, self.causal_mask(), self.update_stream(), kv_layout=layout
        )

    def causal_mask(self) -> torch.Tensor:
        """The one 2048x2048 int8 mask sparse modes 2-4 take, 1 above the diagonal (masked), built
        once per process as vllm-ascend's ``get_splitfuse_attn_mask`` does (FIA: 'sparse_mode=2、
        3、4时, atten_mask的shape需要为(S, S)... S的值需要固定为2048')."""
        if self._mask is None:
            ones = torch.ones(2048, 2048, dtype=torch.int8)
            self._mask = torch.triu(ones, diagonal=1).to(self.device())
        return self._mask

    def update_stream(self):
        """The side stream FIA task updates are issued on; it must differ from the capture stream
        (``graph_task_update_begin(stream, handle)`` re-records tasks of another stream)."""
        if self._update_stream is None:
            self._update_stream = torch.npu.Stream()
        return self._update_stream

    def graph_runner(self) -> NpuGraphRunner:
        from xhal.platforms.npu.graph import NpuGraphRunner

        return NpuGraphRunner()

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        from xhal.platforms.npu.collective import HcclCollective

        group = resolve_group(group)
        return SingleRankCollective() if group is None else HcclCollective(group, self.device())

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("npu", torch.npu.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        # before init_process_group, as vllm-ascend's worker does
        torch.npu.set_device(index)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.npu.mem_get_info()
        return int(free), int(total)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()
