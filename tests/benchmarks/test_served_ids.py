"""benchmarks.served_ids: greedy ids fetched from a running server (the tiny CPU model) are the
same run to run, and the comparison names where two runs part."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.served_ids import compare
from tests.support.conformance_run import REPO, explain, suite_env
from tests.support.launcher import ServerProcess
from tests.support.tiny_server import tiny_server_args

pytest.importorskip("fastapi")
pytest.importorskip("zmq")


def test_compare_names_the_first_difference() -> None:
    equal, lines = compare([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert equal == 1
    assert lines == [
        "prompt 1: first difference at token 1 ([5, 6] vs [9, 6]), 3 and 3 tokens",
        "prompt 2: first difference at token 2 ([] vs [9]), 2 and 3 tokens",
    ]


def test_fetch_twice_from_one_server_gives_equal_ids(tmp_path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "benchmarks.served_ids", *args]
        return subprocess.run(
            cmd, cwd=REPO, env=suite_env(), capture_output=True, text=True, timeout=600
        )

    with ServerProcess(tiny_server_args("--log-level", "warning")) as srv:
        for name in ("a.json", "b.json"):
            fetch = ("fetch", str(tmp_path / name), "--base-url", srv.url, "--prompts", "3",
                     "--prompt-len", "8", "--tokens", "5", "--vocab-size", "100")  # fmt: skip
            proc = run(*fetch)
            assert proc.returncode == 0, explain(proc)
    ids = json.loads((tmp_path / "a.json").read_text())["ids"]
    assert [len(i) for i in ids] == [5, 5, 5]  # end of sequence ignored: every token asked for
    proc = run("compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 0 and "greedy ids equal for 3 of 3 prompts" in proc.stdout, explain(
        proc
    )
