"""What the device-op families (``test_ops``, ``test_moe``) share: ``dtype`` runs over every dtype
the platform under test declares for its ops, and the platform's own ops serve its device type
during each test (an emulated platform on CPU tensors must serve "cpu" itself, not the reference
it shadows). A family module imports both names, which pytest then finds in it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from xhal import ops


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        import xhal

        dtypes = xhal.platforms.get(metafunc.config.getoption("--device")).capabilities.ops_dtypes
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])


@pytest.fixture(autouse=True)
def _platform_ops_active(platform) -> Iterator[None]:
    with ops.using(platform.device_type, platform.ops):
        yield
