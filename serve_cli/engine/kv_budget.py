"""How many KV blocks to allocate when the user gave neither a block count nor a byte budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xhal.interfaces.platform import Platform

# Share of free memory the KV cache may take by default, measured after the weights are loaded.
# On the CPU the cache shares RAM with everything else, so it stays modest.
CPU_FRACTION = 0.1
DEVICE_FRACTION = 0.8
FALLBACK_BYTES = 1 << 30  # a platform that does not report memory


def default_num_blocks(
    platform: Platform, bytes_per_block: int, max_num_seqs: int, max_blocks_per_seq: int
) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens, or fewer when that does
    not fit the default share of free memory (requests then wait or are preempted; none fails)."""
    try:
        free, _ = platform.mem_get_info()
        budget = int(free * (CPU_FRACTION if platform.device_type == "cpu" else DEVICE_FRACTION))
    except NotImplementedError:
        budget = FALLBACK_BYTES
    return max(1, min(max_num_seqs * max_blocks_per_seq, budget // bytes_per_block))
