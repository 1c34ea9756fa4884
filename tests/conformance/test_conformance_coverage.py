"""``xhal-conformance`` reads its grid from the declaration and says what it did not exercise:
the from-scratch skeleton backend (``examples/skeleton``) passes the families it declares; a run
that leaves a declared head dim unexercised exits non-zero naming it; a family with nothing
declared reads "skipped", never "passed"."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.conformance_run import explain, run_conformance

PLUGIN = "examples.skeleton.skeleton_backend"


def status(stdout: str, family: str) -> str | None:
    match = re.search(rf"^{family}\s+(\S+)\s+passed", stdout, re.MULTILINE)
    return match.group(1) if match else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("coverage")
    jobs = {
        "declared": (("attention", "ops", "platform"), {}),
        # deselect every head-dim-64 case: the declaration's 64 is then never exercised
        "unexercised": (("attention",), {"PYTEST_ADDOPTS": "-k 'not d64'"}),
        "graph": (("graph",), {}),
    }
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {
            name: pool.submit(
                run_conformance, "skeleton", PLUGIN, out / f"{name}.json", fams, **env
            )
            for name, (fams, env) in jobs.items()
        }
    return {name: f.result() for name, f in futures.items()}


def test_skeleton_backend_passes_what_it_declares(runs: dict) -> None:
    proc, report = runs["declared"]
    assert proc.returncode == 0, explain(proc)
    for family in ("attention", "ops", "platform"):
        assert status(proc.stdout, family) == "passed", explain(proc)
    assert report["not_exercised"] == [], report["not_exercised"]
    # the derived grid ran the declared head dims and nothing else
    attention = [
        n
        for n, t in report["tests"].items()
        if t["family"] == "attention" and t["outcome"] == "passed"
    ]
    assert any("-d32-" in n for n in attention) and any("-d64-" in n for n in attention)
    assert not any("-d128-" in n for n in attention), "a head dim the skeleton does not list ran"


def test_unexercised_declared_capability_fails_the_run(runs: dict) -> None:
    proc, report = runs["unexercised"]
    assert proc.returncode != 0, (
        f"a declared head dim never ran, yet the run passed\n{explain(proc)}"
    )
    assert "NOT EXERCISED: declared attention head_dim 64" in proc.stdout, explain(proc)
    assert report["not_exercised"] == ["attention head_dim 64"], report["not_exercised"]


def test_family_without_numeric_tests_reads_skipped(runs: dict) -> None:
    proc, report = runs["graph"]
    assert proc.returncode == 0, explain(proc)
    assert status(proc.stdout, "graph") == "skipped", explain(proc)
    assert report["families"]["graph"]["passed"] == 0
