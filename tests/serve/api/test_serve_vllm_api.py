"""The parts of vLLM's API surface xhal-serve implements or refuses (issue 18 item 3), in process:
the real app over a scripted engine, the tiny model's real tokenizer as the reference.

Refused fields answer 400 ``unsupported_parameter`` naming the field; fields that need another
one answer 400 naming themselves; a wrong model is 404; ``/tokenize`` equals the tokenizer;
``echo``, ``continue_final_message`` and ``chat_template_kwargs`` change what vLLM changes."""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import pytest

from tests.support.scripted_engine import ScriptedEngine, call
from tests.support.tiny_server import TINY_MODEL_NAME as MODEL
from tests.support.tiny_server import tiny_tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

MAX_MODEL_LEN = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
USAGE = {"include_usage": True}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture
def app(tokenizer: Any):
    from serve_cli.api import ServerState, build_app

    engine = ScriptedEngine()
    state = ServerState(
        engine, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer),
        block_size=16, num_kv_blocks=64, model_root="/models/tiny",
    )  # fmt: skip
    application = build_app(state)
    application.state.engine = engine
    return application


def events(response: httpx.Response) -> list[Any]:
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", response.text
    return [json.loads(d) for d in data[:-1]]


# --- refused, not ignored ------------------------------------------------------------------------

REFUSED = [  # (field, a value that would change the answer, routes it applies to)
    ("suffix", " and so on", ("completions",)),
    ("best_of", 3, ("completions",)),
    ("functions", [{"name": "f", "parameters": {}}], ("chat",)),
    ("function_call", "auto", ("chat",)),
    ("tool_choice", "required", ("chat",)),
    ("parallel_tool_calls", False, ("completions",)),  # chat takes it (test_tool_calls.py)
    ("allowed_token_ids", [7], ("completions", "chat")),
    ("include_stop_str_in_output", True, ("completions", "chat")),
    ("use_beam_search", True, ("completions", "chat")),
]


