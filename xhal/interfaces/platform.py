"""A device's bundle of implementations, and what it declares it can do."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from xhal.interfaces.metadata import BatchKind

if TYPE_CHECKING:
    import torch.distributed as dist

    from xhal.interfaces.attention import AttentionBackend, AttentionSpec
    from xhal.interfaces.collective import Collective
    from xhal.interfaces.graph import GraphRunner
    from xhal.interfaces.ops import DeviceOps


# The version of these interfaces (the four ABCs, the dataclasses, the metadata contract).
# Compatibility policy: within one version, changes are additive only (new optional fields with
# defaults, new methods with default implementations, wider accepted inputs); anything that can
# break a plugin written against it (a new abstract method, a changed signature or invariant)
# raises the version. A platform states the version it was written for in ``interface_version``
# and ``xhal.platforms.get`` refuses one written for another version, naming both.
INTERFACE_VERSION = 1


@dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention backend supports: real limits of the hardware or kernels, not a wish list.

    The conformance suite derives its grid from this declaration: every dtype, head dim and block
    size listed here (and the sliding window and soft cap when declared) gets numeric cases, and
    ``xhal-conformance`` fails when a declared value was never exercised.

    - ``head_dims``: the head dims the backend runs. With ``any_head_dim=True`` every positive
      head dim is accepted and ``head_dims`` is the representative sample the suite tests (include
      a small one, such as 16, and the largest you expect, such as 256).
    - ``block_sizes``: the block sizes the suite tests; ``attention_backend`` accepts any multiple
      of ``block_size_multiple``.
    """

    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    block_sizes: tuple[int, ...]  # the sizes the suite tests
    batch_kinds: frozenset[BatchKind] = frozenset(
        {BatchKind.PREFILL, BatchKind.CHUNKED_PREFILL, BatchKind.DECODE, BatchKind.MIXED}
    )
    block_size_multiple: int = 1  # any block size must be a multiple of this
    sliding_window: bool = False
    logits_soft_cap: bool = False
    # paged cache layouts the backend can run on: "NHD" = [num_blocks, block_size, num_kv_heads,
    # head_dim] is the contract layout (xLLM's KVCacheShape): what the executor allocates, the suite
    # builds and kv_cache_shape returns by default. "HND" = [num_blocks, num_kv_heads, block_size,
    # head_dim] is an opt-in of a backend setting (XHAL_NPU_KV_LAYOUT=HND) for hosts that allocate
    # by kv_cache_shape themselves; the executor and the suite do not run it yet.
    kv_cache_layouts: tuple[str, ...] = ("NHD",)
    any_head_dim: bool = False  # every head dim works; head_dims is then the sample tested

    def supports_head_dim(self, head_dim: int) -> bool:
        return head_dim > 0 if self.any_head_dim else head_dim in self.head_dims

    def check(self, spec: AttentionSpec) -> None:
        """Raise ``ValueError`` saying what is supported when a spec is outside the declaration."""
        if spec.dtype not in self.dtypes:
            raise ValueError(f"dtype {spec.dtype} is not supported; supported: {list(self.dtypes)}")
        if not self.supports_head_dim(spec.head_dim):
            raise ValueError(
                f"head_dim {spec.head_dim} is not supported; supported: {list(self.head_dims)}"
            )
        if spec.block_size % self.block_size_multiple:
            raise ValueError(
                f"block_size {spec.block_size} is not supported: it must be a multiple of "
                f"{self.block_size_multiple} (tested: {list(self.block_sizes)})"
            )
        if spec.sliding_window is not None and not self.sliding_window:
            raise ValueError(
                f"sliding_window={spec.sliding_window} is not supported by this backend; "
                "use a platform that declares sliding_window=True"
            )
        if spec.logits_soft_cap is not None and not self.logits_soft_cap:
            raise ValueError(
                f"logits_soft_cap={spec.logits_soft_cap} is not supported by this backend; "
                "use a platform that declares logits_soft_cap=True"
            )


