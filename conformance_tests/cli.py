"""``xhal-conformance --device NAME [--report FILE.json]``: run the suite, print one line per
family, write a JSON report."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import click
import pytest

from conformance_tests.coverage import CANNOT_EXERCISE, COVERS
from conformance_tests.solution_report import per_solution, solution_lines

SUITE_DIR = Path(__file__).resolve().parent
# families whose verdict is about numbers: "passed" needs at least one passed test that checked some
NUMERIC_FAMILIES = ("attention", "collective", "fused", "graph", "ops")


def family_of(nodeid: str) -> str:
    """A test's family: its file's name after ``test_`` up to any ``_<topic>``, so a family split
    over ``test_adapter_from_xllm.py`` and ``test_adapter_to_xllm.py`` is the one "adapter"."""
    stem = Path(nodeid.split("::")[0]).stem
    return stem.removeprefix("test_").split("_", 1)[0]


def family_files(family: str) -> list[Path]:
    """``test_<family>.py`` and every ``test_<family>_<topic>.py`` of the suite."""
    return sorted(p for p in SUITE_DIR.glob(f"test_{family}*.py") if family_of(p.name) == family)


def known_families() -> list[str]:
    return sorted({family_of(p.name) for p in SUITE_DIR.glob("test_*.py")})


class _Collector:
    """A pytest plugin that tallies outcomes and the worst recorded error per family."""

    def __init__(self) -> None:
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(
            report.nodeid,
            {
                "family": family_of(report.nodeid),
                "outcome": "passed",
                "max_error": None,
                "covers": [],
                "cannot_exercise": [],
                "solutions": [],
                "solution_unmet": [],
            },
        )
        if report.failed:
            entry["outcome"] = "failed"
            entry["message"] = str(report.longrepr)[-2000:]
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"
            if isinstance(report.longrepr, tuple):
                entry["message"] = report.longrepr[2]
        for name, value in report.user_properties:
            if name == "max_error":
                prev = entry["max_error"]
                entry["max_error"] = value if prev is None else max(prev, value)
            elif name in (COVERS, CANNOT_EXERCISE, "solution_unmet") and value not in entry[name]:
                entry[name].append(value)
            elif name == "solution" and value not in entry["solutions"]:
                entry["solutions"].append(value)

    def families(self) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(
            lambda: {"passed": 0, "failed": 0, "skipped": 0, "numeric": 0, "max_error": None}
        )
        for entry in self.tests.values():
            fam = out[entry["family"]]
            fam[entry["outcome"]] += 1
            if entry["max_error"] is not None:
                fam["max_error"] = max(fam["max_error"] or 0.0, entry["max_error"])
                fam["numeric"] += entry["outcome"] == "passed"
        for name, fam in out.items():
            fam["status"] = family_status(name, fam)
        return dict(sorted(out.items()))

    def covered(self) -> set[str]:
        """Labels exercised by tests that passed."""
        return {c for t in self.tests.values() if t["outcome"] == "passed" for c in t["covers"]}

    def cannot_exercise(self) -> list[str]:
        return sorted({c for t in self.tests.values() for c in t["cannot_exercise"]})


def family_status(name: str, fam: dict) -> str:
    """FAILED on any failure; passed only when something passed (for a numeric family: something
    that checked numbers); skipped otherwise, so an empty family never reads "passed"."""
    if fam["failed"]:
        return "FAILED"
    ran = fam["numeric"] if name in NUMERIC_FAMILIES else fam["passed"]
    return "passed" if ran else "skipped"


def missing_coverage(device: str, families: tuple[str, ...], collector: _Collector) -> list[str]:
    """Declared capabilities of the families run that no passed test exercised."""
    import xhal
    from conformance_tests import coverage

    wanted = coverage.declared(xhal.platforms.get(device).capabilities)
    run_families = families or tuple(wanted)
    unreachable = collector.cannot_exercise()
    labels = {label for f in run_families for label in wanted.get(f, ())}
    return sorted(
        label
        for label in labels - collector.covered()
        if not any(u.startswith(label + " (") for u in unreachable)
    )


def run(
    device: str, families: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> tuple[int, _Collector]:
    paths = [str(p) for f in families for p in family_files(f)] or [str(SUITE_DIR)]
    collector = _Collector()
    args = [
        *paths,
        f"--device={device}",
        "-p",
        "no:cacheprovider",
        f"--rootdir={SUITE_DIR}",
        *extra,
    ]
    code = pytest.main(args, plugins=[collector])
    return int(code), collector


def summary_line(name: str, fam: dict) -> str:
    status = fam["status"]
    err = "-" if fam["max_error"] is None else f"{fam['max_error']:.2e}"
    return (
        f"{name:<12} {status:<8} passed {fam['passed']:>3}  failed {fam['failed']:>3}  "
        f"skipped {fam['skipped']:>3}  max error {err}"
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", required=True, help="Platform name, e.g. cpu, cuda, npu or a plugin's.")
@click.option("--report", type=click.Path(dir_okay=False), help="Write a JSON report here.")
@click.option("--family", "families", multiple=True, help="Run only this family (repeatable).")
@click.option(
    "--plugin",
    "plugins",
    multiple=True,
    help="Import this module first (it may register platforms); repeatable. Same as XHAL_PLUGINS.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show pytest's per-test output.")
def main(
    device: str,
    report: str | None,
    families: tuple[str, ...],
    plugins: tuple[str, ...],
    verbose: bool,
) -> None:
    """Run the xhal conformance suite against one platform."""
    if plugins:  # children (collective ranks) import them too
        os.environ["XHAL_PLUGINS"] = ",".join(
            [*filter(None, os.environ.get("XHAL_PLUGINS", "").split(",")), *plugins]
        )
    import xhal

    known = xhal.platforms.names()
    if device not in known:
        raise click.BadParameter(
            f"unknown device {device!r}; known: {', '.join(known)}", param_hint="--device"
        )
    have = known_families()
    unknown = [f for f in families if f not in have]
    if unknown:
        raise click.BadParameter(
            f"unknown family {unknown}; families: {', '.join(have)}", param_hint="--family"
        )

    start = time.perf_counter()
    code, collector = run(
        device, families, ("-v",) if verbose else ("-q", "--tb=line", "--no-header")
    )
    elapsed = time.perf_counter() - start
    fams = collector.families()
    print(f"\nxhal conformance: device={device}  ({elapsed:.1f} s)")
    for name, fam in fams.items():
        print(summary_line(name, fam))
    missing = missing_coverage(device, families, collector)
    for label in missing:
        print(f"NOT EXERCISED: declared {label}, but no passed numeric test ran it")
    for label in collector.cannot_exercise():
        print(f"not exercisable on this machine: {label}")
    solutions = per_solution(collector.tests)
    for line in solution_lines(solutions):
        print(line)
    if report:
        data = {
            "device": device,
            "seconds": elapsed,
            "families": fams,
            "not_exercised": missing,
            "cannot_exercise": collector.cannot_exercise(),
            "solutions": solutions,
            "tests": collector.tests,
        }
        Path(report).write_text(json.dumps(data, indent=2))
        print(f"report written to {report}")
    failed = any(f["failed"] for f in fams.values())
    sys.exit(1 if failed or missing or code not in (0, 5) else 0)


if __name__ == "__main__":
    main()
