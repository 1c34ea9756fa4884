"""The hardware-neutral model executor."""

from xhal.executor.config import ExecutorConfig
from xhal.executor.executor import ModelExecutor
from xhal.executor.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for_budget

__all__ = [
    "ExecutorConfig",
    "ModelExecutor",
    "allocate_kv_caches",
    "bytes_per_block",
    "num_blocks_for_budget",
]
