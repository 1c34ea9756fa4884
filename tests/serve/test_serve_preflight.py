"""xhal-serve's start-up checks (issue 18 item 4): each mistake is one line on the terminal, no
traceback, exit code 1, before the engine process starts. Most model directories here carry a
weight file that is not safetensors at all, so a check that answers about something else proves
it ran before any weight was read."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.tiny_server import tiny_model_dir

pytest.importorskip("fastapi")
pytest.importorskip("zmq")

JUNK_WEIGHTS = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(64)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
def model(tiny_dir: Path, tmp_path: Path) -> Callable[..., Path]:
    """``model(weights=JUNK_WEIGHTS, **config_changes)``: the tiny model's config and tokenizer
    with other weights (the real ones when ``weights`` is None)."""

    def make(weights: bytes | None = JUNK_WEIGHTS, **changes: object) -> Path:
        path = tmp_path / "model"
        shutil.copytree(tiny_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        if weights is None:
            shutil.copy(tiny_dir / "model.safetensors", path / "model.safetensors")
        else:
            (path / "model.safetensors").write_bytes(weights)
        return path

    return make


def serve(*args: str) -> subprocess.CompletedProcess:
    if "--port" not in args:  # a free port, so that a server left on 8000 does not answer first
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args = (*args, "--port", str(s.getsockname()[1]))
    command = [sys.executable, "-m", "serve_cli", *args]
    # generous: the answer is expected in about a second, but CI machines are loaded
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    lines = output.splitlines()
    assert len(lines) == 1, output
    return lines[0]


def test_busy_port(model: Callable[..., Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(serve("--model", str(model()), "--port", str(port)))
    assert f"127.0.0.1:{port}" in line and "address already in use" in line and "--port" in line


def test_missing_config(model: Callable[..., Path]) -> None:
    path = model()
    (path / "config.json").unlink()
    line = one_line_error(serve("--model", str(path)))
    assert "no config.json" in line and str(path) in line


def test_unreadable_config(model: Callable[..., Path]) -> None:
    path = model()
    (path / "config.json").write_bytes(b'{"architectures": ["Llama\xff')
    line = one_line_error(serve("--model", str(path)))
    assert "config.json is not valid JSON" in line


def test_unknown_architecture_lists_the_supported_ones(model: Callable[..., Path]) -> None:
    from models import supported_architectures

    line = one_line_error(serve("--model", str(model(None, architectures=["GPT2LMHeadModel"]))))
    assert "GPT2LMHeadModel" in line
    assert all(arch in line for arch in supported_architectures())


@pytest.mark.parametrize(
    "remove,named",
    [(["tokenizer.json"], "tokenizer.json"), (["tokenizer.json", "+vocab.json"], "merges.txt")],
    ids=["no-tokenizer", "vocab-without-merges"],
)
def test_missing_tokenizer_files_are_named(
    model: Callable[..., Path], remove: list[str], named: str
) -> None:
    path = model()
    for name in remove:
        if name.startswith("+"):
            (path / name[1:]).write_text("{}")
        else:
            (path / name).unlink()
    line = one_line_error(serve("--model", str(path)))
    assert named in line and "tokenizer" in line


def test_max_model_len_past_the_positions(model: Callable[..., Path]) -> None:
    path = model(max_position_embeddings=512)
    line = one_line_error(serve("--model", str(path), "--max-model-len", "4096"))
    assert "4096" in line and "max_position_embeddings (512)" in line


def _wrong_shape(real: bytes) -> bytes:
    """The real file with one tensor's shape doubled in its header (the data left as is)."""
    (length,) = struct.unpack("<Q", real[:8])
    header = json.loads(real[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"][0] *= 2
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + real[8 + length :]


@pytest.mark.parametrize("damage", ["junk", "truncated", "wrong-shape"])
def test_corrupt_safetensors_names_the_file(
    model: Callable[..., Path], tiny_dir: Path, damage: str
) -> None:
    real = (tiny_dir / "model.safetensors").read_bytes()
    if damage == "wrong-shape":
        weights = _wrong_shape(real)
    else:
        weights = JUNK_WEIGHTS if damage == "junk" else real[: len(real) // 2]
    path = model(weights)
    line = one_line_error(serve("--model", str(path)))
    assert str(path / "model.safetensors") in line and "not a valid safetensors file" in line
    expected = {"junk": "header", "truncated": "truncated", "wrong-shape": "spans"}[damage]
    assert expected in line, line


def test_sound_weights_pass_every_check(tiny_dir: Path) -> None:
    """The real tiny checkpoint passes: the checks find faults, not healthy files."""
    from serve_cli.engine.config import EngineConfig
    from serve_cli.preflight import run_checks

    warnings: list[str] = []
    run_checks("127.0.0.1", 0, tiny_dir, EngineConfig(model_dir=tiny_dir), warnings.append)
    assert warnings == []


def test_kv_cache_smaller_than_one_sequence_warns(model: Callable[..., Path]) -> None:
    args = ["--num-kv-blocks", "4", "--block-size", "16", "--max-model-len", "256"]
    result = serve("--model", str(model()), *args)
    output = (result.stdout + result.stderr).strip().splitlines()
    # the warning, then the (junk) weights are refused: it came before any weight was read
    assert len(output) == 2 and result.returncode == 1, output
    assert output[0].startswith("xhal-serve: warning: the KV cache holds 64 tokens"), output
    assert "256" in output[0] and "not a valid safetensors file" in output[1]


def test_a_broken_tokenizer_is_one_line_naming_it(model: Callable[..., Path]) -> None:
    """Past the file checks (the file is there), loading it fails: still one line, no traceback."""
    path = model(None)
    (path / "tokenizer.json").write_text("not json")
    line = one_line_error(serve("--model", str(path), "--port", "0"))
    assert f"cannot load the tokenizer of {path}" in line and "tokenizer.json" in line
