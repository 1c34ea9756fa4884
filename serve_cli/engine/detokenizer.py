"""Incremental detokenization with stop strings: each new token yields only the text it adds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens of the prompt decoded along with the first outputs, so tokenizers whose text depends on
# the previous token (SentencePiece's leading space) start the output text right.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Decoding only ``ids[prefix_offset:]`` and subtracting the text of ``ids[prefix_offset:
    read_offset]`` gives the new text without re-decoding the whole output; a decode ending in
    U+FFFD (a multi-byte character split across tokens) is not consumed until the next token
    completes it.

    Stop strings: the output is cut before the first stop string (``stopped`` turns true), and a
    tail that could be the start of a stop string is held back until the next tokens resolve it.
    ``flush()`` releases what is held once the request ends for another reason. While the output
    holds no more than ``min_tokens`` tokens, no stop string is looked for (vLLM's rule). Invariant:
    the
    concatenated deltas are a prefix of the full decode of the outputs (equal to it, after
    ``flush``, when no stop string matched).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens, self._num_outputs = min_tokens, 0
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self._ids)
        self._text = ""  # decoded output text so far (cut at a stop string)
        self._released = 0  # how much of _text has been handed out
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the output

    @property
    def output_text(self) -> str:
        """Every character handed out so far."""
        return self._text[: self._released]

    def add_token(self, token_id: int) -> str:
        """Consume one output token; return the text it releases (may be empty)."""
        if self.stopped:
            raise RuntimeError("a stop string already ended this request's output")
        self._ids.append(token_id)
        self._num_outputs += 1
        prefix = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full = self._decode(self._ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The output ended: decode what is pending (even an incomplete character) and release
        everything held back for stop strings."""
        if not self.stopped and self.read_offset < len(self._ids):
            prefix = self._decode(self._ids[self.prefix_offset : self.read_offset])
            full = self._decode(self._ids[self.prefix_offset :])
            self._append(full[len(prefix) :])
            self.prefix_offset = self.read_offset = len(self._ids)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        start = max(0, len(self._text) - self._max_stop + 1)  # a new match ends in the delta
        self._text += delta
        if self._num_outputs <= self.min_tokens:
            return
        found = min(
            ((i, s) for s in self.stop if (i := self._text.find(s, start)) >= 0), default=None
        )
        if found is not None:
            cut, self.matched_stop = found
            self._text = self._text[: max(cut, self._released)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not (final or self.stopped):
            end -= self._held_back()
        delta, self._released = self._text[self._released : end], max(end, self._released)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text) - self._released), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
