"""ARCHITECTURE.md section 1, rules 1-3, enforced by reading the code's imports with ``ast``.

1. Hardware-neutral code (models/, xhal/layers, xhal/executor, xhal/interfaces) imports nothing
   device-specific and names no device graph type.
2. Backends (xhal/platforms/cpu_ref, xhal/platforms/cuda, xhal/platforms/npu) never import the
layers above them.
3. ``import xhal`` and the CPU path work where no device library can be imported.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO

NEUTRAL_DIRS = ("models", "xhal/layers", "xhal/executor", "xhal/interfaces")
BACKEND_DIRS = (
    "xhal/platforms/cpu_ref",
    "xhal/platforms/cpu_fast",
    "xhal/platforms/cuda",
    "xhal/platforms/npu",
    "xhal/platforms/common",
)
DEVICE_LIBRARIES = ("torch_npu", "flashinfer", "triton", "tilelang")
# neutral code reaches a device only through the interfaces, so a backend package is off limits too
DEVICE_MODULES = (
    "torch.cuda",
    "torch.npu",
    *DEVICE_LIBRARIES,
    "xhal.platforms.cpu_ref",
    "xhal.platforms.cpu_fast",
    "xhal.platforms.cuda",
    "xhal.platforms.npu",
)
DEVICE_TORCH_ATTRS = ("cuda", "npu")  # torch.cuda.*, torch.npu.*
GRAPH_TYPES = ("CUDAGraph", "NPUGraph")
UPPER_MODULES = ("models", "xhal.executor", "xhal.tools", "serve_cli")
# rule 4: what sits above each part of xhal/ (the tools are the top floor of the package)
ABOVE_XHAL = ("xhal.tools", "serve_cli")
UNDER_MODELS_DIRS = ("xhal/layers", "xhal/ops", "xhal/interfaces", "xhal/platforms", "xhal/env.py")
ABOVE_MODELS = ("models", "xhal.executor", "xhal.adapter", *ABOVE_XHAL)


def _within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _resolve(module: str | None, level: int, package: str) -> str:
    """The absolute module of ``from <level dots><module> import ...`` written in ``package``."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - level + 1]
    return ".".join([*parts, module] if module else parts)


def imported_names(tree: ast.AST, package: str) -> Iterator[tuple[int, str]]:
    """Every module an import statement (or ``importlib.import_module`` / ``__import__`` with a
    literal name) may bind; ``from a import b`` yields both ``a`` and ``a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to the torch module itself (``import torch``, ``import torch as T``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (
                    alias.asname is None and alias.name.startswith("torch.")
                ):
                    names.add(alias.asname or "torch")
    return names


def _torch_device_use(node: ast.AST, torch_names: set[str]) -> str | None:
    """``torch.cuda`` / ``torch.npu`` reached as an attribute, or by ``getattr`` with a literal."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        base, attr = node.value.id, node.attr
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "getattr"
        and len(node.args) > 1
        and isinstance(node.args[0], ast.Name)
        and isinstance(node.args[1], ast.Constant)
    ):
        base, attr = node.args[0].id, node.args[1].value
    else:
        return None
    return f"{base}.{attr}" if base in torch_names and attr in DEVICE_TORCH_ATTRS else None


def _identifier(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.alias):
        return f"{node.name} {node.asname or ''}".strip()
    return ""


def neutral_violations(source: str, package: str) -> list[str]:
    """Rule 1 for one module's source."""
    tree = ast.parse(source)
    out = [
        f"{line}: imports {name}"
        for line, name in imported_names(tree, package)
        if _within(name, DEVICE_MODULES)
    ]
    torch_names = _torch_aliases(tree)
    for node in ast.walk(tree):
        use = _torch_device_use(node, torch_names)
        if use:
            out.append(f"{node.lineno}: uses {use}")
        ident = _identifier(node)
        if any(g in ident for g in GRAPH_TYPES):
            out.append(f"{getattr(node, 'lineno', '?')}: names the device graph type {ident}")
    return out


def upward_imports(source: str, package: str, upper: tuple[str, ...]) -> list[str]:
    """The imports of ``upper`` modules in one module's source."""
    tree = ast.parse(source)
    return [
        f"{line}: imports {name}"
        for line, name in imported_names(tree, package)
        if _within(name, upper)
    ]


def backend_violations(source: str, package: str) -> list[str]:
    """Rule 2 for one module's source."""
    return upward_imports(source, package, UPPER_MODULES)


def sources(dirs: tuple[str, ...]) -> Iterator[tuple[Path, str]]:
    """Each Python file under ``dirs`` (a folder, or one file) with the package it belongs to."""
    for d in dirs:
        root = REPO / d
        paths = sorted(root.rglob("*.py")) if root.is_dir() else [root] if root.is_file() else []
        for path in paths:
            # the package a module sits in anchors its relative imports
            yield path, ".".join(path.relative_to(REPO).parent.parts)


# rule 1 --------------------------------------------------------------------------------------

BAD_NEUTRAL = [
    "import torch.cuda",
    "from torch.cuda import CUDAGraph",
    "from torch import cuda",
    "import torch\ntorch.cuda.synchronize()",
    "import torch as T\nT.npu.current_stream()",
    "import torch.nn\ntorch.cuda.is_available()",
    "import torch\ns = getattr(torch, 'cuda')",
    "import triton.language as tl",
    "from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper",
    "import importlib\nimportlib.import_module('torch_npu')",
    "from tilelang import jit",
    "def f(g: 'x', graph: CUDAGraph) -> None: ...",
    "from xhal.platforms.cuda.attention import FlashInferAttention",
    "from ..platforms.cuda import platform",  # in package xhal.layers -> xhal.platforms.cuda
]
GOOD_NEUTRAL = (
    '"""Mentions torch.cuda and CUDAGraph in prose only."""\n'
    "import torch\nfrom torch import nn\nfrom xhal.interfaces import Platform\nfrom . import norm\n"
    "x = torch.device('cpu')\ncuda_like = nn.Linear\n"
)


