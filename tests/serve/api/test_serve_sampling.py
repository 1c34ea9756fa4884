"""xhal-serve's sampling and scoring fields on the real server process serving the built-in tiny
random model: penalties, ``logit_bias``, ``min_p``, ``min_tokens``, ``echo`` with prompt scoring,
vLLM's ``prompt_logprobs`` and the other vLLM request fields. The rules themselves are checked
against by-hand and transformers references in tests/serve/engine/test_engine.py."""

from __future__ import annotations

import json

import pytest

from tests.support.launcher import ServerProcess, post
from tests.support.tiny_server import TINY_MODEL_NAME

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

MODEL = TINY_MODEL_NAME
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


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
