"""The engine and the offline reference the engine tests of this folder share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve_cli.engine.core import EngineCore
from tests.support.engine_runs import GREEDY, small_engine


@pytest.fixture(scope="module")
def engine(llama_gqa_dir: Path) -> EngineCore:
    return small_engine(llama_gqa_dir)


@pytest.fixture(scope="module")
def reference(llama_gqa_dir: Path):
    """``reference(prompt, n)``: greedy tokens of a plain offline loop over the executor, one
    sequence at a time (prefill, then decodes picking the argmax), eager, own KV cache.
    ``pick(logits [V], prompt, out)`` replaces the argmax (not cached)."""
    from models import load_model
    from tests.support.paged_host import PagedHost
    from xhal import platforms
    from xhal.executor import ExecutorConfig, ModelExecutor

    model = load_model(llama_gqa_dir, dtype=torch.float32, progress=False)
    executor = ModelExecutor(
        model, platforms.get("cpu"), ExecutorConfig(max_model_len=128, enforce_eager=True)
    )
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=64))
    state = {"next_id": 0}
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], max_tokens: int = GREEDY.max_tokens, pick=None) -> list[int]:
        key = tuple(prompt)
        if pick is None and key in cache and len(cache[key]) >= max_tokens:
            return cache[key][:max_tokens]
        host = PagedHost(num_blocks=64, block_size=16, seed=state["next_id"])
        state["next_id"] += 1
        out: list[int] = []
        feed = list(prompt)
        while len(out) < max_tokens:
            ids, pos, md = host.step([(0, feed)])
            hidden = executor.execute(ids, pos, md)
            logits = executor.compute_logits(hidden, torch.tensor([len(feed) - 1]))
            out.append(int(logits.argmax(-1)) if pick is None else pick(logits[0], prompt, out))
            feed = out[-1:]
        if pick is None:
            cache[key] = out
        return out

    return run

