"""Kernel solutions: several implementations per op, declared as data, chosen per device.

See docs/solutions.md. Importing this package imports no kernel library.
"""

from __future__ import annotations

from xhal.solutions.op_names import ATTENTION_OPS, DEVICE_OPS, OPS, env_name
from xhal.solutions.registry import ENTRY_POINT_GROUP, register, solutions, unregister
from xhal.solutions.selection import SolutionUnavailable, select, unmet
from xhal.solutions.solution import Config, DeviceInfo, Package, Requirement, Solution

__all__ = [
    "ATTENTION_OPS",
    "DEVICE_OPS",
    "ENTRY_POINT_GROUP",
    "OPS",
    "Config",
    "DeviceInfo",
    "Package",
    "Requirement",
    "Solution",
    "SolutionUnavailable",
    "env_name",
    "register",
    "select",
    "solutions",
    "unmet",
    "unregister",
]
