"""The conformance suite can fail: each deliberately broken platform in ``broken_platforms`` must
make ``xhal-conformance`` fail the family that owns its bug, while the healthy reference passes the
same family through the same command line."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.conformance_run import REPO, run_conformance

SUITE = REPO / "conformance_tests"
PLUGIN = "tests.support.broken_platforms"

# (platform, the family that must catch its bug)
BROKEN = [
    ("broken-causal", "attention"),
    ("broken-kv-slot", "attention"),
    ("broken-collective", "collective"),
    ("broken-graph", "graph"),
    ("broken-qk-norm", "fused"),
    ("broken-gated-mlp", "fused"),
    ("broken-qk-norm-order", "attention"),
    # bugs only serving's way of calling shows (tests/support/broken_serving.py)
    ("broken-kv-lens-in-plan", "graph"),
    ("broken-kv-cu-undeclared", "graph"),
    ("broken-zero-row-end", "attention"),
    ("broken-strided-kv", "attention"),
    ("broken-split-kv", "attention"),
    ("broken-row0-sampling", "ops"),
    ("broken-group-broadcast", "collective"),
    ("broken-rms-no-upcast", "ops"),
]
# The healthy reference runs the cheapest family that also catches a broken platform, so the
# passing run exercises the very harness (and checks) the failing ones went through.
HEALTHY = ("cpu", "graph")


@dataclass
class CliRun:
    device: str
    family: str
    returncode: int
    stdout: str
    stderr: str
    report: dict | None

    def summary_status(self) -> str | None:
        """The status word of the family's summary line (``FAILED``, ``passed``, ``skipped``)."""
        match = re.search(rf"^{re.escape(self.family)}\s+(\S+)\s+passed", self.stdout, re.MULTILINE)
        return match.group(1) if match else None

    def tests_with(self, outcome: str) -> list[str]:
        tests = (self.report or {}).get("tests", {})
        return sorted(
            node
            for node, t in tests.items()
            if t["family"] == self.family and t["outcome"] == outcome
        )

    def explain(self) -> str:
        return (
            f"`xhal-conformance --device {self.device} --family {self.family}` exited "
            f"{self.returncode}\n--- stdout ---\n{self.stdout[-3000:]}"
            f"\n--- stderr ---\n{self.stderr[-3000:]}"
        )


def run_cli(device: str, family: str, report: Path, *, stop_at_first_failure: bool) -> CliRun:
    # A broken platform has shown what it must at its family's first failure; the rest of the
    # family (the attention family is the slow one) would only repeat it. The CLI passes no pytest
    # flags, so pytest's own environment variable carries --maxfail.
    env = {"PYTEST_ADDOPTS": "--maxfail=1"} if stop_at_first_failure else {}
    proc, data = run_conformance(device, PLUGIN, report, (family,), **env)
    return CliRun(device, family, proc.returncode, proc.stdout, proc.stderr, data)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """Every CLI run of this module, started together: each is mostly interpreter start-up and
    one family, so running them side by side keeps the module's wall time near the slowest run."""
    missing = sorted({f for _, f in [*BROKEN, HEALTHY] if not (SUITE / f"test_{f}.py").exists()})
    assert not missing, f"conformance families missing from {SUITE}: {missing}"
    out = tmp_path_factory.mktemp("conformance_reports")
    jobs = [*BROKEN, HEALTHY]
    # a few at a time: each run is a process on a machine other test runs share
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            dev: pool.submit(run_cli, dev, fam, out / f"{dev}.json", stop_at_first_failure=broken)
            for (dev, fam), broken in zip(jobs, [True] * len(BROKEN) + [False])
        }
    return {dev: f.result() for dev, f in futures.items()}


@pytest.mark.parametrize("device,family", BROKEN, ids=[d for d, _ in BROKEN])
def test_broken_platform_fails_its_family(
    runs: dict[str, CliRun], device: str, family: str
) -> None:
    run = runs[device]
    assert run.returncode != 0, f"the suite passed a broken platform\n{run.explain()}"
    assert run.summary_status() == "FAILED", f"summary line does not say FAILED\n{run.explain()}"
    assert run.report is not None, f"no JSON report written\n{run.explain()}"
    fam = run.report["families"].get(family, {})
    failed = run.tests_with("failed")
    assert fam.get("failed", 0) > 0 and failed, f"no failed {family} test reported\n{run.explain()}"
    assert fam["failed"] == len(failed), "family tally disagrees with the per-test outcomes"
    # the failures are the suite's verdicts on the bug, not a plugin that failed to load
    messages = " ".join(run.report["tests"][node].get("message", "") for node in failed)
    assert "unknown platform" not in messages and "ModuleNotFoundError" not in messages, messages


def test_healthy_platform_passes_the_same_family(runs: dict[str, CliRun]) -> None:
    device, family = HEALTHY
    run = runs[device]
    assert run.returncode == 0, f"the reference platform failed\n{run.explain()}"
    assert run.summary_status() == "passed", run.explain()
    assert run.report is not None and not run.tests_with("failed"), run.explain()
    assert run.tests_with("passed"), f"no {family} test ran\n{run.explain()}"
