"""The API process's output processor: the engine's token-id outputs -> text deltas, stop strings
cut where the engine used to cut them, the engine told to stop, later outputs dropped. The
reference is the tokenizer's full decode of the output ids."""

from __future__ import annotations

import pytest

from serve_cli.engine.output import RequestOutput
from serve_cli.engine.output_processor import OutputProcessor
from serve_cli.engine.sampling import TokenLogprobs

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok():
    from serve_cli.default_model import build_tokenizer

    return build_tokenizer()


def _outputs(ids: list[int], last_reason: str | None = "length", per_output: int = 1):
    """The engine's outputs for ``ids``: ``per_output`` tokens each, logprobs per token."""
    chunks = [ids[i : i + per_output] for i in range(0, len(ids), per_output)]
    outs = []
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        outs.append(RequestOutput(
            "r", list(chunk), finished=last and last_reason is not None,
            finish_reason=last_reason if last else None,
            logprobs=[TokenLogprobs(t, -1.0, ()) for t in chunk],
            num_output_tokens=sum(len(c) for c in chunks[: n + 1]),
        ))  # fmt: skip
    return outs


def _run(tok, ids, stop=(), **kw):
    processor = OutputProcessor(tok)
    processor.add("r", tok("Say:")["input_ids"], stop)
    results = [processor.process(o) for o in _outputs(ids, **kw)]
    return processor, results


def test_text_deltas_add_up_to_the_full_decode(tok) -> None:
    ids = tok(" Hello world, what time is it?", add_special_tokens=False)["input_ids"]
    processor, results = _run(tok, ids)
    assert all(not stop for _, stop in results)  # the engine ended it: nothing to tell it
    assert "".join(o.new_text for o, _ in results) == tok.decode(ids, skip_special_tokens=True)
    assert results[-1][0].finish_reason == "length" and "r" not in processor


@pytest.mark.parametrize("per_output", [1, 3])
def test_a_stop_string_cuts_the_text_and_stops_the_engine(tok, per_output) -> None:
    ids = tok(" Hello world, what time is it? Fine.", add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    stop = "time"
    processor, results = _run(tok, ids, stop=("@@", stop), per_output=per_output)
    kept = [(o, s) for o, s in results if o is not None]
    assert all(o is None for o, _ in results[len(kept):])  # what the engine ran on is dropped
    *_, (last, stop_engine) = kept
    assert stop_engine and last.finished and last.finish_reason == "stop"
    assert last.stop_reason == stop
    assert "".join(o.new_text for o, _ in kept) == full[: full.index(stop)]
    got = [t for o, _ in kept for t in o.new_token_ids]
    # cut right after the token that completed the stop string
    k = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    assert got == ids[:k] and last.num_output_tokens == k
    assert sum(len(o.logprobs) for o, _ in kept) == k and "r" not in processor


def test_a_stop_token_names_itself_even_when_a_stop_string_matches(tok) -> None:
    ids = tok(" one two three", add_special_tokens=False)["input_ids"]
    outs = _outputs(ids, last_reason="stop")
    outs[-1].stop_reason = ids[-1]  # the engine ended it on a stop_token_ids token
    processor = OutputProcessor(tok)
    processor.add("r", [1], (tok.decode(ids[-1:]).strip(),))
    last, stop_engine = [processor.process(o) for o in outs][-1]
    assert (last.finish_reason, last.stop_reason, stop_engine) == ("stop", ids[-1], False)


def test_abort_and_error_outputs_pass_through(tok) -> None:
    processor = OutputProcessor(tok)
    processor.add("r", [1], ())
    out, stop = processor.process(RequestOutput("r", finished=True, finish_reason="abort"))
    assert (out.finish_reason, out.new_text, stop) == ("abort", "", False)
    assert processor.process(RequestOutput("r", [5]))[0] is None  # no longer tracked
