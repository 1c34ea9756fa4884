"""Paged KV-block allocation with prefix caching: hash chains over full blocks, reference counts and
an LRU of free blocks that stay matchable until they are reused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_cli.engine.request import Request

_ROOT_HASH = -1  # parent of a sequence's first block (a constant, unlike hash(None) before 3.12)


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # compared on a match, so a hash collision cannot hit


class BlockManager:
    """Hands out KV blocks to requests and shares full blocks between requests with one prefix.

    A full block's hash is ``hash((parent_hash, tuple(its token ids)))``, so equal hashes along a
    chain mean equal prefixes (a match also compares the block's tokens).

    Invariants:
    - Every block is either held (``ref_count > 0``, by that many requests) or in the free LRU
      (``ref_count == 0``), never both; ``num_free_blocks + num_used_blocks == num_blocks``.
    - A block with ``ref_count > 0`` is never evicted or reused for other tokens.
    - Only full blocks whose KV has been computed (``cache_full_blocks``) carry a hash.
    - A freed block keeps its hash and can be matched until it is taken for new tokens. Free blocks
      are taken least recently freed first, blocks with no cached content before any cached one.
    - Block 0 is an ordinary block.
    - ``match_prefix`` never covers the last token: at least one token is always computed, so the
      step has logits to sample from.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must both be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head: LRU
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_hashed: dict[str, int] = {}  # request id -> how many of its blocks are hashed
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): all of them can be taken."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content can be matched (held or free)."""
        return len(self._cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The cached blocks holding the longest cached prefix of ``token_ids``, and its length in
        tokens. A pure lookup (no reference taken); only full blocks before the last token count.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        block_ids: list[int] = []
        parent = _ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash((parent, tokens))
            block_id = self._cached.get(h)
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
            parent = h
        return block_ids, len(block_ids) * bs

    def allocate(
        self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> bool:
        """Admit ``request`` (holding no blocks): share ``cached_block_ids`` (from
        ``match_prefix``) and take new blocks so that its first ``num_tokens`` tokens have slots.

        Returns False, changing nothing, when too few blocks are free. With prefix caching on,
        counts a query of ``request.num_tokens`` tokens and a hit of the cached ones.
        """
        assert not request.block_ids, "allocate() admits a request; append_slots() grows one"
        cached = list(cached_block_ids)
        assert len(cached) * self.block_size < num_tokens, "the prefix must leave tokens to compute"
        num_new = self.num_blocks_for(num_tokens) - len(cached)
        num_revived = sum(1 for b in cached if self._blocks[b].ref_count == 0)  # leave the LRU
        if num_new > len(self._free) - num_revived:
            return False
        for b in cached:
            self._acquire(b)
        request.block_ids = cached + [self._take_free_block() for _ in range(num_new)]
        self._num_hashed[request.request_id] = len(cached)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached) * self.block_size
        return True

    def append_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow ``request``'s blocks so that its first ``num_tokens`` tokens have slots.

        Returns False, changing nothing, when too few blocks are free.
        """
        num_new = self.num_blocks_for(num_tokens) - len(request.block_ids)
        if num_new > len(self._free):
            return False
        request.block_ids.extend(self._take_free_block() for _ in range(num_new))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the full blocks among ``request``'s first ``num_computed_tokens`` tokens matchable.

        Call only once their KV is written. A block whose content is already cached in another
        block gets its hash (for the chain), but the other block stays the one that matches.
        """
        if not self.enable_prefix_caching:
            return
        bs, rid = self.block_size, request.request_id
        start, stop = self._num_hashed.get(rid, 0), num_computed_tokens // bs
        if stop <= start:
            return
        parent = self._blocks[request.block_ids[start - 1]].hash if start else _ROOT_HASH
        for i in range(start, stop):
            block = self._blocks[request.block_ids[i]]
            block.token_ids = tuple(request.token_ids[i * bs : (i + 1) * bs])
            block.hash = hash((parent, block.token_ids))
            self._cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        self._num_hashed[rid] = stop

    def free(self, request: Request) -> None:
        """Drop ``request``'s references. Blocks reaching ``ref_count == 0`` join the free LRU, last
        block first so that a sequence's prefix outlives its tail; blocks with no cached content go
        to the head (reused first)."""
        self.free_blocks(self.release(request))

    def release(self, request: Request) -> list[int]:
        """Take ``request``'s blocks from it, references and all: the caller holds them until it
        hands them to ``free_blocks`` (a step still in flight may be writing into them)."""
        block_ids, request.block_ids = request.block_ids, []
        self._num_hashed.pop(request.request_id, None)
        return block_ids

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each of ``block_ids`` (a sequence's table, as ``free`` does)."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None or self._cached.get(block.hash) != block_id:
                    self._free.move_to_end(block_id, last=False)

    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]  # evicted: its content can no longer be matched
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id
