"""xhal-serve's HTTP API, driven with the official ``openai`` client against the real server
process serving the built-in tiny random model. Fault paths are in
test_serve_faults.py, the command line in test_serve_cli.py.

Every check compares against what the request itself implies (lengths, stop positions, the
text of an unconstrained greedy run) or against OpenAI's documented shapes.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from tests.support.launcher import ServerProcess
from tests.support.readme_examples import run_curl_example
from tests.support.tiny_server import TINY_MODEL_NAME, tiny_server_args

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
def server():
    """The built-in tiny random model (generated once into XHAL_CACHE_DIR): fast anywhere."""
    with ServerProcess(tiny_server_args("--log-level", "warning")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def post(server: ServerProcess, path: str, body: Any, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=300)
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)


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


def test_penalties_change_what_is_sampled(server: ServerProcess) -> None:
    """The served route applies them (the rules are checked against a by-hand loop in
    tests/serve/engine/test_engine.py); out of range is a 400 naming the field."""
    body = {**GOOD, "prompt": "a b a b a b", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    plain = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    for field, value in (("frequency_penalty", 2.0), ("repetition_penalty", 3.0)):
        for stream in (False, True):
            response = post(server, "/v1/completions", {**body, field: value, "stream": stream})
            assert response.status_code == 200, response.text
        ids = post(server, "/v1/completions", {**body, field: value}).json()["choices"][0]
        assert ids["token_ids"] != plain and len(ids["token_ids"]) == 24, field
    for field, value in (("presence_penalty", 2.5), ("repetition_penalty", 0), ("min_p", 1.5),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"999999": 1}),
                         ("logit_bias", {"5": 101}), ("min_tokens", 3)):  # fmt: skip
        response = post(server, "/v1/completions", {**GOOD, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_logit_bias_and_min_p(server: ServerProcess) -> None:
    """A bias of 100 on one token makes greedy decoding pick it every time; min_p 1 leaves a
    sampled request only the likeliest token, so it decodes as greedy does."""
    body = {**GOOD, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    forced = {**body, "temperature": 0, "logit_bias": {"7": 100}}
    assert post(server, "/v1/completions", forced).json()["choices"][0]["token_ids"] == [7] * 6
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    floored = post(server, "/v1/completions", {**body, "temperature": 1.5, "min_p": 1}).json()
    assert floored["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_min_tokens_delays_the_stop(server: ServerProcess) -> None:
    """A stop token id that greedy decoding picks first cannot end the output before min_tokens
    tokens are out."""
    body = {**GOOD, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    first = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"][0]
    stopped = post(server, "/v1/completions", {**body, "stop_token_ids": [first]}).json()
    assert stopped["choices"][0]["token_ids"] == [first]
    held = {**body, "stop_token_ids": [first], "min_tokens": 5}
    choice = post(server, "/v1/completions", held).json()["choices"][0]
    assert len(choice["token_ids"]) >= 5 and first not in choice["token_ids"][:5]


def test_echo_repeats_the_prompt(server: ServerProcess) -> None:
    """Completions' ``echo``: the text begins with the prompt's (token ids decoded), streamed
    with each choice's first output."""
    body = {**GOOD, "prompt": "The morning was", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    echoed = post(server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "The morning was" + plain
    streamed = post(server, "/v1/completions", {**body, "echo": True, "stream": True}).text
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
             if line.startswith("data: {")]  # fmt: skip
    assert texts[0].startswith("The morning was") and "".join(texts) == echoed
    ids = {**body, "prompt": [5, 6, 7], "echo": True, "n": 2}
    choices = post(server, "/v1/completions", ids).json()["choices"]
    tokenized = post(server, "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}).json()["prompt"]
    assert all(c["text"].startswith(tokenized) for c in choices) and len(choices) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess, stream: bool) -> None:
    """lm-eval's loglikelihood request: echo, logprobs and max_tokens 0 give every prompt token's
    logprob (the first null). Scoring the prompt with its greedy continuation appended gives that
    token the logprob it had when it was sampled, from the same position's logits."""
    prompt = [11, 12, 13, 14, 15]
    body = {**GOOD, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    sampled = post(server, "/v1/completions", body).json()["choices"][0]
    (token,), (logprob,) = sampled["token_ids"], sampled["logprobs"]["token_logprobs"]
    scored = {**body, "prompt": prompt + [token], "echo": True, "max_tokens": 0, "stream": stream}
    response = post(server, "/v1/completions", scored)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        (choice,) = [c["choices"][0] for c in chunks if c["choices"]]
    else:
        (choice,) = response.json()["choices"]
        assert response.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and choice["token_ids"] in ([], None)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    # the 2 likeliest and, when it is not one of them, the token itself (OpenAI's rule)
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert all(t in top for t, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert lp["token_logprobs"][-1] == pytest.approx(logprob, abs=1e-4)
    assert choice["finish_reason"] == "length"
    zero = post(server, "/v1/completions", {**GOOD, "max_tokens": 0})  # 0 only with echo
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens"


def test_what_vllm_requests_also_set(server: ServerProcess) -> None:
    """A stop token ends the output without its text (its id stays); add_special_tokens false
    drops the BOS; truncate_prompt_tokens keeps the prompt's last tokens; a seed outside int64
    is a 400."""
    body = {**GOOD, "prompt": "hello", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    first = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"][0]
    stopped = post(server, "/v1/completions", {**body, "stop_token_ids": [first]}).json()
    (choice,) = stopped["choices"]
    assert choice["token_ids"] == [first] and choice["text"] == ""
    assert choice["stop_reason"] == first and choice["finish_reason"] == "stop"
    scored = {**GOOD, "prompt": "x y", "max_tokens": 0, "echo": True, "logprobs": 0}
    with_bos = post(server, "/v1/completions", scored).json()["usage"]["prompt_tokens"]
    bare = post(server, "/v1/completions", {**scored, "add_special_tokens": False}).json()
    assert bare["usage"]["prompt_tokens"] == with_bos - 1
    cut = {**GOOD, "prompt": "x y z w", "truncate_prompt_tokens": 2}
    assert post(server, "/v1/completions", cut).json()["usage"]["prompt_tokens"] == 2
    seed = post(server, "/v1/completions", {**GOOD, "seed": 2**64})
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed"


def test_return_token_ids_gives_the_prompts_too(server: ServerProcess) -> None:
    """vLLM's return_token_ids: the prompt's ids with each completion choice (a stream's first
    chunk of it) and with a chat response (a stream's first chunk)."""
    body = {**GOOD, "prompt": [5, 6, 7], "return_token_ids": True, "n": 2}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6, 7]] * 2
    streamed = post(server, "/v1/completions", {**body, "stream": True}).text
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    firsts = [c for c in chunks if c.get("prompt_token_ids")]
    assert sorted(c["index"] for c in firsts) == [0, 1]
    assert all(c["prompt_token_ids"] == [5, 6, 7] for c in firsts)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "return_token_ids": True}  # fmt: skip
    reply = post(server, "/v1/chat/completions", chat).json()
    tokenized = post(server, "/tokenize", {"model": MODEL, "messages": chat["messages"]}).json()
    assert reply["prompt_token_ids"] == tokenized["tokens"]
    streamed = post(server, "/v1/chat/completions", {**chat, "stream": True}).text
    events = [line[6:] for line in streamed.splitlines() if line.startswith("data: {")]
    assert json.loads(events[0])["prompt_token_ids"] == tokenized["tokens"]


def test_vllm_prompt_logprobs(server: ServerProcess) -> None:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else the token's and the N
    likeliest's logprob, rank and text, keyed by token id; equal to echo's logprobs. Chat has
    them at the response's top. Not streamed (400)."""
    prompt = [11, 12, 13, 14]
    body = {**GOOD, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    (choice,) = post(server, "/v1/completions", body).json()["choices"]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    echoed = {**GOOD, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    echo_lps = post(server, "/v1/completions", echoed).json()["choices"][0]["logprobs"]
    for token, entry, logprob in zip(prompt[1:], scores[1:], echo_lps["token_logprobs"][1:]):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(logprob, abs=1e-6) and mine["rank"] >= 1
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(token) or e["rank"] <= 2)
        assert ranks[:2] == [1, 2] and 2 <= len(entry) <= 3
    both = post(server, "/v1/completions", {**echoed, "logprobs": 1, "prompt_logprobs": 3}).json()
    (choice,) = both["choices"]  # echo's entries keep logprobs' 1 (+ the token), vLLM's its 3
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(entry) >= 3 for entry in choice["prompt_logprobs"][1:])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    reply = post(server, "/v1/chat/completions", chat).json()
    tokenized = post(server, "/tokenize", {"model": MODEL, "messages": chat["messages"]}).json()
    assert len(reply["prompt_logprobs"]) == tokenized["count"]
    streamed = post(server, "/v1/chat/completions", {**chat, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
