"""What a request gets for the fields it leaves unset: the model's ``generation_config.json``
sampling defaults (vLLM applies them, so outputs match a vLLM server's) and a chat output limit."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from serve_cli.api.protocol import SamplingFields

logger = logging.getLogger("xhal.serve")
RequestT = TypeVar("RequestT", bound=SamplingFields)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")  # vLLM's


@dataclass(frozen=True)
class RequestDefaults:
    """``sampling``: field -> value for requests that leave the field unset (None).
    ``chat_max_tokens``: the output limit of a chat request that sets none (None: up to the
    model's length)."""

    sampling: dict[str, float | int]
    chat_max_tokens: int | None = None


def load_request_defaults(
    model_dir: Path, max_tokens: int | None = None, fallback_max_tokens: int | None = None
) -> RequestDefaults:
    """Defaults from ``model_dir/generation_config.json`` (the keys its author set). The chat
    limit is ``max_tokens`` (the command line's), else the file's ``max_new_tokens``, else
    ``fallback_max_tokens``."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    sampling = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if sampling:
        logger.info("sampling defaults from %s: %s", path.name, sampling)
    limit = max_tokens or config.get("max_new_tokens") or fallback_max_tokens
    return RequestDefaults(sampling, int(limit) if limit else None)


def with_defaults(request: RequestT, defaults: RequestDefaults) -> RequestT:
    """``request`` with each unset sampling field taken from ``defaults`` (a field the request
    sets, even to the neutral value, wins)."""
    unset = {k: v for k, v in defaults.sampling.items() if getattr(request, k) is None}
    return request.model_copy(update=unset) if unset else request
