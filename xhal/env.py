"""Typed environment settings, all under the ``XHAL_`` prefix, read in this one module."""

from __future__ import annotations

import os


def plugins() -> list[str]:
    """``XHAL_PLUGINS``: comma-separated modules imported before platforms are looked up; each may
    call ``xhal.platforms.register``. Child processes inherit it, so a plugin registered this way
    is visible in spawned ranks too."""
    raw = os.environ.get("XHAL_PLUGINS", "")
    return [m.strip() for m in raw.split(",") if m.strip()]


def cache_dir() -> str:
    """``XHAL_CACHE_DIR``: where generated artefacts (the built-in default model) are kept."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "xhal")
    return os.environ.get("XHAL_CACHE_DIR", default)
