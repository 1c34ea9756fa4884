"""TEST-ONLY plugin: a wrong secondary CPU solution of ``rms_norm`` ("planted", below the
reference, so never chosen: it leaves eps out). The conformance suite runs every registered
solution, so ``xhal-conformance --device cpu --family ops --plugin
tests.support.planted_solution_plugin`` must fail on it although the chosen reference is right."""

from __future__ import annotations

import torch

from xhal import solutions


class PlantedOps:
    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # the bug: eps is ignored
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) * weight.float()).to(x.dtype)


solutions.register(
    solutions.Solution(
        "rms_norm",
        "planted",
        "tests.support.planted_solution_plugin:PlantedOps",
        solutions.Requirement(device_type="cpu"),
        priority=-50,
    )
)
# a solution this machine cannot run: listed as not exercised, with the reason
solutions.register(
    solutions.Solution(
        "rms_norm",
        "needs-missing",
        "tests.support.planted_solution_plugin:PlantedOps",
        solutions.Requirement(
            device_type="cpu",
            packages=(
                solutions.Package("xhal_no_such_package", "pip install xhal-no-such-package"),
            ),
        ),
        priority=-60,
    )
)
