"""The engine's CPU defaults: eager steps and a KV budget that does not depend on what else the
machine runs (the peak-memory figures are benchmarks/bench_cpu_memory.py's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve_cli.engine import kv_budget
from serve_cli.engine.config import EngineConfig


def test_cpu_runs_eagerly_unless_told_otherwise() -> None:
    assert EngineConfig().runs_eager is True
    assert EngineConfig().enforce_eager is None  # the field keeps what was asked for
    assert EngineConfig(enforce_eager=False).runs_eager is False
    assert EngineConfig(device="cuda").runs_eager is False
    assert EngineConfig(device="cuda", enforce_eager=True).runs_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def fake_platform(device_type: str, free: int) -> SimpleNamespace:
    return SimpleNamespace(device_type=device_type, mem_get_info=lambda: (free, 2 * free))


def test_cpu_kv_budget_is_fixed_whatever_memory_is_free() -> None:
    per_block = 16 * 46080  # SmolLM2-135M in float32: 30 layers x K and V x 3 heads x 64 x 4 B
    many = (64, 512)  # 64 sequences of 8K tokens want far more than the budget
    counts = {
        kv_budget.default_num_blocks(fake_platform("cpu", free), per_block, *many)
        for free in (2 << 30, 9 << 30, 100 << 30)
    }
    assert counts == {(1 << 30) // per_block}
    # never more than every sequence at full length needs
    assert kv_budget.default_num_blocks(fake_platform("cpu", 9 << 30), per_block, 2, 10) == 20
    # an accelerator takes a share of its free memory
    cuda = kv_budget.default_num_blocks(fake_platform("cuda", 10 << 30), per_block, *many)
    assert cuda == int((10 << 30) * kv_budget.DEVICE_FRACTION) // per_block


def test_the_budget_is_reported_in_gib() -> None:
    assert kv_budget.describe(1456, 16 * 46080, 16) == (
        "1456 blocks of 16 tokens (23296 tokens, 1.00 GiB)"
    )
