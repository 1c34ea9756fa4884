"""The README's ``curl`` examples, and running one against a live server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support.paths import REPO

README = REPO / "README.md"


def readme_curl_commands(readme: Path = README) -> list[str]:
    """The ``curl`` commands of ``readme`` (a command runs on over ``\\`` line ends and open
    single quotes)."""
    lines = readme.read_text().splitlines() if readme.is_file() else []
    commands, current = [], None
    for line in lines:
        if current is None and line.lstrip().startswith("curl http"):
            current = line.strip()
        elif current is not None:
            current += "\n" + line
        if current is not None and not current.endswith("\\") and current.count("'") % 2 == 0:
            commands.append(current)
            current = None
    return commands


def run_curl_example(port: int, example: str, timeout: float = 600) -> dict[str, Any] | str:
    """Run ``example`` against the server on ``port``; its JSON reply, or the raw text of a
    streamed one (checked to end with ``data: [DONE]``). Fails on an HTTP error."""
    command = example.replace("localhost:8000", "127.0.0.1:8000")
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    command = command.replace("curl ", "curl -sS --fail-with-body ", 1)
    out = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, f"{example}\n{out.stdout}{out.stderr}"
    if out.stdout.startswith("data:"):
        assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout
        return out.stdout
    reply = json.loads(out.stdout)
    assert reply["object"] in ("text_completion", "chat.completion"), reply
    assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["finish_reason"]
    return reply
