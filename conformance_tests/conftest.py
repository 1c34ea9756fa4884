"""Fixtures of the conformance suite. The device comes from ``--device NAME``."""

from __future__ import annotations

import pytest
import torch

import xhal
from conformance_tests.coverage import COVERS
from xhal.interfaces.platform import Platform


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernel_ops(*ops): the solution ops a test exercises; it runs once per solution"
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("xhal")
    group.addoption("--device", default="cpu", help="xhal platform name to test (default: cpu)")


@pytest.fixture(scope="session")
def device_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def platform(device_name: str) -> Platform:
    return xhal.platforms.get(device_name)


@pytest.fixture(scope="session")
def device(platform: Platform) -> torch.device:
    return platform.device()


@pytest.fixture
def record_error(request: pytest.FixtureRequest):
    """``record_error(err)`` notes an error seen by a test; the CLI reports the worst per family."""

    def record(err: float) -> None:
        request.node.user_properties.append(("max_error", float(err)))

    return record


@pytest.fixture
def record_coverage(request: pytest.FixtureRequest):
    """``record_coverage(*labels)`` notes the declared capabilities (``coverage`` labels) a test
    exercised; the CLI fails a run in which a declared one was never exercised by a passed test."""

    def record(*labels: str) -> None:
        request.node.user_properties.extend((COVERS, label) for label in labels)

    return record


@pytest.fixture
def kernel_solution(request: pytest.FixtureRequest) -> tuple[str, tuple[str, ...]] | None:
    """``(solution name, ops)`` a test runs under, or None for the platform's own choice
    (``solution_variants`` parametrizes it)."""
    return getattr(request, "param", None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A forced solution that refuses the test's spec (an attention dtype or head dim it does
    not take) is not exercised by that test: a skip with the reason, not a failure."""
    from conformance_tests.solution_variants import SOLUTION, UNMET
    from xhal.solutions import SolutionUnavailable

    try:
        return (yield)
    except SolutionUnavailable as e:
        if getattr(item, "callspec", None) is None or "kernel_solution" not in item.callspec.params:
            raise
        keys = [value for name, value in item.user_properties if name == SOLUTION]
        item.user_properties.extend((UNMET, f"{key}: {e}") for key in keys)
        pytest.skip(f"not exercised: {e}")
