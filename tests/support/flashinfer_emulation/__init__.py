"""A CPU emulation of the FlashInfer 0.5.3 API that ``xhal.platforms.cuda.attention`` calls. TESTS
ONLY.

``install()`` puts the emulated module (``flashinfer_emulation.module``) at
``sys.modules["flashinfer"]``; ``uninstall()`` takes it away again. The plugin
(``tests.support.flashinfer_emulation.plugin``) registers a platform whose attention is
``FlashInferAttention`` itself over this module, so the backend's own bookkeeping (the host page
table, graph buckets, when the scheduler reruns) goes through the conformance suite on any CPU.

What is emulated, and how closely (the 0.5.3 Python and C++ sources were read for each point):

- ``BatchDecodeWithPagedKVCacheWrapper``: the constructor's buffers and checks, ``plan`` (copies
  into the caller's buffers in graph mode, the compiled module's ``plan`` with 0.5.3's positional
  arguments: 19 for tensor-core decode, the FA2 prefill module's, 15 for CUDA-core decode) and
  ``run`` (the module's ``paged_run`` / ``run`` with 0.5.3's argument lists).
- The compiled modules check every argument they get (count, types, host or device, values), so a
  call that drifted from 0.5.3's layout fails here, not first on a GPU.
- The scheduler's output depends on the page indptr alone (0.5.3's ``PrefillSplitQOKVIndptr``
  takes ``kv_len`` from ``kv_indptr``; the ``kv_len_arr`` argument is unused), and the emulated
  plan writes exactly that to the int workspace. The emulated kernel takes each sequence's page
  count from that schedule and its first page, page ids and last-page length from the live
  buffers, as the real kernels' work split comes from the plan: replaying after a sequence gained
  a page without re-planning reads too few pages and gives wrong numbers, as it would on a GPU.
- ``BatchPrefillWithPagedKVCacheWrapper``: ``plan`` and ``run`` with the keywords 0.5.3 takes,
  causal (bottom-right aligned) or not; eager only, like FlashInfer's prefill in graphs.

``module.py`` holds the wrappers, ``compiled.py`` the compiled modules' ``plan`` and the decode
kernel, a custom op (``xhal_fi_emu``) that the CPU graph runner records as one device call reading
its buffers when it runs. Numbers come from ``xhal.platforms.cpu_ref``'s attention math.
"""

from __future__ import annotations

import sys

from . import module

__all__ = ["install", "module", "uninstall"]


def install() -> None:
    """Make ``import flashinfer`` give the emulation (a real FlashInfer must not be loaded)."""
    current = sys.modules.get("flashinfer")
    if current is not None and current is not module:
        raise RuntimeError("a real flashinfer is already imported; the emulation would shadow it")
    sys.modules["flashinfer"] = module


def uninstall() -> None:
    if sys.modules.get("flashinfer") is module:
        del sys.modules["flashinfer"]
