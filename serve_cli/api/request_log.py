"""One info line per HTTP request when it ends, like vLLM's request logging: id, token counts,
finish reasons and latencies; the prompt text only when the server was started with
``--log-prompts`` (prompts may hold what should not reach a log)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from serve_cli.api.choice import Choice


class Finished(Protocol):
    """What the line reads of a finished HTTP request (``generation.Generation`` is one)."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    n: int
    choices: Sequence[Choice]
    state: Any  # the ServerState: its log_prompts flag and tokenizer

logger = logging.getLogger("xhal.serve.requests")
MAX_LOGGED_PROMPT_CHARS = 2000


def log_request(gen: Finished) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    now = time.monotonic()
    choices = gen.choices
    reasons = ",".join(c.finish_reason or "abort" for c in choices)
    firsts = [c.first_token for c in choices if c.first_token is not None]
    ttft = f"{min(firsts) - gen.arrival:.3f}s" if firsts else "-"
    line = (
        f"request {gen.request_id}: prompt_tokens={gen.num_prompt_tokens} "
        f"output_tokens={sum(len(c.token_ids) for c in choices)} finish_reason={reasons} "
        f"latency={now - gen.arrival:.3f}s ttft={ttft} n={len(choices)}"
    )
    if gen.state.log_prompts:
        prompts = [gen.state.tokenizer.decode(c.prompt_token_ids) for c in choices[:: gen.n]]
        line += f" prompt={_clip(' | '.join(prompts))!r}"
    logger.info(line)


def _clip(text: str) -> str:
    if len(text) <= MAX_LOGGED_PROMPT_CHARS:
        return text
    return text[:MAX_LOGGED_PROMPT_CHARS] + f"... ({len(text)} characters)"
