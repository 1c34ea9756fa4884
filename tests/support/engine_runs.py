"""Running ``EngineCore`` in tests: a small engine over a checkpoint, seeded random prompts, and
stepping until idle."""

from __future__ import annotations

from pathlib import Path

import torch

from serve_cli.engine.config import EngineConfig
from serve_cli.engine.core import EngineCore
from serve_cli.engine.offline import TextSession
from serve_cli.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=48)


def small_engine(model_dir: Path, **overrides) -> EngineCore:
    """An engine with ``SMALL``'s limits (a 64-token step budget, 48 KV blocks), ``overrides``
    on top."""
    return EngineCore(EngineConfig(model_dir=model_dir, **{**SMALL, **overrides}))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def drain(engine: EngineCore | TextSession) -> dict[str, list]:
    """Step until idle; every output, by request id (text and stop strings too through a
    ``TextSession``, as a served request gets them)."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs
