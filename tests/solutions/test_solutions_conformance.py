"""The conformance suite runs every registered solution, not only the chosen one: a wrong
secondary solution fails the run although the chosen one is right; one the machine cannot run is
listed as not exercised with its reason; every CPU solution passes the ops family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.conformance_run import REPO, explain, run_conformance, suite_env


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory):
    report = tmp_path_factory.mktemp("planted") / "report.json"
    return run_conformance("cpu", "tests.support.planted_solution_plugin", report, ("ops",))


def test_a_wrong_secondary_solution_fails_the_run(planted) -> None:
    proc, report = planted
    assert proc.returncode == 1, f"the planted rms_norm solution passed\n{explain(proc)}"
    assert report is not None, explain(proc)
    sols = report["solutions"]
    assert sols["rms_norm=planted"]["status"] == "FAILED", sols["rms_norm=planted"]
    assert sols["rms_norm=planted"]["failed"] > 0
    # the chosen solution is right, and so is every other CPU solution
    assert sols["rms_norm=reference"]["status"] == "passed", sols["rms_norm=reference"]
    others = {
        k: v["status"]
        for k, v in sols.items()
        if k.split("=")[1] not in ("planted", "needs-missing")
    }
    assert set(others.values()) == {"passed"}, others
    failed = [n for n, t in report["tests"].items() if t["outcome"] == "failed"]
    assert failed and all("rms_norm=planted" in n for n in failed), failed
    assert "rms_norm=planted" in proc.stdout and "FAILED" in proc.stdout


def test_a_solution_the_machine_cannot_run_is_listed_not_exercised(planted) -> None:
    proc, report = planted
    sol = report["solutions"]["rms_norm=needs-missing"]
    assert sol["status"] == "not exercised" and sol["passed"] == sol["failed"] == 0, sol
    assert any(
        "xhal_no_such_package is not installed (pip install xhal-no-such-package)" in r
        for r in sol["not_exercised"]
    ), sol
    line = next(ln for ln in proc.stdout.splitlines() if "rms_norm=needs-missing" in ln)
    assert "not exercised" in line and "xhal_no_such_package" in line, line


def test_every_cpu_solution_passes_the_ops_and_moe_families(tmp_path: Path) -> None:
    report_path = tmp_path / "cpu.json"
    cmd = [
        sys.executable,
        "-m",
        "conformance_tests.cli",
        "--device",
        "cpu",
        "--family",
        "ops",
        "--family",
        "moe",
        "--report",
        str(report_path),
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=suite_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, explain(proc)
    sols = json.loads(report_path.read_text())["solutions"]
    assert {
        "sampling=reference",
        "sampling=torch",
        "moe_experts=reference",
        "linear=reference",
    } <= set(sols)
    assert {v["status"] for v in sols.values()} == {"passed"}, sols
