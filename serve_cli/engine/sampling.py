"""Per-request sampling parameters, and the logprobs reported per generated token (the sampler that
uses them is ``serve_cli.engine.runner.sampler``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from serve_cli.engine.errors import ParamError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 is greedy. ``top_k`` 0 or -1 and ``top_p`` 1 are off. ``seed`` makes the
    request's tokens reproducible whatever it is batched with. ``stop`` strings end the output
    before them (finish reason "stop"); a token of ``stop_token_ids`` ends it after itself
    (finish reason "stop", even with ``ignore_eos``, as vLLM does). ``logprobs`` N returns, per
    generated token, its logprob and the N most likely tokens' (from the raw logits, before
    biases, penalties and temperature). ``presence_penalty``, ``frequency_penalty`` (0: off, in
    [-2, 2]) and ``repetition_penalty`` (1: off, > 0) push the logits away from tokens already
    seen, by vLLM's rules (``runner/seen_tokens.py``); ``logit_bias`` (token id, bias in
    [-100, 100]) pairs are added to the logits before them, and ``min_p`` (0: off) drops the
    tokens less likely than ``min_p`` times the likeliest after temperature
    (``runner/logit_filters.py``). Until the output holds ``min_tokens`` tokens, EOS (unless
    ``ignore_eos``), ``stop_token_ids`` and ``stop`` strings do not end it (as in vLLM).
    ``prompt_logprobs`` N: each prompt token after the first gets its logprob and the N most
    likely tokens' at its position, with the request's first output (its whole prompt is
    computed for it: no prefix-cache hit).
    Construction validates, so a ``SamplingParams`` that exists is a valid one: this is the one
    place its rules live (the API and the engine both rely on it). ``stop`` is a tuple of strings
    and ``stop_token_ids`` a tuple or frozenset of ids, as given: nothing is converted after
    construction.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | frozenset[int] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (``runner/seen_tokens.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling depends on the tokens seen so far (``runner/seen_tokens.py``)."""
        return self.penalized or self.min_tokens > 0

    def _validate(self) -> None:
        """Raise ``ParamError`` (a ``ValueError``) naming the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ParamError("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ParamError("top_k", f"must be an integer >= 0 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ParamError("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ParamError("stop", f"must be a tuple of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ParamError("stop", "stop strings must not be empty")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ParamError(
                "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ParamError(
                "prompt_logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ParamError(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ParamError(
                "repetition_penalty", f"must be a number > 0, got {self.repetition_penalty!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"must be an integer in [0, max_tokens] (max_tokens is {self.max_tokens}), got "
                f"{self.min_tokens!r}",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
            and _is_number(pair[1]) and -100 <= pair[1] <= 100
            for pair in bias
        ):  # fmt: skip
            raise ParamError(
                "logit_bias",
                f"must be (token id >= 0, bias in [-100, 100]) pairs, got {bias!r}",
            )
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, frozenset)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ParamError(
                "stop_token_ids", f"must be a tuple of integer token ids >= 0, got {ids!r}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class TokenLogprobs(NamedTuple):
    """One generated token's logprob and the ``top`` most likely ``(token_id, logprob)`` pairs,
    most likely first (log-softmax of the raw logits). A named tuple: plain data, so it crosses to
    the API process as it is and reads there as ``(token_id, logprob, top)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PromptLogprob(NamedTuple):
    """One prompt token's score (``prompt_logprobs``): as ``TokenLogprobs``, and its ``rank`` in
    the vocabulary at its position (1: the likeliest)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int
