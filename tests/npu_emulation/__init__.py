"""A CPU emulation of the torch_npu API the NPU backend calls. TESTS ONLY: never the real thing.

``install()`` adds ``sys.modules["torch_npu"]`` and ``torch.npu``; ``uninstall()`` removes them.
See README.md in this folder for the emulated ops, their argument conventions and checks.
"""

from __future__ import annotations

from .install import BANNER, install, installed, is_installed, reset_state, uninstall

__all__ = ["BANNER", "install", "installed", "is_installed", "reset_state", "uninstall"]
