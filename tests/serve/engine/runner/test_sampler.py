"""The engine's sampler (``serve_cli.engine.runner.sampler``) on the CPU: greedy rows are the
argmax, sampled rows follow softmax(logits / T) restricted by top-k and top-p (counted against the
probabilities computed here in float64), logprobs are the raw logits' log-softmax, and a seeded
request's tokens do not depend on what it is batched with."""

from __future__ import annotations

import math

import pytest
import torch

from serve_cli.engine.runner.sampler import Sampler
from serve_cli.engine.sampling import SamplingParams

CPU = torch.device("cpu")
ROW = [2.0, 1.0, 0.5, -1.0, 0.0]  # one vocabulary of 5, a clear order: 0 > 1 > 2 > 4 > 3
DRAWS = 4000


def softmax64(row: list[float], temperature: float) -> list[float]:
    """softmax(row / T) in float64, by hand."""
    top = max(row)
    e = [math.exp((x - top) / temperature) for x in row]
    return [v / sum(e) for v in e]


def frequencies(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(v) / len(tokens) for v in range(vocab)]


def draw(params: SamplingParams, seed: int = 0) -> list[int]:
    """``DRAWS`` rows of ``ROW`` sampled with ``params`` on the engine's shared generator."""
    logits = torch.tensor([ROW] * DRAWS)
    tokens, _ = Sampler(CPU, seed).sample(logits, [params] * DRAWS, [None] * DRAWS)
    return tokens


def test_greedy_rows_are_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = Sampler(CPU, 0).sample(
        logits, [SamplingParams(temperature=0)] * 6, [None] * 6
    )
    assert tokens == [int(r.argmax()) for r in logits]
    assert logprobs == [None] * 6


# 4000 draws: a frequency's standard error is at most 0.008, so 0.03 is about four of them
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_rows_follow_the_tempered_softmax(temperature: float) -> None:
    freq = frequencies(draw(SamplingParams(temperature=temperature)), len(ROW))
    for got, want in zip(freq, softmax64(ROW, temperature)):
        assert abs(got - want) < 0.03, (freq, temperature)


def test_top_k_keeps_the_k_most_likely_renormalized() -> None:
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_k=2)), len(ROW))
    p = softmax64(ROW[:2], 1.0)  # tokens 0 and 1 only
    assert freq[2:] == [0.0, 0.0, 0.0]
    assert abs(freq[0] - p[0]) < 0.03 and abs(freq[1] - p[1]) < 0.03


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    p = softmax64(ROW, 1.0)  # p[0] ~ 0.53, p[0] + p[1] ~ 0.73: top_p 0.6 keeps tokens 0 and 1
    assert p[0] < 0.6 < p[0] + p[1]
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_p=0.6)), len(ROW))
    assert freq[2:] == [0.0, 0.0, 0.0]
    assert abs(freq[0] - p[0] / (p[0] + p[1])) < 0.03


def test_top_k_of_one_is_greedy_at_any_temperature() -> None:
    assert set(draw(SamplingParams(temperature=5.0, top_k=1))) == {0}


def test_logprobs_are_the_raw_log_softmax() -> None:
    """Logprobs come from the logits before temperature: the chosen token's and the top n, most
    likely first, checked against a float64 log-softmax; rows that did not ask get None."""
    logits = torch.tensor([ROW, ROW[::-1]])
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7)]
    tokens, logprobs = Sampler(CPU, 0).sample(logits, params, [None, None])
    assert tokens[0] == 0 and logprobs[1] is None
    got = logprobs[0]
    logz = math.log(sum(math.exp(x) for x in ROW))
    want = sorted(((i, x - logz) for i, x in enumerate(ROW)), key=lambda t: -t[1])[:3]
    assert got.token_id == 0 and got.logprob == pytest.approx(ROW[0] - logz, abs=1e-6)
    assert [t for t, _ in got.top] == [t for t, _ in want]
    assert [v for _, v in got.top] == pytest.approx([v for _, v in want], abs=1e-6)