@dataclass(frozen=True)
class Capabilities:
    """Everything a platform declares, once, as data."""

    attention: AttentionCapabilities
    graphs: bool = True  # graph_runner() captures and replays
    collective: bool = True  # collective() works across processes
    ops_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    notes: tuple[str, ...] = field(default_factory=tuple)


class Platform(ABC):
    """One device's implementations of the four interfaces plus the runtime services the executor
    needs, so that no hardware-neutral code touches ``torch.cuda`` or ``torch.npu``.

    Invariants: the class is constructed with no arguments (the registry calls ``cls()``, once
    per process); constructing it imports its device libraries and fails with one clear message
    naming a missing package and how to install it; ``is_available()`` never raises and never
    imports heavy libraries; ``attention_backend`` raises ``ValueError`` for a spec outside
    ``capabilities``. ``name``, ``device_type``, ``dist_backend``, ``capabilities``,
    ``metadata_convention`` and ``async_scheduling`` are class attributes, readable without
    creating the platform (hosts read them before they pick a device).
    """

    name: ClassVar[str]
    device_type: ClassVar[str]  # torch device type of the tensors this platform works on
    dist_backend: ClassVar[str]  # torch.distributed backend: gloo, nccl, hccl
    capabilities: ClassVar[Capabilities]
    # The xLLM metadata layout a host builds for this device ("cuda" or "npu": see
    # xhal.adapter); xLLM's Ascend build uses "npu", every other build "cuda".
    metadata_convention: ClassVar[str] = "cuda"
    # Whether a host should build step N+1 while step N runs (device work is queued, so the
    # host has time to hide); False where execute() runs synchronously, as on the CPU.
    async_scheduling: ClassVar[bool] = True
    # The interface version this platform was written against; a plugin pins it as a literal
    # (``interface_version = 1``) so that an incompatible xhal refuses it instead of misbehaving.
    interface_version: ClassVar[int] = INTERFACE_VERSION

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine can run the platform (cheap; never raises)."""

    @property
    @abstractmethod
    def ops(self) -> DeviceOps: ...

    @abstractmethod
    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend: ...

    @property
    def kernels(self) -> object | None:
        """The kernel solutions chosen for this platform (an ``xhal.solutions.kernels.Kernels``:
        typed loosely, since the interfaces sit below the solutions and import nothing of them), or
        None for a platform that does not build its ops from solutions. The conformance suite
        runs every solution it lists, not only the chosen ones."""
        return None

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Lay out a loaded model's parameters the way this platform's ops read them fastest;
        ``ModelExecutor`` calls it once, before any step, on weights that are final (loaded, not
        written afterwards). It may change strides and storage, or keep derived copies, only:
        every parameter keeps its shape, dtype, device and values, and shared (tied) parameters
        stay one object. Default: nothing to change."""

    @abstractmethod
    def graph_runner(self) -> GraphRunner: ...

    @abstractmethod
    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        """A collective over ``group`` (the default group when None and one is initialized;
        a single-rank collective when torch.distributed is not initialized)."""

    # Runtime services -------------------------------------------------------------------------

    def device(self, index: int | None = None) -> torch.device:
        """The torch device of this process (``index`` picks another one where there are
        several)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, 0 if index is None else index)

    def set_device(self, index: int) -> None:
        """Make device ``index`` current for this process (before ``init_process_group``)."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    def mem_get_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the current device."""
        raise NotImplementedError(f"platform {self.name!r} does not report memory")

    def empty_cache(self) -> None:
        """Give the allocator's cached, unused blocks back to the device, so that
        ``mem_get_info`` counts only memory in use (nothing to do where there is no cache)."""

    def init_process_group(
        self, rank: int, world_size: int, init_method: str, local_rank: int | None = None
    ) -> dist.ProcessGroup:
        """Initialize the default process group with this platform's backend and return it."""
        import torch.distributed as dist

        self.set_device(rank if local_rank is None else local_rank)
        dist.init_process_group(
            backend=self.dist_backend, init_method=init_method, rank=rank, world_size=world_size
        )
        return dist.group.WORLD
