"""The moe conformance family can fail: each platform of ``broken_moe_platforms`` (the CPU
reference with one MoE bug) makes ``xhal-conformance --family moe`` fail, and the tests that fail
are the ones aimed at that bug."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.conformance_run import explain, run_conformance

PLUGIN = "tests.support.broken_moe_platforms"

# (platform, tests of which one must fail on it, tests that must all still pass on it)
BROKEN = [
    ("broken-moe-renorm", r"test_route\[.*renorm", r"test_experts\["),
    ("broken-moe-gate-up", r"test_experts\[", r"test_route\["),
    ("broken-moe-drop", r"test_experts\[.*many-tokens-per-expert", r"test_experts\[.*one-token"),
    ("broken-moe-norm-route", r"test_add_rms_norm_route", r"test_route\["),
    ("broken-moe-o-route", r"test_linear_add_rms_norm_route", r"test_add_rms_norm_route"),
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    out: Path = tmp_path_factory.mktemp("moe_reports")
    devices = [d for d, _, _ in BROKEN] + ["cpu"]
    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        futures = {
            d: pool.submit(run_conformance, d, PLUGIN, out / f"{d}.json", ("moe",)) for d in devices
        }
    return {d: f.result() for d, f in futures.items()}


@pytest.mark.parametrize("device,must_fail,must_pass", BROKEN, ids=[d for d, _, _ in BROKEN])
def test_broken_moe_platform_fails_the_family(reports, device, must_fail, must_pass) -> None:
    proc, report = reports[device]
    assert proc.returncode != 0, f"the moe family passed a broken platform\n{explain(proc)}"
    assert report is not None, explain(proc)
    outcome = {node.split("::")[-1]: t["outcome"] for node, t in report["tests"].items()}
    failed = [n for n, o in outcome.items() if o == "failed"]
    assert any(re.match(must_fail, n) for n in failed), f"no {must_fail} failed: {failed}"
    kept = {n: o for n, o in outcome.items() if re.match(must_pass, n)}
    assert kept and all(o == "passed" for o in kept.values()), kept


def test_reference_passes_the_family(reports) -> None:
    proc, report = reports["cpu"]
    assert proc.returncode == 0, explain(proc)
    assert report["families"]["moe"]["passed"] > 0 and report["families"]["moe"]["failed"] == 0