def test_a_seeded_request_ignores_its_batch() -> None:
    """The same seed gives the same tokens alone and beside other requests (seeded or not), in
    any row; and the shared generator of the unseeded rows makes a run reproducible."""
    sampler = Sampler(CPU, 0)
    hot = SamplingParams(temperature=1.5)
    logits = torch.tensor([ROW] * 3)

    def seeded(tokens_per_step: int, rows: int, at: int) -> list[int]:
        gen = sampler.new_generator(1234)
        out = []
        for _ in range(tokens_per_step):
            gens = [gen if r == at else None for r in range(rows)]
            out.append(sampler.sample(logits[:rows], [hot] * rows, gens)[0][at])
        return out

    alone = seeded(20, 1, 0)
    assert seeded(20, 3, 2) == alone and seeded(20, 3, 1) == alone
    assert len(set(alone)) > 1  # at T=1.5 twenty draws are not all the same token
    assert draw(hot, seed=7) == draw(hot, seed=7)
    assert draw(hot, seed=7) != draw(hot, seed=8)


def test_penalties_steer_the_pick_and_leave_logprobs_raw() -> None:
    """A greedy row with a presence penalty of 2 (ROW's gaps are 1 and 0.5): the tokens it has
    generated fall behind, step after step, through the counts it keeps on the device; its
    logprobs stay the raw logits'. A row without a penalty beside it keeps the argmax."""
    from serve_cli.engine.runner.seen_tokens import SeenTokens

    sampler = Sampler(CPU, 0)
    penalized = SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1)
    plain = SamplingParams(temperature=0)
    seen = SeenTokens(prompt_token_ids=[4])  # the prompt counts only for repetition_penalty
    logits = torch.tensor([ROW, ROW])
    picks = []
    for _ in range(3):
        tokens, logprobs = sampler.sample(logits, [penalized, plain], [None, None], [seen, None])
        picks.append(tokens)
        raw = torch.log_softmax(logits[0].double(), -1)
        assert logprobs[0].logprob == pytest.approx(float(raw[tokens[0]]), abs=1e-6)
    # 0, then 1 (0 is at 0.0 now), then 2 (0.5 beats 0 and 1 at 0.0 and -1.0)
    assert [t[0] for t in picks] == [0, 1, 2] and [t[1] for t in picks] == [0, 0, 0]
    assert seen.counts.tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="SeenTokens"):
        sampler.sample(logits, [penalized, plain], [None, None])


def test_logit_bias_and_min_p() -> None:
    """The bias is added to the raw logits before the pick (logprobs stay raw); min_p keeps the
    tokens at least min_p times as likely as the likeliest after temperature: with ROW at T=1,
    min_p 0.3 keeps 0 (1.0) and 1 (e^-1 = 0.37) and drops 2 (e^-1.5 = 0.22)."""
    bias = SamplingParams(temperature=0, logit_bias=((3, 10.0),), logprobs=1)
    tokens, logprobs = Sampler(CPU, 0).sample(torch.tensor([ROW]), [bias], [None])
    assert tokens == [3]
    raw = torch.log_softmax(torch.tensor(ROW, dtype=torch.float64), -1)
    assert logprobs[0].logprob == pytest.approx(float(raw[3]), abs=1e-6)
    freq = frequencies(draw(SamplingParams(temperature=1.0, min_p=0.3)), len(ROW))
    kept = softmax64(ROW[:2], 1.0)
    assert freq[2:] == [0, 0, 0] and freq[0] == pytest.approx(kept[0], abs=0.03)


def test_min_tokens_holds_back_the_blocked_tokens() -> None:
    """Token 0 (ROW's argmax) stands for EOS: it cannot be picked until 2 tokens are out."""
    from serve_cli.engine.runner.seen_tokens import SeenTokens

    sampler = Sampler(CPU, 0)
    params = SamplingParams(temperature=0, min_tokens=2)
    seen = SeenTokens(prompt_token_ids=[1], blocked_token_ids=[0])
    picks = [sampler.sample(torch.tensor([ROW]), [params], [None], [seen])[0][0] for _ in range(3)]
    assert picks == [1, 1, 0]
