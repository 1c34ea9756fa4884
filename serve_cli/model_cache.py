"""Checkpoint directories xhal-serve generates once and keeps under the cache directory
(``XHAL_CACHE_DIR``, default ``~/.cache/xhal``): the built-in tiny random model and GGUF files
converted to safetensors."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    if cache_dir is None:
        from xhal import env

        cache_dir = env.cache_dir()
    return Path(cache_dir)


def ensure_cached(
    name: str,
    write: Callable[[Path], None],
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """``cache_dir / name``, written by ``write(tmp_dir)`` on first use. ``write`` fills a
    temporary directory that is then renamed into place, so a reader never sees a half-written
    checkpoint, an interrupted write leaves nothing behind, and concurrent first calls are safe
    (the first rename wins; the others find the finished directory)."""
    root = cache_root(cache_dir)
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a concurrent writer winning the race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
