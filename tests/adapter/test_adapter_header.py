"""``xhal/adapter/xhal_metadata.h`` compiles as C and as C++, and its enum values match Python's."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xhal.adapter import header_path
from xhal.interfaces.metadata import BatchKind

HEADER = header_path()
WARNINGS = ["-Wall", "-Wextra", "-pedantic", "-Werror"]


def _compiler(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


CC = _compiler("cc", "gcc", "clang")
CXX = _compiler("c++", "g++", "clang++")


def _compile(compiler: str | None, args: list[str]) -> None:
    if compiler is None:
        pytest.skip("no C/C++ compiler on PATH (looked for cc, gcc, clang, c++, g++, clang++)")
    proc = subprocess.run([compiler, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join([compiler, *args])} failed:\n{proc.stderr}"


def test_header_is_packaged():
    assert HEADER.is_file()
    assert HEADER.parent.name == "adapter"


@pytest.mark.parametrize("std", ["c99", "c11"])
def test_header_compiles_as_c(std):
    _compile(CC, ["-fsyntax-only", "-x", "c", f"-std={std}", *WARNINGS, str(HEADER)])


@pytest.mark.parametrize("std", ["c++11", "c++17"])
def test_header_compiles_as_cxx(std):
    _compile(CXX, ["-fsyntax-only", "-x", "c++", f"-std={std}", *WARNINGS, str(HEADER)])


def _enum_checks(assert_kw: str) -> str:
    lines = [f'#include "{HEADER}"']
    for kind in BatchKind:
        lines.append(
            f'{assert_kw}(XHAL_BATCH_{kind.name} == {kind.value}, "XHAL_BATCH_{kind.name}");'
        )
    lines.append(f'{assert_kw}(XHAL_PADDING_SLOT == -1, "padding slot");')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("lang", ["c", "c++"])
def test_enum_values_match_batch_kind(lang, tmp_path: Path):
    # the compiler, not a regex, reads the header: static asserts generated from the Python enum
    src = tmp_path / ("check.c" if lang == "c" else "check.cpp")
    src.write_text(_enum_checks("_Static_assert" if lang == "c" else "static_assert"))
    std = "-std=c11" if lang == "c" else "-std=c++11"
    _compile(CC if lang == "c" else CXX, ["-fsyntax-only", "-x", lang, std, *WARNINGS, str(src)])


def test_enum_names_cover_batch_kind_without_a_compiler():
    values = dict(re.findall(r"XHAL_BATCH_(\w+)\s*=\s*(-?\d+)", HEADER.read_text()))
    assert {k.name: str(k.value) for k in BatchKind}.items() <= values.items()
