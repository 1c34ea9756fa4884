"""A CPU emulation of the torch_npu API the NPU backend calls. TESTS ONLY: never the real thing.

``install()`` adds ``sys.modules["torch_npu"]`` and ``torch.npu``; ``uninstall()`` removes them.
See README.md in this folder for the emulated ops, their argument conventions and checks.

Every emulated op speaks the real API of the pinned torch-npu wheel (``wheel.py``: version pinned
there, fetched once into ``$XHAL_CACHE_DIR``, never installed; ``WheelUnavailable`` when it cannot
be had). Adding an op is one line with ``registry.real_op``::

    from .registry import real_op

    def _gating(x, finished=None, k=1):     # the op's schema arguments and defaults, plain torch
        ...

    npu_moe_gating_top_k_softmax = real_op("npu_moe_gating_top_k_softmax", _gating)

then list it in ``install._OPS``. ``real_op(name, kernel)`` takes the schema of ``name`` from the
wheel's ``npu_native_functions_by_codegen.yaml`` (or, for an ATB op, derives it from
``AtbOpsInterface.h``), defines ``torch.ops.npu_emu.<name>`` under it, and on every call binds the
Python arguments as torch_npu's binding does (TypeError on a wrong keyword or type), runs the
wheel's meta function from ``_meta_registrations.py`` (loaded by ``real_meta.py`` with a stub set to
an Atlas A2, CANN 8.5.0), runs ``kernel``, and checks its outputs against the meta function's
shapes and dtypes. ``overloads={"out": kernel_out}`` adds ``.out``-style overloads, ``meta_from=``
borrows another op's meta function, ``dispatch=`` intercepts the call (FIA's graph updates).
Calls are counted in ``registry.COUNTS`` (``XHAL_NPU_EMULATION_COUNTS=DIR`` writes them per
process). Kernels should quote the op's documentation (the wheel's ``_op_plugin_docs.py``) in their
error messages and in docs/npu-ops.md.
"""

from __future__ import annotations

from .install import BANNER, install, installed, is_installed, reset_state, uninstall

__all__ = ["BANNER", "install", "installed", "is_installed", "reset_state", "uninstall"]
