"""Incremental detokenization against a full decode, and stop strings (tokenizers trained here)."""

from __future__ import annotations

import pytest

from serve_cli.engine.detokenizer import IncrementalDetokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe():
    """The default model's byte-level BPE (trained on English: non-ASCII text splits into bytes)."""
    from serve_cli.default_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.support.checkpoints import build_tokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("wordlevel"), 256)
    return AutoTokenizer.from_pretrained(str(path))


def _stream(tok, prompt: str, output: str, stop: tuple[str, ...] = (), flush: bool = True):
    """Feed ``output``'s tokens one by one; return (deltas, detokenizer, output ids)."""
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out_ids = tok(output, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt_ids, stop)
    deltas = []
    for t in out_ids:
        if detok.stopped:
            break
        deltas.append(detok.add_token(t))
    if flush:
        deltas.append(detok.flush())
    return deltas, detok, out_ids


def test_multibyte_characters_split_across_tokens(bpe) -> None:
    text = " héllo wörld ✓ 日本語 🙂 done"
    deltas, detok, ids = _stream(bpe, "Say:", text, flush=False)
    assert len(ids) > len(text.split()) + 10, "non-ASCII characters should span several byte tokens"
    assert "".join(deltas) == text == bpe.decode(ids)
    assert not any("\ufffd" in d for d in deltas), "a partial character was released"
    assert detok.flush() == "" and detok.output_text == text


def test_incomplete_character_is_flushed_at_the_end(bpe) -> None:
    ids = bpe(" 🙂", add_special_tokens=False)["input_ids"][:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(bpe, [1], ())
    assert "".join(detok.add_token(t) for t in ids) == " "
    assert detok.flush() == bpe.decode(ids)[1:]


def test_space_joined_tokenizer_continues_the_prompt(word_level) -> None:
    prompt, output = "the quick brown", "fox jumps over the lazy dog"
    deltas, _, ids = _stream(word_level, prompt, output)
    p = word_level(prompt, add_special_tokens=False)["input_ids"]
    assert "".join(deltas) == word_level.decode(p + ids)[len(word_level.decode(p)) :]
    assert "".join(deltas) == " fox jumps over the lazy dog"


@pytest.mark.parametrize(
    "stop, expected",
    [
        (("time",), " Hello world, what "),
        (("orld, wh",), " Hello w"),  # starts inside a token
        (("zzz", "is it", "world"), " Hello "),  # the earliest match wins
        (("Hello",), " "),
    ],
)
def test_stop_string_cuts_the_text(bpe, stop, expected) -> None:
    deltas, detok, _ = _stream(bpe, "Q:", " Hello world, what time is it? Fine.", stop)
    assert detok.stopped
    assert "".join(deltas) == expected == detok.output_text


def test_possible_stop_prefix_is_held_back_until_resolved(bpe) -> None:
    stop, text = "what is", " what time is it"
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(bpe, [1], (stop,))
    released = ""
    for i, t in enumerate(ids):
        released += detok.add_token(t)
        decoded = bpe.decode(ids[: i + 1])
        # everything is released except the longest tail that could still grow into the stop
        held = max((n for n in range(len(stop)) if n and stop.startswith(decoded[-n:])), default=0)
        assert released == decoded[: len(decoded) - held]
        if decoded.endswith("what"):
            assert released == " "
    assert not detok.stopped
    assert released + detok.flush() == text


def test_held_back_text_is_released_by_flush(bpe) -> None:
    deltas, detok, _ = _stream(bpe, "Q:", " see you tomorrow", ("tomorrow!",), flush=False)
    assert "".join(deltas) == " see you "  # "tomorrow" might still become "tomorrow!"
    assert detok.flush() == "tomorrow" and not detok.stopped


def test_add_after_stop_is_an_error(bpe) -> None:
    _, detok, ids = _stream(bpe, "Q:", " one two three", ("two",), flush=False)
    assert detok.stopped
    with pytest.raises(RuntimeError, match="stop string"):
        detok.add_token(ids[-1])


def test_no_stop_string_ends_the_output_within_min_tokens(bpe) -> None:
    """vLLM's rule: stop strings are looked for once the output holds more than min_tokens
    tokens; a match wholly inside the first min_tokens tokens' text is not one."""
    text = " one two one two three"
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    first_two = len(bpe(" one two", add_special_tokens=False)["input_ids"])
    detok = IncrementalDetokenizer(bpe, [1], ("two",), min_tokens=first_two)
    released = ""
    for t in ids:
        released += detok.add_token(t)
        if detok.stopped:
            break
    assert detok.stopped and detok.output_text == released == " one two one "
