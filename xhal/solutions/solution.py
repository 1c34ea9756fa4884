"""A solution: one implementation of one op, declared as data.

Nothing here imports the implementation: ``target`` is a ``"module:attr"`` string loaded only
when the solution is chosen (or exercised by the conformance suite), so every declaration is
readable on a machine without triton, flashinfer or tilelang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from xhal.solutions.op_names import OPS


@dataclasses.dataclass(frozen=True)
class Package:
    """An importable package a solution needs, and how to install it."""

    module: str  # what ``import`` takes: "flashinfer"
    install: str  # the command that brings it: "pip install flashinfer-python==0.5.3"


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What a machine must offer for a solution to run. ``None`` means "any".

    ``device_type`` is the kind of device the kernels target ("cpu", "cuda", "npu"), as the
    platform describes itself in ``DeviceInfo`` (an emulated NPU still says "npu"). ``dtypes``,
    ``head_dims`` and ``max_rows`` are what the solution takes; the platform checks the dtype and
    head dim when it picks an attention solution for a spec, and the conformance suite runs a
    solution only on the dtypes it declares."""

    device_type: str | None = None
    min_compute_capability: tuple[int, int] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    max_rows: int | None = None
    packages: tuple[Package, ...] = ()


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of a solution's autotuning space: keyword arguments its implementation takes."""

    name: str
    params: Mapping[str, object]


@dataclasses.dataclass(frozen=True)
class Solution:
    """One implementation of ``op``.

    ``target`` (``"module:attr"``) names a *provider builder*: called once per platform as
    ``builder(platform)``, it returns an object whose attribute named by the op's method
    (``OPS[op]``: ``rms_norm``, ``sample``, ``attention_backend`` ...) is the implementation, with
    the ``DeviceOps`` method's signature (attention: ``attention_backend(spec)``). Solutions of
    several ops naming one builder share one provider. With ``configs`` the implementation also
    takes the chosen config's ``params`` as keyword arguments and ``bucket`` (``"module:attr"``,
    a function of the call's arguments) names the shape bucket a winner is cached under.
    ``times_itself``: the implementation makes timed choices of its own the first time it meets a
    shape eagerly and keeps them in the tuning cache under keys that start with ``key`` and a
    slash (the CUDA linear's skinny GEMM against cuBLAS: ``linear=triton/skinny-mma-or-cublas``),
    so ``xhal-tune`` runs its calls too and reports those entries.
    """

    op: str
    name: str  # reference, torch, triton, tilelang, flashinfer, vendor, ...
    target: str
    requires: Requirement = Requirement()
    priority: int = 0  # the highest priority the machine meets is chosen
    configs: tuple[Config, ...] = ()
    bucket: str | None = None
    description: str = ""
    times_itself: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(
                f"solution {self.name!r}: unknown op {self.op!r}; ops: {', '.join(OPS)}"
            )
        if ":" not in self.target:
            raise ValueError(
                f"solution {self.op}/{self.name}: target {self.target!r} is not 'module:attr'"
            )
        if self.configs and self.bucket is None:
            raise ValueError(f"solution {self.op}/{self.name} has configs but no bucket function")
        if len({c.name for c in self.configs}) != len(self.configs):
            raise ValueError(f"solution {self.op}/{self.name}: config names repeat")

    @property
    def key(self) -> str:
        return f"{self.op}={self.name}"


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """A platform's description of its device, what requirements are checked against."""

    device_type: str
    name: str = ""  # "NVIDIA H200": part of the autotuning cache key
    compute_capability: tuple[int, int] | None = None
    library_versions: tuple[tuple[str, str], ...] = ()  # ("torch", "2.11.0"), ("triton", "3.6.0")


def load_target(target: str) -> object:
    """The object a ``"package.module:attr"`` target names, imported now (a solution's module
    is imported only when the solution is chosen or tested)."""
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
