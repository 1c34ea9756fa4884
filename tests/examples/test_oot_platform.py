"""The out-of-tree example (``examples/oot_platform``) installs with pip, registers ``oot-cpu``
through the ``xhal.platforms`` entry point, and passes the conformance suite.

The package is installed with ``pip install --target`` into a temporary directory that only this
module's subprocesses see (through ``PYTHONPATH``), not into the shared virtual environment: the
entry point is found by the same ``importlib.metadata`` scan of ``sys.path`` either way, while a
venv install would make ``oot-cpu`` appear in every concurrent test run and outlive a crash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO

EXAMPLE = REPO / "examples" / "oot_platform"
NAME = "oot-cpu"
# attention is where the example's narrow capabilities show: the grid runs only what it declares
FAMILIES = ("platform", "ops", "attention")


def run(*cmd: str, site: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a fresh interpreter that sees the installed example through ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.pop("XHAL_PLUGINS", None)  # the entry point alone must be enough
    env.pop("PYTEST_ADDOPTS", None)
    env["OMP_NUM_THREADS"] = "1"  # tiny tensors; other test processes share the machine
    return subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory holding the installed example (package + dist-info with its entry point)."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip(f"pip is not installed for {sys.executable}: cannot install the example")
    root = tmp_path_factory.mktemp("oot")
    # build from a copy, so setuptools' build/ and *.egg-info never land in the source tree
    source = shutil.copytree(
        EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    target = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--disable-pip-version-check", "--target", str(target), str(source)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip install of {EXAMPLE} failed:\n{proc.stdout}\n{proc.stderr}"
    yield target
    shutil.rmtree(target)  # the "uninstall": nothing outside this directory was touched


def test_entry_point_registers_platform_lazily(site: Path) -> None:
    probe = (
        "import sys, xhal\n"
        "names = xhal.platforms.names()\n"
        "assert 'xhal_oot_example.platform' not in sys.modules, 'names() imported the plugin'\n"
        f"p = xhal.platforms.get({NAME!r})\n"
        "print(names, type(p).__module__, p.name)\n"
    )
    proc = run(sys.executable, "-c", probe, site=site)
    assert proc.returncode == 0, proc.stderr
    assert f"'{NAME}'" in proc.stdout, f"names() does not list {NAME}: {proc.stdout}"
    assert f"xhal_oot_example.platform {NAME}" in proc.stdout, proc.stdout


def test_conformance_suite_passes(site: Path, tmp_path: Path) -> None:
    report = tmp_path / "oot.json"
    cmd = [sys.executable, "-m", "conformance_tests.cli", "--device", NAME, "--report", str(report)]
    for family in FAMILIES:
        cmd += ["--family", family]
    proc = run(*cmd, site=site)
    assert proc.returncode == 0, f"the suite failed {NAME}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    data = json.loads(report.read_text())
    assert data["device"] == NAME
    for family in FAMILIES:
        fam = data["families"].get(family)
        assert fam and fam["passed"] > 0 and fam["failed"] == 0, f"{family}: {fam}\n{proc.stdout}"
    # the grid is the declaration: what the example does not declare is never run (tests that
    # check an undeclared spec is refused run, and pass, on every platform), what it declares is
    # all exercised
    ran = [n for n, t in data["tests"].items() if t["outcome"] == "passed"]
    ran = [n for n in ran if "undeclared" not in n]
    undeclared = ("bfloat16", "float16", "bs128", "window", "soft_cap")
    assert not [n for n in ran if any(u in n for u in undeclared)], "ran an undeclared capability"
    assert data["not_exercised"] == [], data["not_exercised"]
    assert any("-d64-" in n for n in ran) and any("-d128-" in n for n in ran), ran[:5]


def test_entry_point_adds_a_solution_that_conformance_runs(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = (
        "import sys, torch, xhal\n"
        "from xhal import solutions\n"
        "names = [s.name for s in solutions.solutions('rms_norm', 'cpu')]\n"
        "p = xhal.platforms.get('cpu')\n"
        "x, w = torch.randn(3, 40), torch.randn(40)\n"
        "xd = x.double()\n"
        "ref = (xd / (xd.pow(2).mean(-1, keepdim=True) + 0.1).sqrt() * w.double()).float()\n"
        "print(names, p.ops.names['rms_norm'], torch.equal(p.ops.rms_norm(x, w, 0.1), ref))\n"
    )
    env_run = run(sys.executable, "-c", probe, site=site)
    assert env_run.returncode == 0, env_run.stderr
    assert "'oot-float64'" in env_run.stdout and " reference " in env_run.stdout, env_run.stdout
    monkeypatch.setenv("XHAL_KERNEL_RMS_NORM", "oot-float64")  # run() copies this environment
    forced = run(sys.executable, "-c", probe, site=site)
    monkeypatch.delenv("XHAL_KERNEL_RMS_NORM")
    assert forced.returncode == 0 and forced.stdout.strip().endswith("oot-float64 True"), (
        forced.stdout + forced.stderr
    )
    report = tmp_path / "cpu.json"
    cmd = [
        sys.executable,
        "-m",
        "conformance_tests.cli",
        "--device",
        "cpu",
        "--family",
        "ops",
        "--report",
        str(report),
    ]
    proc = run(*cmd, site=site)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    sol = json.loads(report.read_text())["solutions"]["rms_norm=oot-float64"]
    assert sol["status"] == "passed" and sol["passed"] > 0, sol
