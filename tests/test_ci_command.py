"""The README's test command is exactly what CI runs (``.ci/run``), lint included: a reader who
copies it gets CI's verdict, and CI cannot drift from what the README promises."""

from __future__ import annotations

import re

from tests.support.paths import REPO


def _readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [line for b in blocks for line in b.splitlines() if "python -m pytest" in line]
    assert len(commands) == 1, f"expected one test command in README.md, found {commands}"
    return commands[0].strip()


def test_readme_runs_what_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert _readme_test_command() == ci


def test_ci_lints_before_it_tests() -> None:
    steps = [s.strip() for s in _readme_test_command().split("&&")]
    assert ".venv/bin/ruff check ." in steps
    tests = next(i for i, s in enumerate(steps) if s.startswith(".venv/bin/python -m pytest"))
    assert steps.index(".venv/bin/ruff check .") < tests
