"""Which solution a device meets, and the choice of the best one."""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from xhal.solutions import registry
from xhal.solutions.solution import DeviceInfo, Solution

logger = logging.getLogger("xhal.solutions")
_missing_logged: set[str] = set()


class SolutionUnavailable(RuntimeError):
    """A forced solution (or every solution of an op) cannot run on this machine."""


@functools.cache
def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unmet(
    solution: Solution,
    device: DeviceInfo,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> str | None:
    """Why ``solution`` cannot run here (for that dtype / head dim when given), or None."""
    req = solution.requires
    if req.device_type is not None and req.device_type != device.device_type:
        return f"needs a {req.device_type} device, this is {device.device_type}"
    if req.min_compute_capability is not None:
        have = device.compute_capability
        if have is None or have < req.min_compute_capability:
            need = ".".join(map(str, req.min_compute_capability))
            return f"needs compute capability {need}+, this device has {have}"
    if dtype is not None and req.dtypes is not None and dtype not in req.dtypes:
        return f"takes {', '.join(map(_dtype_name, req.dtypes))}, not {_dtype_name(dtype)}"
    if head_dim is not None and req.head_dims is not None and head_dim not in req.head_dims:
        return f"takes head dims {req.head_dims}, not {head_dim}"
    for package in req.packages:
        if not _importable(package.module):
            return f"{package.module} is not installed ({package.install})"
    return None


def _log_missing_packages(solution: Solution) -> None:
    """One line per missing package per process, naming it and its install command."""
    for package in solution.requires.packages:
        if package.module not in _missing_logged and not _importable(package.module):
            _missing_logged.add(package.module)
            logger.warning(
                "%s is not installed: its solutions are skipped (first: %s); install: %s",
                package.module,
                solution.key,
                package.install,
            )


def select(
    op: str,
    device: DeviceInfo,
    *,
    forced: str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> Solution:
    """The highest-priority solution of ``op`` the device meets, or the ``forced`` one.

    Raises ``SolutionUnavailable`` when the forced solution cannot run here (a forced choice
    never falls back silently) or when none can; ``KeyError`` for a forced name the device type
    does not have, listing those it has."""
    candidates = registry.solutions(op, device.device_type)
    if forced is not None:
        named = [s for s in candidates if s.name == forced]
        if not named:
            known = ", ".join(s.name for s in candidates) or "none"
            raise KeyError(
                f"{op} has no solution {forced!r} on {device.device_type}; known: {known}"
            )
        reason = unmet(named[0], device, dtype=dtype, head_dim=head_dim)
        if reason is not None:
            raise SolutionUnavailable(f"{op}={forced} was forced but cannot run here: {reason}")
        return named[0]
    reasons = []
    for solution in candidates:
        reason = unmet(solution, device, dtype=dtype, head_dim=head_dim)
        if reason is None:
            return solution
        _log_missing_packages(solution)
        reasons.append(f"{solution.name}: {reason}")
    raise SolutionUnavailable(
        f"no solution of {op} runs on this {device.device_type} device"
        + (f" ({'; '.join(reasons)})" if reasons else " (none is registered for it)")
    )
