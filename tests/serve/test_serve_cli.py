"""The xhal-serve command line: help for every option, unknown devices, missing packages, sizes."""

from __future__ import annotations

import pytest

from tests.support.tiny_server import tiny_server_args

pytest.importorskip("fastapi")
pytest.importorskip("zmq")


def test_cli_help_explains_every_option() -> None:
    from click.testing import CliRunner

    from serve_cli.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--device",
        "--model",
        "--host",
        "--port",
        "--dtype",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--block-size",
        "--kv-cache-memory",
        "--num-kv-blocks",
        "--tensor-parallel-size",
        "--enforce-eager",
        "--served-model-name",
        "--api-key",
        "--seed",
    ):
        assert option in result.output
    assert "127.0.0.1" in result.output  # localhost unless told otherwise


def test_cli_rejects_an_unknown_device_listing_the_known_ones() -> None:
    from click.testing import CliRunner

    import xhal.platforms
    from serve_cli.cli import main

    # the device is checked after the cheap start-up checks, so it needs a model that passes them
    result = CliRunner().invoke(main, tiny_server_args("--device", "tpu9000"))
    assert result.exit_code == 2
    assert "tpu9000" in result.output
    assert all(name in result.output for name in xhal.platforms.names())


def test_cli_names_a_missing_package_and_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from click.testing import CliRunner

    from serve_cli.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a)
    )
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 1
    assert "pip install pyzmq" in result.output


def test_cli_parses_kv_cache_sizes() -> None:
    from serve_cli.cli import ByteSize

    size = ByteSize()
    assert [size.convert(v, None, None) for v in ("1024", "2KiB", "1.5G", "512MiB")] == [
        1024,
        2048,
        1_500_000_000,
        512 * 2**20,
    ]
    with pytest.raises(Exception, match="not a size"):
        size.convert("lots", None, None)
