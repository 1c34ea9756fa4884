"""Install / remove the emulated ``torch_npu`` module and the ``torch.npu`` namespace.

Installing ADDS two things to the test process and patches nothing: ``sys.modules["torch_npu"]``
(plus ``torch_npu.npu``) and a new attribute ``torch.npu`` (CPU builds of torch have none).
``uninstall()`` removes exactly those. It refuses to run where a real ``torch_npu`` is loaded.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

from . import fia, graph, moe_ops, ops, registry, runtime, task_update

BANNER = (
    "EMULATED torch_npu -- xhal TEST EMULATION, NOT the real Ascend torch_npu. Plain torch on CPU "
    "tensors behind the real torch-npu wheel's schemas and meta functions; never ship or install "
    "it "
    "as torch_npu."
)

_NPU_NAMES = {
    "NPUGraph": graph.NPUGraph,
    "graph": graph.graph,
    "graph_pool_handle": graph.graph_pool_handle,
    "graph_task_group_begin": graph.graph_task_group_begin,
    "graph_task_group_end": graph.graph_task_group_end,
    "graph_task_update_begin": task_update.graph_task_update_begin,
    "graph_task_update_end": task_update.graph_task_update_end,
    "is_current_stream_capturing": graph.is_current_stream_capturing,
    "ExternalEvent": graph.ExternalEvent,
    "Event": runtime.Event,
    "Stream": runtime.Stream,
    "stream": runtime.stream,
    "current_stream": runtime.current_stream,
    "default_stream": runtime.default_stream,
    "synchronize": runtime.synchronize,
    "set_device": runtime.set_device,
    "current_device": runtime.current_device,
    "is_available": runtime.is_available,
    "device_count": runtime.device_count,
    "mem_get_info": runtime.mem_get_info,
    "empty_cache": runtime.empty_cache,
    "get_device_name": runtime.get_device_name,
}
_OPS = {
    "npu_fused_infer_attention_score": fia.npu_fused_infer_attention_score,
    "_npu_fused_infer_attention_score_get_max_workspace": (
        fia._npu_fused_infer_attention_score_get_max_workspace
    ),
    "npu_scatter_pa_kv_cache": ops.npu_scatter_pa_kv_cache,
    "_npu_reshape_and_cache": ops._npu_reshape_and_cache,
    "npu_scatter_nd_update_": ops.npu_scatter_nd_update_,
    "npu_rms_norm": ops.npu_rms_norm,
    "npu_add_rms_norm": ops.npu_add_rms_norm,
    "npu_swiglu": ops.npu_swiglu,
    "npu_mrope": ops.npu_mrope,
    "_npu_rotary_embedding": ops._npu_rotary_embedding,
    "npu_top_k_top_p": ops.npu_top_k_top_p,
    **moe_ops.OPS,
}


def _module(name: str, attrs: dict) -> types.ModuleType:
    mod = types.ModuleType(name, BANNER)
    mod.__file__ = __file__
    mod.__dict__.update(attrs)
    mod.EMULATION = True
    return mod


def is_installed() -> bool:
    return getattr(sys.modules.get("torch_npu"), "EMULATION", False) is True


def install() -> types.ModuleType:
    """Put the emulated ``torch_npu`` in ``sys.modules``, add ``torch.npu``; return the module."""
    if is_installed():
        return sys.modules["torch_npu"]
    if "torch_npu" in sys.modules or hasattr(torch, "npu"):
        raise RuntimeError(
            "a torch_npu module or torch.npu is already present; the emulation "
            "never shadows a real torch_npu"
        )
    registry.define_all()  # the wheel's schemas (raises wheel.WheelUnavailable without the wheel)
    npu = _module("torch_npu.npu", _NPU_NAMES)
    mod = _module("torch_npu", dict(_OPS))
    mod.__path__ = []  # a package, so `import torch_npu.npu` works
    mod.__version__ = "0.0.0+xhal.emulation"
    mod.npu = npu
    mod.EMULATED_DEVICE = runtime.EMULATED_DEVICE
    mod.EMULATED_DEVICE_TYPE = runtime.EMULATED_DEVICE.type
    mod.EMULATED_DIST_BACKEND = "gloo"  # HCCL is not emulated
    sys.modules.update({"torch_npu": mod, "torch_npu.npu": npu, "torch.npu": npu})
    torch.npu = npu  # the installation step: a NEW attribute, nothing existing is replaced
    return mod


def uninstall() -> None:
    """Remove what ``install()`` added (no-op when it is not installed)."""
    if not is_installed():
        return
    npu = sys.modules["torch_npu"].npu
    for name in ("torch_npu", "torch_npu.npu", "torch.npu"):
        sys.modules.pop(name, None)
    if getattr(torch, "npu", None) is npu:
        del torch.npu
    reset_state()


def reset_state() -> None:
    """Forget parked replays, open captures and an open update (after a failed test)."""
    runtime.blocked_replays.clear()
    runtime.capturing.clear()
    task_update.reset()


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """``with installed() as torch_npu:`` install for the block, uninstall after."""
    mod = install()
    try:
        yield mod
    finally:
        uninstall()
