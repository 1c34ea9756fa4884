"""Where the checkout is, for tests that read its files or start subprocesses in it."""

from __future__ import annotations

from pathlib import Path

# tests/support/paths.py -> the repository root, however deep the test that asks sits
REPO = Path(__file__).resolve().parents[2]
