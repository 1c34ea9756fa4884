"""The engine's sampling rules end to end on a tiny random checkpoint: penalties and
``min_tokens`` against an offline loop applying them by hand, prompt scores against transformers,
batched, with async scheduling, chunked prefills, the prefix cache and preemption."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from serve_cli.engine.core import EngineCore
from serve_cli.engine.errors import ParamError
from serve_cli.engine.offline import generate
from serve_cli.engine.sampling import SamplingParams
from tests.support.engine_runs import GREEDY, drain, random_prompts, small_engine

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _penalized_argmax(params: SamplingParams, blocked: tuple[int, ...] = ()):
    """The greedy pick with ``params``' penalties applied by hand, token by token, in float64:
    repetition over the prompt and the output, frequency and presence over the output (vLLM's
    rules), and ``blocked`` never picked while the output is under ``min_tokens``."""

    def pick(logits: torch.Tensor, prompt: list[int], out: list[int]) -> int:
        scores = logits.double().clone()
        if len(out) < params.min_tokens:
            scores[list(blocked)] = float("-inf")
        for token in set(prompt) | set(out):
            s = float(scores[token])
            r = params.repetition_penalty
            scores[token] = s / r if s > 0 else s * r
        for token in set(out):
            scores[token] -= params.frequency_penalty * out.count(token)
            scores[token] -= params.presence_penalty
        return int(scores.argmax())

    return pick


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_an_offline_loop_applying_them_by_hand(
    llama_gqa_dir: Path, reference, async_scheduling: bool
) -> None:
    """Requests with penalties batched with one without (and a sampled, seeded one), with async
    scheduling too, where a step's penalties must count the token of the step still in flight."""
    engine = small_engine(llama_gqa_dir, async_scheduling=async_scheduling)
    prompts = random_prompts([9, 30, 4, 12], seed=3)
    n = 24
    cases = [
        replace(GREEDY, max_tokens=n, frequency_penalty=1.5),
        replace(GREEDY, max_tokens=n, presence_penalty=2.0, repetition_penalty=1.3),
        replace(GREEDY, max_tokens=n, repetition_penalty=2.0),
        replace(GREEDY, max_tokens=n),
    ]
    expected = [reference(p, n, _penalized_argmax(c)) for p, c in zip(prompts, cases)]
    plain = [reference(p, n) for p in prompts]
    assert all(e != g for e, g in zip(expected[:3], plain[:3]))  # the penalties change the output
    assert expected[3] == plain[3]
    sampled = replace(GREEDY, max_tokens=n, temperature=0.8, seed=5, frequency_penalty=0.5)
    engine.add_request("sampled", prompts[0], sampled)
    for i, (prompt, params) in enumerate(zip(prompts, cases)):
        engine.add_request(str(i), prompt, params)
    outputs = drain(engine)
    got = [[t for out in outputs[str(i)] for t in out.new_token_ids] for i in range(len(cases))]
    assert got == expected
    assert len([t for out in outputs["sampled"] for t in out.new_token_ids]) == n


def test_penalty_values_are_checked() -> None:
    bad = [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
           ("repetition_penalty", float("nan"))]  # fmt: skip
    for field, value in bad:
        with pytest.raises(ParamError) as info:
            replace(GREEDY, **{field: value})
        assert info.value.param == field


def test_min_tokens_holds_back_eos_and_stop_token_ids(llama_gqa_dir: Path, reference) -> None:
    """The token greedy decoding picks first is a stop token: with min_tokens 6 the request goes
    on (that token never picked before 6 tokens, as by hand) and stops at its first pick after.
    What is held back is EOS (unless ignore_eos) and the stop tokens, only with min_tokens."""
    prompt = random_prompts([11], seed=9)[0]
    first = reference(prompt, 1)[0]
    engine = small_engine(llama_gqa_dir, async_scheduling=True)
    stops = replace(GREEDY, max_tokens=30, min_tokens=6, stop_token_ids=(first,))
    by_hand = reference(prompt, 30, _penalized_argmax(stops, blocked=(first,)))
    assert first not in by_hand[:6]
    cut = next((i + 1 for i, t in enumerate(by_hand) if t == first), 30)
    engine.add_request("stops", prompt, stops)
    eos = replace(GREEDY, min_tokens=3, ignore_eos=False, stop_token_ids=(first,))
    engine.add_request("eos", prompt, eos)
    engine.add_request("plain", prompt, replace(GREEDY, stop_token_ids=(first,)))
    states = engine._states
    assert states["stops"].seen.blocked_token_ids == [first]  # ignore_eos: EOS is not held
    assert states["eos"].seen.blocked_token_ids == sorted({first, *engine.eos_token_ids})
    assert states["plain"].seen is None  # nothing to hold back, nothing kept
    outputs = drain(engine)
    got = [t for out in outputs["stops"] for t in out.new_token_ids]
    assert got == by_hand[:cut]
    assert outputs["stops"][-1].finish_reason == ("stop" if cut < 30 else "length")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_transformers(llama_gqa_dir: Path, async_scheduling: bool) -> None:
    """Every prompt token after the first is scored by the logits before it, over chunked
    prefills (90 tokens > the 64-token budget) and a prompt the prefix cache already holds (a
    scored prompt is computed whole); the top entries are the most likely tokens there."""
    import transformers

    engine = small_engine(llama_gqa_dir, async_scheduling=async_scheduling)
    long, short = random_prompts([90, 20], seed=11)
    params = replace(GREEDY, max_tokens=2, prompt_logprobs=3)
    generate(engine, [short], GREEDY)  # now in the prefix cache
    for i, prompt in enumerate((long, short)):
        engine.add_request(str(i), prompt, params)
    outputs = drain(engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_gqa_dir, dtype=torch.float32)
    for i, prompt in enumerate((long, short)):
        first = outputs[str(i)][0]
        assert [o.prompt_logprobs for o in outputs[str(i)][1:]] == [None] * 1  # sent once
        scores = first.prompt_logprobs
        assert len(scores) == len(prompt) and scores[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        for p in range(1, len(prompt)):
            token, logprob, top, rank = scores[p]
            assert token == prompt[p]
            assert logprob == pytest.approx(float(logp[p - 1, token]), abs=1e-4)
            assert [t for t, _ in top] == logp[p - 1].topk(3).indices.tolist()
            assert rank == int((logp[p - 1] > logp[p - 1, token]).sum()) + 1


def test_prompt_logprobs_survive_preemption(llama_gqa_dir: Path, engine: EngineCore) -> None:
    """A preempted request computes its prompt again; its scores are sent once, each position
    once, as a run without preemption gives them."""
    prompts = random_prompts([30, 28, 25, 33], seed=4)
    params = replace(GREEDY, max_tokens=20, prompt_logprobs=0)

    def scores(eng: EngineCore) -> list[list]:
        for i, prompt in enumerate(prompts):
            eng.add_request(f"p{i}", prompt, params)
        outputs = drain(eng)
        sent = [[o.prompt_logprobs for o in outputs[f"p{i}"] if o.prompt_logprobs]
                for i in range(len(prompts))]  # fmt: skip
        assert all(len(s) == 1 for s in sent)
        return [s[0] for s in sent]

    tight = small_engine(llama_gqa_dir, num_kv_blocks=8)
    got = scores(tight)
    assert tight.stats()["num_preemptions_total"] > 0
    expected = scores(engine)
    for g, e, prompt in zip(got, expected, prompts):
        assert [x and x.token_id for x in g] == [None, *prompt[1:]]
        assert [x and x.logprob for x in g] == pytest.approx([x and x.logprob for x in e], abs=1e-5)