@pytest.mark.parametrize("field,value,routes", REFUSED, ids=[f for f, _, _ in REFUSED])
def test_unsupported_fields_are_refused(app: Any, field: str, value: Any, routes: tuple) -> None:
    for route in routes:
        path, body = (
            ("/v1/chat/completions", CHAT) if route == "chat" else ("/v1/completions", COMPLETION)
        )
        for stream in (False, True):
            response = call(app, "POST", path, {**body, field: value, "stream": stream})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    assert app.state.engine.requests == []  # nothing reached the engine


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**COMPLETION, "stream_options": USAGE}, "stream_options"),
        ("/v1/chat/completions", {**CHAT, "stream_options": USAGE}, "stream_options"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": MAX_MODEL_LEN},
         "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "continue_final_message": True},
         "continue_final_message"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs"),
    ],
    ids=["stream_options-completions", "stream_options-chat", "top_logprobs-unset",
         "top_logprobs-false", "max_tokens-past-context", "chat-max_tokens-past-context",
         "max_completion_tokens-past-context", "continue-and-generation-prompt",
         "template-kwargs-override"],
)  # fmt: skip
def test_fields_that_need_another_are_refused(app: Any, path: str, body: dict, param: str) -> None:
    response = call(app, "POST", path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert app.state.engine.requests == []


def test_max_tokens_up_to_the_context_is_accepted(app: Any, tokenizer: Any) -> None:
    num_prompt = len(tokenizer("Hello")["input_ids"])
    body = {**COMPLETION, "max_tokens": MAX_MODEL_LEN - num_prompt}
    assert call(app, "POST", "/v1/completions", body).status_code == 200
    assert app.state.engine.requests[0][1].max_tokens == MAX_MODEL_LEN - num_prompt


def test_a_wrong_model_is_404(app: Any) -> None:
    for method, path, body in (
        ("POST", "/v1/completions", {**COMPLETION, "model": "gpt-7"}),
        ("POST", "/v1/chat/completions", {**CHAT, "model": "gpt-7"}),
        ("POST", "/v1/completions", {**COMPLETION, "model": "gpt-7", "stream": True}),
        ("POST", "/tokenize", {"model": "gpt-7", "prompt": "hi"}),
        ("POST", "/detokenize", {"model": "gpt-7", "tokens": [5]}),
        ("GET", "/v1/models/gpt-7", None),
    ):
        response = call(app, method, path, body)
        assert response.status_code == 404, (path, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "model",
            "model_not_found",
            "not_found_error",
        )
        assert MODEL in error["message"]  # says what is served


# --- vLLM's extra endpoints ----------------------------------------------------------------------


def test_tokenize_and_detokenize_equal_the_tokenizer(app: Any, tokenizer: Any) -> None:
    text = "Where did you put the keys?"
    expected = tokenizer(text)["input_ids"]
    reply = call(app, "POST", "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert reply == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected,
                     "token_strs": None}  # fmt: skip
    bare = call(app, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False,
                                           "return_token_strs": True}).json()  # fmt: skip
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    back = call(app, "POST", "/detokenize", {"model": MODEL, "tokens": expected}).json()
    assert back == {"prompt": tokenizer.decode(expected)}
    outside = call(app, "POST", "/detokenize", {"tokens": [len(tokenizer) + 5]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    unknown = call(app, "POST", "/tokenize", {"prompt": text, "bogus": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bogus"


def test_tokenize_messages_follows_the_chat_template(app: Any, tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "The answer is"},
    ]
    for options in ({}, {"add_generation_prompt": False},
                    {"add_generation_prompt": False, "continue_final_message": True}):  # fmt: skip
        # the server opens the assistant's turn unless told not to (vLLM's default)
        reference = {"add_generation_prompt": True, **options}
        text = tokenizer.apply_chat_template(messages, tokenize=False, **reference)
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        reply = call(app, "POST", "/tokenize", {"messages": messages, **options}).json()
        assert reply["tokens"] == expected, options
    # continuing leaves the last message open: the text ends with it, no end-of-turn after it
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids = call(app, "POST", "/tokenize", {"messages": messages, **options}).json()["tokens"]
    assert tokenizer.decode(ids).endswith("<|assistant|>\nThe answer is")


def test_version_ping_and_the_model_card(app: Any) -> None:
    assert call(app, "GET", "/version").json() == {"version": metadata.version("xhal")}
    assert call(app, "GET", "/ping").status_code == 200
    assert call(app, "POST", "/ping").status_code == 200
    card = call(app, "GET", f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["root"] == "/models/tiny"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert call(app, "GET", "/v1/models").json()["data"] == [card]
    app.state.server.client.dead_reason = "the engine process died (exit code -9)"
    assert call(app, "GET", "/ping").status_code == 503


# --- chat rendering options ---------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(app: Any, tokenizer: Any) -> None:
    template = "{% if enable_thinking %}THINK {% endif %}{{ messages[-1]['content'] }}"
    body = {**CHAT, "chat_template": template}
    for kwargs, text in (({"enable_thinking": True}, "THINK Hello"), ({}, "Hello")):
        response = call(
            app, "POST", "/v1/chat/completions", {**body, "chat_template_kwargs": kwargs}
        )
        assert response.status_code == 200, response.text
        prompt, _ = app.state.engine.requests[-1]
        assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_continue_final_message_with_echo_repeats_it(app: Any, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    reply = call(app, "POST", "/v1/chat/completions", body).json()
    message = reply["choices"][0]["message"]
    # the engine writes x; no tools were offered, so no calls
    assert message == {"role": "assistant", "content": "Once upon" + "xxx", "tool_calls": None}
    prompt, _ = app.state.engine.requests[-1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)  # fmt: skip
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    streamed = events(call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed) == "Once uponxxx"
    )
    # a last message of another role than the reply's is not echoed
    plain = {**CHAT, "echo": True, "max_tokens": 2}
    assert (
        call(app, "POST", "/v1/chat/completions", plain).json()["choices"][0]["message"]["content"]
        == "xx"
    )


def test_choices_carry_stop_reason(app: Any) -> None:
    reply = call(app, "POST", "/v1/completions", COMPLETION).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in reply["choices"][0] and reply["choices"][0]["stop_reason"] is None
