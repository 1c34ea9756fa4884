"""How many KV blocks to allocate when the user gave neither a block count nor a byte budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xhal.interfaces.platform import Platform

GIB = 1 << 30
# On the CPU the cache shares RAM with everything else on the machine, and a share of what
# happens to be free made the cache (and the server's memory) differ from one start to the next:
# a fixed budget instead. 1 GiB holds 23K tokens of SmolLM2-135M in float32, nearly three
# sequences of its full 8K context.
CPU_BYTES = GIB
# On an accelerator the cache is most of what the device holds: a share of its free memory,
# measured after the weights are loaded.
DEVICE_FRACTION = 0.8
FALLBACK_BYTES = GIB  # a platform that does not report memory


def default_num_blocks(
    platform: Platform, bytes_per_block: int, max_num_seqs: int, max_blocks_per_seq: int
) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens, or fewer when that does
    not fit the default budget (requests then wait or are preempted; none fails)."""
    if platform.device_type == "cpu":
        budget = CPU_BYTES
    else:
        try:
            free, _ = platform.mem_get_info()
            budget = int(free * DEVICE_FRACTION)
        except NotImplementedError:
            budget = FALLBACK_BYTES
    return max(1, min(max_num_seqs * max_blocks_per_seq, budget // bytes_per_block))


def describe(num_blocks: int, bytes_per_block: int, block_size: int) -> str:
    """``"2048 blocks of 16 tokens (32768 tokens, 1.00 GiB)"``: the cache as the start-up log
    reports it."""
    return (
        f"{num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens, "
        f"{num_blocks * bytes_per_block / GIB:.2f} GiB)"
    )
