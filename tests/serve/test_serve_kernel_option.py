"""``xhal-serve --kernel OP=SOLUTION``: checked before anything starts, and turned into the
``XHAL_KERNEL_<OP>`` settings a platform created in a child process (the engine) then follows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.conformance_run import REPO, explain, suite_env
from xhal.solutions.options import apply_kernel_options


def test_kernel_options_become_settings() -> None:
    environ: dict[str, str] = {}
    apply_kernel_options(["rms_norm=torch", "paged_decode_attention = triton"], environ)
    assert environ == {
        "XHAL_KERNEL_RMS_NORM": "torch",
        "XHAL_KERNEL_PAGED_DECODE_ATTENTION": "triton",
    }


@pytest.mark.parametrize(
    "value,message",
    [
        ("rms_norm", "give OP=SOLUTION"),
        ("rms_nrom=torch", "unknown op 'rms_nrom'; ops: linear, rms_norm"),
        (
            "rms_norm=nope",
            "rms_norm has no solution 'nope'; known: fast, flashinfer, reference, torch, vendor",
        ),
    ],
)
def test_bad_kernel_options_are_refused_before_serving(value, message) -> None:
    pytest.importorskip("fastapi")
    from click.testing import CliRunner

    from serve_cli.cli import main

    result = CliRunner().invoke(main, ["--kernel", value])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_a_child_process_platform_follows_the_setting() -> None:
    probe = "import xhal; print(xhal.platforms.get('cpu').ops.names['sampling'])"
    for setting, expected in (("", "reference"), ("torch", "torch")):
        env = suite_env(XHAL_KERNEL_SAMPLING=setting)
        proc = subprocess.run(
            [sys.executable, "-c", probe],
            check=False,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == expected, explain(proc)


def test_serve_passes_kernel_options_to_the_engine_environment(monkeypatch, tmp_path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    import os

    from click.testing import CliRunner

    import serve_cli.server
    from serve_cli.cli import main

    seen: list[str | None] = []
    monkeypatch.setattr(
        serve_cli.server,
        "serve",
        lambda options, config: seen.append(os.environ.get("XHAL_KERNEL_SAMPLING")),
    )
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XHAL_KERNEL_SAMPLING", "")  # restored after the test: nothing leaks
    result = CliRunner().invoke(main, ["builtin:tiny-random", "--kernel", "sampling=torch"])
    assert result.exit_code == 0, result.output
    assert seen == ["torch"]
