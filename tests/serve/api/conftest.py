"""The live server the API tests of this folder share, one per test module."""

from __future__ import annotations

import pytest

from tests.support.launcher import ServerProcess
from tests.support.tiny_server import tiny_server_args


@pytest.fixture(scope="module")
def server():
    """The built-in tiny random model (generated once into XHAL_CACHE_DIR): fast anywhere."""
    with ServerProcess(tiny_server_args("--log-level", "warning")) as srv:
        yield srv