@pytest.mark.parametrize("source", BAD_NEUTRAL)
def test_neutral_checker_flags_planted_source(source: str) -> None:
    assert neutral_violations(source, "xhal.layers"), f"rule 1 checker missed:\n{source}"


def test_neutral_checker_passes_clean_source() -> None:
    assert neutral_violations(GOOD_NEUTRAL, "xhal.layers") == []


def test_neutral_code_imports_nothing_device_specific() -> None:
    checked, problems = 0, []
    for path, package in sources(NEUTRAL_DIRS):
        checked += 1
        problems += [
            f"{path.relative_to(REPO)}:{v}" for v in neutral_violations(path.read_text(), package)
        ]
    assert checked, f"none of {NEUTRAL_DIRS} holds Python files: is REPO={REPO} right?"
    assert not problems, "device-specific code in hardware-neutral layers:\n" + "\n".join(problems)


# rule 2 --------------------------------------------------------------------------------------

BAD_BACKEND = [
    "from xhal.executor import ModelExecutor",
    "import models.llama",
    "from models import LlamaForCausalLM",
    "import serve_cli.worker",
    "from xhal import executor",
    # in package xhal.platforms.cuda -> xhal.executor
    "from ...executor.executor import ModelExecutor",
]


@pytest.mark.parametrize("source", BAD_BACKEND)
def test_backend_checker_flags_planted_source(source: str) -> None:
    assert backend_violations(source, "xhal.platforms.cuda"), f"rule 2 checker missed:\n{source}"


def test_backend_checker_passes_clean_source() -> None:
    clean = (
        "from xhal.interfaces import Platform\n"
        "from ..cpu_ref.collective import GlooCollective\n"
        "import models_extra\n"
    )
    assert backend_violations(clean, "xhal.platforms.cuda") == []


def test_backends_import_no_upper_layer() -> None:
    problems = []
    for path, package in sources(BACKEND_DIRS):
        problems += [
            f"{path.relative_to(REPO)}:{v}" for v in backend_violations(path.read_text(), package)
        ]
    assert not problems, "backends importing the layers above them:\n" + "\n".join(problems)


# rule 4 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "package", "upper"),
    [
        ("from xhal.tools.align import align", "xhal.executor", ABOVE_XHAL),
        ("from ..tools import align", "xhal.adapter", ABOVE_XHAL),
        ("import serve_cli.engine", "xhal.layers", ABOVE_XHAL),
        ("from models.registry import build_model", "xhal.ops", ABOVE_MODELS),
        ("import models", "xhal.platforms", ABOVE_MODELS),
        ("from xhal.executor import ModelExecutor", "xhal.interfaces", ABOVE_MODELS),
    ],
)
def test_floor_checker_flags_planted_source(source: str, package: str, upper: tuple) -> None:
    assert upward_imports(source, package, upper), f"rule 4 checker missed:\n{source}"


def test_no_arrow_runs_back_up() -> None:
    problems, checked = [], 0
    for path, package in sources(("xhal",)):
        if _within(package, ("xhal.tools",)):
            continue
        checked += 1
        upper = ABOVE_XHAL
        if any(path.is_relative_to(REPO / d) for d in UNDER_MODELS_DIRS):
            upper = ABOVE_MODELS
        problems += [
            f"{path.relative_to(REPO)}:{v}"
            for v in upward_imports(path.read_text(), package, upper)
        ]
    assert checked, f"xhal/ holds no Python files: is REPO={REPO} right?"
    assert not problems, "imports from a lower floor to a higher one:\n" + "\n".join(problems)


# rule 3 --------------------------------------------------------------------------------------

PROBE = """
import importlib, sys
BLOCKED = {blocked!r}

class _Missing:
    # behaves as if the packages were not installed, whatever this machine has
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Missing())
try:
    import triton  # noqa: F401
    raise SystemExit("the blocker let triton through")
except ModuleNotFoundError:
    pass
import torch
import xhal
assert "cpu" in xhal.platforms.available(), xhal.platforms.available()
p = xhal.platforms.get("cpu")
x = torch.randn(2, 8)
xhal.ops.rms_norm(x, torch.ones(8), 1e-6)
p.attention_backend(xhal.AttentionSpec(4, 2, 64, torch.float32, 16))
p.graph_runner(), p.collective(None)
for package in {neutral!r}:  # the hardware-neutral layers import here too
    importlib.import_module(package)
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def test_cpu_path_works_without_device_libraries() -> None:
    neutral = [d.replace("/", ".") for d in NEUTRAL_DIRS if (REPO / d / "__init__.py").exists()]
    env = {k: v for k, v in os.environ.items() if k != "XHAL_PLUGINS"}  # xhal alone, no plugins
    env["CUDA_VISIBLE_DEVICES"] = ""  # and no GPU, where this runs on a machine with one
    probe = PROBE.format(blocked=DEVICE_LIBRARIES, neutral=neutral)
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"CPU path failed without {DEVICE_LIBRARIES}:\n{proc.stderr[-3000:]}"
    )
    assert proc.stdout.strip().splitlines()[-1] == "ok []"
