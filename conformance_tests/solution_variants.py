"""Every registered solution is run, not only the chosen one: a test that exercises an op is
parametrized over that op's solutions (``kernel_solution``), each made active for the test.

A solution the machine cannot run (a missing package, a dtype it does not take) makes its test
skip with the reason; the CLI then lists it as not exercised. Platforms that build no ops from
solutions (``platform.kernels is None``), or that replaced the ops their solutions built (a
test's broken platform), run each test once on what they serve."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from xhal import ops
from xhal.interfaces.platform import Platform
from xhal.solutions.op_names import ATTENTION_OPS

SOLUTION = "solution"  # user property: the "op=name" a test ran
UNMET = "solution_unmet"  # user property: why that solution was not exercised

# test name prefix -> the ops a test exercises; the longest matching prefix wins. A new test
# (a fused op's family) says it with ``@pytest.mark.kernel_ops("op", ...)`` instead.
DEVICE_OP_TESTS: dict[str, tuple[str, ...]] = {
    "test_linear": ("linear",),
    "test_rms_norm": ("rms_norm",),
    "test_fused_add_rms_norm": ("fused_add_rms_norm",),
    "test_rotary_embedding": ("rotary_embedding",),
    "test_silu_and_mul": ("silu_and_mul",),
    "test_gelu_and_mul": ("gelu_and_mul",),
    "test_route": ("moe_route",),
    "test_route_and_experts": ("moe_route", "moe_experts"),
    "test_experts": ("moe_experts",),
    "test_per_row_sampling": ("sampling",),
    "test_same_generator": ("sampling",),
    "test_sampling": ("sampling",),
    "test_temperature_zero": ("sampling",),
    "test_top_k": ("sampling",),
    "test_top_p": ("sampling",),
}


def ops_of(test_name: str, module_name: str) -> tuple[str, ...]:
    if module_name.endswith("test_attention"):
        return ATTENTION_OPS
    prefixes = [p for p in DEVICE_OP_TESTS if test_name == p or test_name.startswith(p + "_")]
    return DEVICE_OP_TESTS[max(prefixes, key=len)] if prefixes else ()


def _serves_its_solutions(platform: Platform) -> bool:
    kernels = platform.kernels
    return kernels is not None and platform.ops is kernels.ops


def parametrize(metafunc: pytest.Metafunc) -> None:
    """``kernel_solution`` over ``(name, ops)``: a device-op test once per solution of each op
    it exercises; an attention test once per solution name, forced for the decode and prefill
    ops that have it."""
    if "kernel_solution" not in metafunc.fixturenames:
        return
    import xhal

    platform = xhal.platforms.get(metafunc.config.getoption("--device"))
    marker = metafunc.definition.get_closest_marker("kernel_ops")
    wanted = (
        tuple(marker.args)
        if marker
        else ops_of(metafunc.function.__name__, metafunc.module.__name__)
    )
    if not wanted or not _serves_its_solutions(platform):
        return
    kernels = platform.kernels
    if wanted == ATTENTION_OPS:
        names = list(dict.fromkeys(s.name for op in wanted for s in kernels.solutions(op)))
        variants = [
            (n, tuple(op for op in wanted if any(s.name == n for s in kernels.solutions(op))))
            for n in names
        ]
        ids = names
    else:
        variants = [(s.name, (op,)) for op in wanted for s in kernels.solutions(op)]
        ids = [f"{op[0]}={name}" for name, op in variants]
    if variants:
        metafunc.parametrize("kernel_solution", variants, ids=ids, indirect=True)


@contextlib.contextmanager
def solution_active(request: pytest.FixtureRequest, platform: Platform, variant) -> Iterator[None]:
    """Inside the block the variant's solution serves its ops; without one, the platform's ops."""
    if variant is None:
        with ops.using(platform.device_type, platform.ops):
            yield
        return
    name, variant_ops = variant
    kernels = platform.kernels
    dtype = request.getfixturevalue("dtype") if "dtype" in request.fixturenames else None
    for op in variant_ops:
        solution = next(s for s in kernels.solutions(op) if s.name == name)
        request.node.user_properties.append((SOLUTION, solution.key))
        reason = kernels.unmet(solution, dtype)
        if reason is not None:
            request.node.user_properties.append((UNMET, f"{solution.key}: {reason}"))
            pytest.skip(f"{solution.key} not exercised: {reason}")
    with contextlib.ExitStack() as stack:
        if variant_ops == ATTENTION_OPS or set(variant_ops) <= set(ATTENTION_OPS):
            for op in variant_ops:
                stack.enter_context(kernels.forcing(op, name))
            stack.enter_context(ops.using(platform.device_type, platform.ops))
        else:
            (op,) = variant_ops
            served = platform.ops if kernels.chosen[op].name == name else kernels.ops_with(op, name)
            stack.enter_context(ops.using(platform.device_type, served))
        yield


@pytest.fixture(autouse=True)
def _solution_under_test(
    request: pytest.FixtureRequest, platform: Platform, kernel_solution
) -> Iterator[None]:
    with solution_active(request, platform, kernel_solution):
        yield
