"""The per-solution part of ``xhal-conformance``'s report: for each ``op=solution`` the tests
that ran it, and, where none could, why it was not exercised."""

from __future__ import annotations


def per_solution(tests: dict[str, dict]) -> dict[str, dict]:
    """``op=name`` -> passed / failed / skipped counts, a status, and the reasons it was not
    exercised (from the tests' ``solution`` and ``solution_unmet`` properties)."""
    out: dict[str, dict] = {}
    for entry in tests.values():
        for key in entry.get("solutions", ()):
            sol = out.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0, "not_exercised": []})
            sol[entry["outcome"]] += 1
            for reason in entry.get("solution_unmet", ()):
                if reason.startswith(key + ":") and reason not in sol["not_exercised"]:
                    sol["not_exercised"].append(reason)
    for sol in out.values():
        if sol["failed"]:
            sol["status"] = "FAILED"
        elif sol["passed"]:
            sol["status"] = "passed"
        else:
            sol["status"] = "not exercised"
    return dict(sorted(out.items()))


def solution_lines(solutions: dict[str, dict]) -> list[str]:
    if not solutions:
        return []
    lines = ["solutions (every registered one, chosen or not):"]
    for key, sol in solutions.items():
        line = (
            f"  {key:<36} {sol['status']:<13} passed {sol['passed']:>3}  failed {sol['failed']:>3} "
            f" "
            f"skipped {sol['skipped']:>3}"
        )
        if sol["status"] == "not exercised":
            reasons = "; ".join(sol["not_exercised"]) or "every test that runs it was skipped"
            line += f"  ({reasons})"
        lines.append(line)
    return lines
