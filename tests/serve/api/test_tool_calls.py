"""Tool calls in chat replies: the hermes parser on its own, held-back streaming, and the chat
route with an engine that writes a scripted reply (a random model writes no calls)."""

from __future__ import annotations

import json
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from serve_cli.api.tool_calls import PARSERS, StreamedReply, ToolCall, parse  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine, call  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
NAMELESS = '<tool_call>{"arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("It is sunny.", "It is sunny.", []),
        (CALL, None, [WEATHER]),
        ("Let me look.\n\n" + CALL, "Let me look.", [WEATHER]),
        (CALL + "\n" + CALL.replace("Paris", "Oslo"), None,
         [WEATHER, ToolCall("get_weather", '{"city": "Oslo"}')]),
        (CALL.removesuffix("</tool_call>"), None, [WEATHER]),  # the output ended inside it
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
         [ToolCall("f", '{"a": 1}')]),  # arguments already a JSON string
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (NAMELESS, NAMELESS, []),
    ],
)  # fmt: skip
def test_hermes_parser(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse(text) == (content, calls)


def test_a_streamed_reply_holds_back_what_may_be_a_call() -> None:
    text = "Let me look. " + CALL
    reply, released = StreamedReply(), ""
    for i in range(0, len(text), 3):  # pieces that split "<tool_call>" too
        released += reply.feed(text[i : i + 3])
        assert not released.endswith("<") and "<tool" not in released
    assert released == "Let me look. " and reply.finish() == ("", [WEATHER])
    plain = StreamedReply()  # no call after all: everything comes out, the tail at the end
    released = plain.feed("a <tool") + plain.feed("s> b <tool_")
    assert released == "a <tools> b " and plain.finish() == ("<tool_", [])


# --- the chat route ---------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
# a template that shows what reaches it: the tools, and a message's tool_calls / tool_call_id
TEMPLATE = (
    "{% for t in tools or [] %}tool {{ t.function.name }};{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} calls {{ c.function.name }}{% endfor %}"
    "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


def _app(reply: str, parser: str | None = "hermes") -> tuple[Any, Any, ScriptedEngine]:
    """The app over an engine that writes ``reply`` (``engine.requests``: the prompts sent)."""
    from serve_cli.api import ServerState, build_app
    from serve_cli.default_model import build_tokenizer

    engine, tokenizer = ScriptedEngine(reply), build_tokenizer()
    state = ServerState(
        engine, tokenizer, "m", max_model_len=512, vocab_size=tokenizer.vocab_size,
        block_size=16, num_kv_blocks=64, tool_call_parser=parser,
    )  # fmt: skip
    return build_app(state), tokenizer, engine


def _chat(app: Any, **fields: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "chat_template": TEMPLATE, "max_tokens": 64, **fields}  # fmt: skip
    return call(app, "POST", "/v1/chat/completions", body)


def test_a_reply_with_a_call_comes_back_as_tool_calls() -> None:
    app, tokenizer, engine = _app("Let me look.\n" + CALL)
    response = _chat(app, tools=TOOLS)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tokenizer.decode(engine.requests[0][0]).startswith("tool get_weather;user: Weather")


def test_a_streamed_call_comes_in_the_last_delta() -> None:
    app, _, _ = _app("Let me look.\n" + CALL)
    response = _chat(app, tools=TOOLS, stream=True)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == "Let me look.\n"  # the text before the call, as it came
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_tool_messages_reach_the_template_and_none_turns_calls_off() -> None:
    app, tokenizer, engine = _app(CALL)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    assert _chat(app, tools=TOOLS, messages=messages).status_code == 200
    prompt = tokenizer.decode(engine.requests[0][0])
    assert "assistant:  calls get_weather" in prompt and "tool: sunny for c1" in prompt
    response = _chat(app, tools=TOOLS, tool_choice="none")  # no tools shown, no call read
    (choice,) = response.json()["choices"]
    assert choice["message"]["content"] == CALL and choice["message"]["tool_calls"] is None
    assert choice["finish_reason"] == "stop"
    assert not tokenizer.decode(engine.requests[-1][0]).startswith("tool")


@pytest.mark.parametrize(
    "parser, fields, param",
    [
        (None, {"tools": TOOLS}, "tools"),  # the server was not started with a parser
        ("hermes", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ("hermes", {"tools": [{"type": "function", "function": {}}]}, "tools"),
        ("hermes", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ("hermes", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools"),
        ("hermes", {"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_what_cannot_be_served_is_a_400(parser: str | None, fields: dict, param: str) -> None:
    app, _, engine = _app(CALL, parser)
    response = _chat(app, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert not engine.requests
    if parser is None:
        assert "--enable-auto-tool-choice" in error["message"]


def test_the_command_line_flags_go_together(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from click.testing import CliRunner

    import serve_cli.server
    from serve_cli.cli import TOOL_CALL_PARSERS, main

    assert TOOL_CALL_PARSERS == PARSERS
    started: list[Any] = []
    monkeypatch.setattr(serve_cli.server, "serve", lambda options, config: started.append(options))
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        result = CliRunner().invoke(main, ["builtin:tiny-random", *flags])
        assert result.exit_code == 2 and "go together" in result.output
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert CliRunner().invoke(main, ["builtin:tiny-random", *flags]).exit_code == 0
    assert [o.tool_call_parser for o in started] == ["hermes"]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    app, _, _ = _app(CALL + CALL.replace("Paris", "Oslo"))
    for stream in (False, True):
        response = _chat(app, tools=TOOLS, parallel_tool_calls=False, stream=stream)
        assert response.status_code == 200, response.text
        assert response.text.count("get_weather") == 1 and "Oslo" not in response.text
    both = _chat(app, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert len(both) == 2
    bad = _chat(app, tools=TOOLS, tool_choice="sometimes")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_tokenize_shows_the_tools_as_chat_does() -> None:
    """vLLM's /tokenize of a conversation takes its tools (no parser needed: nothing is read
    back), and counts what a chat request with them would send."""
    app, tokenizer, engine = _app(CALL, parser=None)
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "chat_template": TEMPLATE, "tools": TOOLS}  # fmt: skip
    response = call(app, "POST", "/tokenize", body)
    assert response.status_code == 200, response.text
    assert tokenizer.decode(response.json()["tokens"]).startswith("tool get_weather;user:")
