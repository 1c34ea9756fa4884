"""xhal-serve's HTTP API, driven with the official ``openai`` client against the real server
process serving the built-in tiny random model. Fault paths are in
test_serve_faults.py, the command line in test_serve_cli.py.

Every check compares against what the request itself implies (lengths, stop positions, the
text of an unconstrained greedy run) or against OpenAI's documented shapes.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.launcher import ServerProcess, post
from tests.support.readme_examples import run_curl_example
from tests.support.tiny_server import TINY_MODEL_NAME

openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")


MODEL = TINY_MODEL_NAME
CURL_EXAMPLES = [  # the README's, aimed at the tiny model (test_builtin_smollm2 runs the README's)
    """curl http://127.0.0.1:8000/v1/completions -H "Content-Type: application/json" \\
  -d '{"model": "xhal-tiny-random", "prompt": "The morning was", "max_tokens": 16}'""",
    """curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \\
  -d '{"model": "xhal-tiny-random", "messages": [{"role": "user", "content": "Hello!"}],
       "max_tokens": 16}'""",
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


# --- the happy paths, through the openai client ------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_not_streamed(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="The morning was",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_streamed_matches_not_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello! Thank you", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_token_id_and_batched_prompts(client: openai.OpenAI) -> None:
    single = client.completions.create(
        model=MODEL,
        prompt="One, two, three",
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    # the same prompt as token ids, and twice in one request
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=1).choices
    assert len(ids) == 1
    batch = client.completions.create(
        model=MODEL, prompt=["One, two, three"] * 2, max_tokens=5, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert {c.text for c in batch.choices} == {single.choices[0].text}
    assert batch.usage.prompt_tokens == 2 * single.usage.prompt_tokens


def test_n_samples(client: openai.OpenAI) -> None:
    request = dict(
        model=MODEL, prompt="The children", max_tokens=6, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**request)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    again = client.completions.create(**request)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    streamed = client.completions.create(**request, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        prompt="Where did you put",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    # three plain characters from the second half (whole characters, not split bytes)
    windows = [full[i : i + 3] for i in range(len(full) // 2, len(full) - 2)]
    stop = next((w for w in windows if w.isascii() and w.strip().isalnum()), None)
    assert stop, f"need a visible stop string in {full!r}"
    cut = full[: full.index(stop)]
    out = client.completions.create(**kwargs, stop=[stop, "never-appears"]).choices[0]
    assert (out.text, out.finish_reason) == (cut, "stop")
    assert out.stop_reason == stop  # which stop string ended it, as vLLM reports
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_stop_token_ids_end_the_output_after_the_token(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Where did you put", max_tokens=12, temperature=0)
    body = {"ignore_eos": True, "return_token_ids": True}
    full = client.completions.create(**kwargs, extra_body=body).choices[0].token_ids
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    out = client.completions.create(**kwargs, extra_body={**body, "stop_token_ids": [full[k]]})
    assert (out.choices[0].token_ids, out.choices[0].finish_reason) == (full[: k + 1], "stop")
    assert out.choices[0].stop_reason == full[k]


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Why is the sky",
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy took the best


def test_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    message = out.choices[0].message
    assert message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    usage = chunks[-1].usage  # (cached_tokens may differ: the second run hits the prefix cache)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        out.usage.prompt_tokens,
        out.usage.completion_tokens,
    )


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_health_and_metrics(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = server.metrics()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "prefix_cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
        "kv_cache_usage_perc",
    ):
        assert f"xhal_{name}" in samples
    assert samples["xhal_generation_tokens_total"] > 0
    assert samples['xhal_time_to_first_token_seconds_bucket{le="+Inf"}'] > 0
    # the real engine's figures: steps were counted, requests were scheduled and finished
    for name in ("iteration_tokens_total", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "e2e_request_latency_seconds"):  # fmt: skip
        assert samples[f"xhal_{name}_count"] > 0, name
    assert samples['xhal_request_success_total{finished_reason="length"}'] > 0
    assert 0 <= samples["xhal_kv_cache_usage_perc"] <= 1
    labelled = server.metrics(raw=True)
    assert all(f'model_name="{MODEL}"' in name for name in labelled)


def test_curl_examples(server: ServerProcess) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    for example in CURL_EXAMPLES:
        run_curl_example(server.port, example)


# --- bad input: 400 naming the field, and the server keeps serving ------------------------------

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
BAD_INPUTS = [
    ("missing model", {k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens < 0", {**GOOD, "max_tokens": -3}, "max_tokens"),
    ("prompt too long", {**GOOD, "prompt": [5] * 2049}, "prompt"),  # max_model_len 2048
    ("temperature < 0", {**GOOD, "temperature": -0.5}, "temperature"),
    ("top_p 0", {**GOOD, "top_p": 0}, "top_p"),
    ("top_p > 1", {**GOOD, "top_p": 1.5}, "top_p"),
    ("n 0", {**GOOD, "n": 0}, "n"),
    ("stop not a string", {**GOOD, "stop": 42}, "stop"),
    ("stop list of ints", {**GOOD, "stop": [1, 2]}, "stop"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("token id out of vocab", {**GOOD, "prompt": [10**9]}, "prompt"),
    ("stop_token_ids negative", {**GOOD, "stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize(
    "body,param", [(b, p) for _, b, p in BAD_INPUTS], ids=[name for name, _, _ in BAD_INPUTS]
)
def test_bad_completion_input_is_400(server: ServerProcess, body: dict, param: str) -> None:
    for stream in (False, True):
        response = post(server, "/v1/completions", {**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert error["message"]
    assert post(server, "/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2100}]}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
    ],
)
def test_bad_chat_input_is_400(server: ServerProcess, body: dict, param: str) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "field,value",
    [("response_format", {"type": "json_object"}), ("bad_words", ["x"]),
     ("functions", [{"name": "f"}])],
)  # fmt: skip
def test_unimplemented_sampling_fields_are_refused_not_ignored(
    server: ServerProcess, field: str, value: object
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", chat)):
        response = post(server, path, {**body, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter"
        assert "not supported" in error["message"]
    # at the value that leaves sampling alone, as clients send by default, they are accepted
    neutral = {"response_format": {"type": "text"}, "bad_words": [], "functions": []}[field]
    assert post(server, "/v1/completions", {**GOOD, field: neutral}).status_code == 200


def test_unknown_model_is_404(server: ServerProcess) -> None:
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    completion = {**GOOD, "model": "gpt-7"}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        response = post(server, path, body)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"


def test_malformed_json_is_400(server: ServerProcess) -> None:
    for raw in (b'{"model": "xhal-tiny-random", "prompt": ', b"[1, 2]", b"not json"):
        response = post(server, "/v1/completions", None, raw=raw)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_text_with_a_lone_surrogate_is_400(server: ServerProcess) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no tokenizer takes: a 400 naming the
    field, not a 500 (sent as ASCII JSON, the one way a client can send it)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", {**GOOD, "prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": ["fine", "\udfff"]}, "prompt"),
        ("/v1/chat/completions", chat, "messages"),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
    ]
    for path, body, param in cases:
        response = post(server, path, None, raw=json.dumps(body).encode())
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "surrogate" in error["message"]
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_null_is_the_default(server: ServerProcess) -> None:
    """OpenAI's optional fields take null for their default: n 1, no stream, no logprobs."""
    completion = {**GOOD, "n": None, "stream": None, "echo": None, "logprobs": None}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "n": None, "stream": None, "logprobs": None, "add_generation_prompt": None}  # fmt: skip
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["logprobs"] is None
    missing = post(server, "/v1/completions", {**GOOD, "model": None})  # required: null is not it
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_errors_inside_a_field_name_the_place(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"content": "y"}]}
    error = post(server, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "messages" and "'messages[1].role' is required" in error["message"]
    error = post(server, "/v1/completions", {**GOOD, "n": 2, "best_of": 1}).json()["error"]
    assert error["param"] == "best_of" and "at least 'n'" in error["message"]

