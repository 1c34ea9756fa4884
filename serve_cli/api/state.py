"""What every route needs: the engine client, the tokenizer, the served name, limits, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_cli.api.defaults import RequestDefaults
from serve_cli.api.metrics import ServerMetrics


@dataclass
class ServerState:
    """Shared by all routes of one server. ``client`` is an ``EngineClient`` (or a test double
    with ``add_request``, ``abort``, ``stats``, ``is_dead`` and ``dead_reason``)."""

    client: Any
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    api_key: str | None = None
    created: int = 0  # unix time the server started, for /v1/models
    model_root: str | None = None  # the checkpoint directory, for /v1/models
    log_prompts: bool = False  # the request log line also shows the prompt text
    tool_call_parser: str | None = None  # how chat replies' tool calls are read (tool_calls.py)
    draining: bool = False  # shutting down: new requests get a 503
    # generation_config.json's sampling defaults and the chat output limit
    defaults: RequestDefaults = field(default_factory=lambda: RequestDefaults({}))
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.max_model_len)
