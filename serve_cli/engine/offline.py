"""The engine in process with its text made as the API process makes it: for tests and scripts.

The engine streams token ids; ``TextSession`` puts an ``OutputProcessor`` in front of it, as the
API process's engine client does for served requests (text deltas, stop strings, aborting in the
engine a request a stop string ended), so offline and served outputs are the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from serve_cli.engine.output import RequestOutput
from serve_cli.engine.output_processor import OutputProcessor
from serve_cli.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from serve_cli.engine.core import EngineCore


class TextSession:
    """``add_request`` / ``abort`` / ``step`` / ``has_unfinished`` as on ``EngineCore``, with
    every output's ``new_text`` filled in and stop strings applied."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.processor = OutputProcessor(engine.tokenizer)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)
        self.processor.add(request_id, prompt_token_ids, params.stop, params.min_tokens)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = [], []
        for raw in self.engine.step():
            out, stop_engine = self.processor.process(raw)
            if out is None:  # a step the engine ran before it heard of the stop
                continue
            if stop_engine:
                stopped.append(out.request_id)
            outputs.append(out)
        for rid in stopped:
            self.engine.abort(rid)
        return outputs


def generate(
    engine: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[list[int]]:
    """Run ``prompts`` concurrently to completion and return their output token ids, in order.
    Raises ``RuntimeError`` if any request fails (the others are aborted)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
    session = TextSession(engine)
    tag = uuid.uuid4().hex[:8]
    ids = [f"generate-{tag}-{i}" for i in range(len(prompts))]
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt, p in zip(ids, prompts, per_prompt):
        session.add_request(rid, prompt, p)
    remaining = set(ids)
    while remaining:
        for out in session.step():
            if out.request_id not in remaining:
                continue
            results[out.request_id] += out.new_token_ids
            if out.finished:
                remaining.discard(out.request_id)
                if out.finish_reason == "error":
                    for rid in remaining:
                        engine.abort(rid)
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return [results[rid] for rid in ids]
