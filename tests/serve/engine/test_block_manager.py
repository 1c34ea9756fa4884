"""BlockManager: paged allocation, prefix-cache hash chains, reference counts and LRU eviction."""

from __future__ import annotations

from serve_cli.engine import BlockManager, Request


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, max_tokens=4)


def _admit(bm: BlockManager, req: Request) -> list[int]:
    """Admit ``req`` with whatever prefix is cached, compute all of it, and return its blocks."""
    cached, num_cached = bm.match_prefix(req.token_ids)
    assert bm.allocate(req, req.num_tokens, cached)
    bm.cache_full_blocks(req, req.num_tokens)
    return list(req.block_ids)


def test_every_block_including_zero_is_usable_and_exhaustion_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _req("a", list(range(16)))
    assert bm.allocate(a, 16)
    assert sorted(a.block_ids) == [0, 1, 2, 3]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (0, 4)
    b = _req("b", [1])
    assert not bm.allocate(b, 1) and b.block_ids == []
    assert not bm.append_slots(a, 17) and len(a.block_ids) == 4
    bm.free(a)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 0)


def test_append_slots_grows_one_block_per_block_size_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req("a", [1, 2, 3])
    assert bm.allocate(a, 3) and len(a.block_ids) == 1
    assert bm.append_slots(a, 4) and len(a.block_ids) == 1
    assert bm.append_slots(a, 5) and len(a.block_ids) == 2
    assert bm.append_slots(a, 13) and len(a.block_ids) == 4
    bm.free(a)
    assert bm.num_free_blocks == 8


def test_repeated_prompt_hits_full_blocks_but_never_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a = _req("a", prompt)
    blocks_a = _admit(bm, a)
    bm.free(a)
    assert bm.match_prefix(prompt) == (blocks_a[:2], 8)
    assert bm.match_prefix(prompt[:8]) == (blocks_a[:1], 4)  # the 8th token must be computed
    assert bm.match_prefix(prompt[:4]) == ([], 0)
    assert bm.match_prefix([7] + prompt[1:]) == ([], 0)  # a different first block breaks the chain
    assert bm.match_prefix(prompt[:4] + [0, 0, 0, 0, 0]) == (blocks_a[:1], 4)

    b = _req("b", prompt)
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    assert _admit(bm, b)[:2] == blocks_a[:2]
    assert (bm.prefix_cache_queries - queries, bm.prefix_cache_hits - hits) == (10, 8)
    assert 0.0 < bm.prefix_cache_hit_rate < 1.0


def test_shared_prefix_is_reference_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    shared = _admit(bm, a)[:2]
    b = _req("b", list(range(8)) + [50, 51, 52])
    assert _admit(bm, b)[:2] == shared
    assert [bm.ref_count(x) for x in shared] == [2, 2]
    assert bm.num_used_blocks == 3 + 1  # a: 3 blocks, b: the 2 shared + 1 of its own
    bm.free(a)
    assert [bm.ref_count(x) for x in shared] == [1, 1]
    assert bm.num_used_blocks == 3  # shared blocks stay held by b, never evicted
    filler = _req("f", list(range(200, 220)))
    assert bm.allocate(filler, 20)  # takes all 5 free blocks ...
    assert not set(filler.block_ids) & set(b.block_ids)  # ... none of them b's
    bm.free(filler)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.match_prefix(list(range(9)))[1] == 8  # a's chain outlived the reuse (it was held)


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    prompts = {name: [base, base + 1, base + 2] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    reqs = {name: _req(name, p) for name, p in prompts.items()}
    for r in reqs.values():
        _admit(bm, r)  # each: one full cached block + one partial block
    for name in "abc":
        bm.free(reqs[name])

    def cached() -> str:
        return "".join(n for n, p in prompts.items() if bm.match_prefix(p)[1] == 2)

    # Uncached partial blocks are reused before any cached block.
    filler = _req("f", [0, 0, 0])
    assert bm.allocate(filler, 3) and cached() == "abc"
    # Touching a's block makes it the most recently used: eviction order becomes b, c, a.
    a2 = _req("a2", prompts["a"])
    _admit(bm, a2)
    bm.free(a2)
    bm.free(filler)  # filler's blocks are uncached: reused first again
    order = []
    for i in range(6):
        g = _req(f"g{i}", [1000 + i])
        assert bm.allocate(g, 1)
        order.append(cached())
    assert order == ["abc", "abc", "abc", "ac", "a", ""]  # 3 uncached first, then LRU: b, c, a
    assert bm.num_free_blocks == 0


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(bm, a)
    bm.free(a)
    assert bm.match_prefix([1, 2, 3, 4, 5]) == ([], 0)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
