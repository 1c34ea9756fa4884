"""What the device-op families (``test_ops``, ``test_moe``) share: ``dtype`` runs over every dtype
the platform under test declares for its ops, a test of an op runs once per solution of that op
(``solution_variants``), and the platform's own ops serve its device type during each test (an
emulated platform on CPU tensors must serve "cpu" itself, not the reference it shadows). A family
module imports both names, which pytest then finds in it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conformance_tests import solution_variants


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        import xhal

        dtypes = xhal.platforms.get(metafunc.config.getoption("--device")).capabilities.ops_dtypes
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])
    solution_variants.parametrize(metafunc)


@pytest.fixture(autouse=True)
def _platform_ops_active(
    request: pytest.FixtureRequest, platform, kernel_solution
) -> Iterator[None]:
    with solution_variants.solution_active(request, platform, kernel_solution):
        yield
