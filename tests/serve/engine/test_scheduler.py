"""Scheduler: continuous batching, chunked prefill, prefix reuse, preemption, abort. Driven by a
fake engine that reads its 'KV' back through the block tables, so a wrong slot or a bad prefix hit
changes the output."""

from __future__ import annotations

import ast
import random

import pytest

from serve_cli.engine import BlockManager, Request, RequestStatus, ScheduledBatch, Scheduler
from tests.support.fake_model import next_token, reference_output
from tests.support.paths import REPO

ENGINE_DIR = REPO / "serve_cli" / "engine"


class FakeEngine:
    """Writes each fed token into a flat fake KV cache at its slot, reads the whole context back
    through the block table, and samples ``next_token`` of what it read."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.num_steps = 0

    def step(self, batch: ScheduledBatch) -> dict[str, int]:
        s, bm = self.sched, self.sched.block_manager
        assert batch.num_tokens <= s.max_num_batched_tokens and batch.num_seqs <= s.max_num_seqs
        assert len({r.request_id for r in batch.requests}) == batch.num_seqs
        written = [slot for r in batch.requests for slot in r.slot_mapping]
        assert len(set(written)) == len(written), "two tokens written to one slot"
        for slot in written:
            assert bm.ref_count(slot // batch.block_size) == 1, "wrote into a shared block"
        sampled = {}
        for r in batch.requests:
            req = s.get_request(r.request_id)
            assert r.end_position <= s.max_model_len
            assert r.token_ids == req.token_ids[r.start_position : r.end_position]
            for p, tok, slot in zip(r.positions, r.token_ids, r.slot_mapping):
                self.kv[slot] = (p, tok)
            bs = batch.block_size
            ctx = [self.kv[r.block_table[p // bs] * bs + p % bs] for p in range(r.end_position)]
            assert ctx == list(enumerate(req.token_ids[: r.end_position])), "KV read back is wrong"
            if r.produces_token:
                sampled[r.request_id] = next_token([t for _, t in ctx])
        self.num_steps += 1
        return sampled

    def run(self, max_steps: int = 10_000) -> list[Request]:
        done = []
        while (batch := self.sched.next_batch()) is not None:
            done += self.sched.advance(batch, self.step(batch))
            assert self.num_steps < max_steps, "scheduler does not converge"
        return done


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_tokens_per_step: int = 64,
    max_model_len: int = 256,
    **kw: bool,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_tokens_per_step, max_model_len, **kw)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [random.Random(seed * 1000 + i).randrange(1000) for i in range(n)]


def test_engine_core_imports_no_torch() -> None:
    for path in ENGINE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"


def test_single_request_runs_to_max_tokens_and_frees_everything() -> None:
    s = make()
    s.submit(Request("a", prompt_of(10), max_tokens=7))
    (done,) = FakeEngine(s).run()
    assert done.output_token_ids == reference_output(prompt_of(10), 7)
    assert done.status is RequestStatus.FINISHED_LENGTH and done.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished_requests()


def test_repeated_prompt_reuses_the_prefix_cache() -> None:
    s = make(block_size=8)
    eng = FakeEngine(s)
    prompt = prompt_of(40)
    s.submit(Request("a", prompt, max_tokens=3))
    (a,) = eng.run()
    assert s.block_manager.prefix_cache_hits == 0
    s.submit(Request("b", prompt, max_tokens=3))
    first = s.next_batch()
    assert first.requests[0].start_position == 32  # 4 full blocks cached; 8 tokens computed
    assert s.get_request("b").num_cached_tokens == 32
    s.advance(first, eng.step(first))  # the engine read a's KV through b's block table
    (b,) = eng.run()
    assert b.output_token_ids == a.output_token_ids == reference_output(prompt, 3)
    bm = s.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (80, 32)


def test_prefix_hit_reads_back_correct_kv_and_shares_blocks() -> None:
    s = make(block_size=4)
    eng = FakeEngine(s)
    shared = prompt_of(12, seed=1)
    s.submit(Request("a", shared + [1, 2], max_tokens=6))
    s.advance(b := s.next_batch(), eng.step(b))  # a's prompt computed and cached
    s.submit(Request("b", shared + [3, 4, 5], max_tokens=6))
    batch = s.next_batch()
    rb = next(r for r in batch.requests if r.request_id == "b")
    assert rb.start_position == 12
    a_blocks = s.get_request("a").block_ids[:3]
    assert rb.block_table[:3] == a_blocks
    assert all(s.block_manager.ref_count(x) == 2 for x in a_blocks)
    s.advance(batch, eng.step(batch))
    done = {r.request_id: r for r in eng.run()}
    assert done["a"].output_token_ids == reference_output(shared + [1, 2], 6)
    assert done["b"].output_token_ids == reference_output(shared + [3, 4, 5], 6)
    assert s.block_manager.num_free_blocks == 64


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make(max_tokens_per_step=16)
    eng = FakeEngine(s)
    s.submit(Request("a", prompt_of(50), max_tokens=2))
    chunks = []
    while (batch := s.next_batch()) is not None:
        (r,) = batch.requests
        chunks.append((r.start_position, r.num_tokens, r.produces_token))
        s.advance(batch, eng.step(batch))
    assert chunks == [
        (0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True)
    ]


def test_decodes_go_first_and_prefill_chunks_fill_the_rest() -> None:
    s = make(max_tokens_per_step=16)
    eng = FakeEngine(s)
    s.submit(Request("a", prompt_of(5), max_tokens=20))
    s.advance(b := s.next_batch(), eng.step(b))
    s.submit(Request("b", prompt_of(40, seed=2), max_tokens=2))
    batch = s.next_batch()
    assert [(r.request_id, r.num_tokens) for r in batch.requests] == [("a", 1), ("b", 15)]
    s.advance(batch, eng.step(batch))


def test_continuous_batching_admits_new_requests_while_others_decode() -> None:
    s = make(max_num_seqs=3)
    eng = FakeEngine(s)
    s.submit(Request("a", prompt_of(6), max_tokens=10))
    for _ in range(3):
        s.advance(b := s.next_batch(), eng.step(b))
    s.submit(Request("b", prompt_of(6, seed=3), max_tokens=10))
    s.submit(Request("c", prompt_of(6, seed=4), max_tokens=10))
    s.submit(Request("d", prompt_of(6, seed=5), max_tokens=10))
    batch = s.next_batch()
    assert [r.request_id for r in batch.requests] == ["a", "b", "c"]  # max_num_seqs caps it
    assert (batch.num_running, batch.num_waiting) == (3, 1)
    s.advance(batch, eng.step(batch))
    done = {r.request_id: r for r in eng.run()}
    assert set(done) == {"a", "b", "c", "d"}
    assert done["d"].output_token_ids == reference_output(prompt_of(6, seed=5), 10)


def test_preemption_evicts_the_most_recent_arrival_and_requeues_it_first() -> None:
    s = make(num_blocks=4, block_size=2)
    eng = FakeEngine(s)
    s.submit(Request("a", [1, 2, 3], max_tokens=4))
    s.submit(Request("b", [4, 5, 6], max_tokens=4))
    s.submit(Request("c", [7], max_tokens=1))
    for _ in range(2):  # both prefill into 2 blocks each, then decode position 3
        s.advance(b := s.next_batch(), eng.step(b))
    batch = s.next_batch()  # a needs a 3rd block for position 4: b (arrived later) is preempted
    assert batch.preempted_ids == ["b"] and [r.request_id for r in batch.requests] == ["a"]
    b = s.get_request("b")
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    s.advance(batch, eng.step(batch))
    done = {r.request_id: r for r in eng.run()}
    assert done["b"].output_token_ids == reference_output([4, 5, 6], 4)
    assert s.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("chunked", [True, False])
def test_many_requests_all_complete_under_a_tiny_block_budget(chunked: bool) -> None:
    rng = random.Random(0)
    s = make(num_blocks=6, block_size=4, max_num_seqs=6, max_tokens_per_step=32,
             max_model_len=24, enable_chunked_prefill=chunked)
    reqs = []
    for i in range(16):
        prompt = prompt_of(rng.randint(2, 12), seed=10 + i)
        reqs.append(Request(f"r{i}", prompt, max_tokens=rng.randint(1, 24 - len(prompt))))
        s.submit(reqs[-1])
    done = FakeEngine(s).run()
    assert {r.request_id for r in done} == {r.request_id for r in reqs}
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert s.block_manager.num_free_blocks == 6 and (s.num_running, s.num_waiting) == (0, 0)


def test_a_request_that_can_never_fit_is_rejected_with_a_reason() -> None:
    s = make(num_blocks=4, block_size=4)  # 16 tokens of KV in all
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        s.submit(Request("big", prompt_of(10), max_tokens=10))  # 19 tokens of KV
    s.submit(Request("ok", prompt_of(10), max_tokens=7))  # exactly 16
    (done,) = FakeEngine(s).run()
    assert done.num_output_tokens == 7


def test_max_model_len_caps_the_output() -> None:
    s = make(max_model_len=8, max_tokens_per_step=3)
    s.submit(Request("a", prompt_of(5), max_tokens=100))
    s.submit(Request("full", prompt_of(8), max_tokens=100))  # a prompt of max_model_len: one token
    done = {r.request_id: r for r in FakeEngine(s).run()}
    assert done["a"].num_tokens == 8 and done["a"].status is RequestStatus.FINISHED_LENGTH
    assert done["full"].num_output_tokens == 1 and done["full"].finish_reason == "length"


def test_abort_frees_blocks_running_waiting_and_in_flight() -> None:
    s = make(num_blocks=8, max_num_seqs=1)
    eng = FakeEngine(s)
    s.submit(Request("a", prompt_of(9), max_tokens=5))
    s.submit(Request("b", prompt_of(9, seed=1), max_tokens=5))
    s.advance(batch := s.next_batch(), eng.step(batch))
    assert s.block_manager.num_used_blocks == 3
    assert s.abort("b").status is RequestStatus.FINISHED_ABORTED  # waiting
    batch = s.next_batch()
    aborted = s.abort("a")  # while its step runs
    assert aborted.finish_reason == "abort" and aborted.block_ids == []
    assert s.advance(batch, {"a": 1}) == []  # the engine's late result for it is ignored
    assert s.abort("a") is None and s.abort("nope") is None
    assert s.block_manager.num_free_blocks == 8 and s.next_batch() is None


def test_engine_reported_finishes_and_failed_steps() -> None:
    s = make(block_size=4)
    eng = FakeEngine(s)
    s.submit(Request("a", prompt_of(9), max_tokens=50))
    batch = s.next_batch()
    (done,) = s.advance(batch, eng.step(batch), {"a": RequestStatus.FINISHED_STOPPED})
    assert done.finish_reason == "stop" and done.num_output_tokens == 1
    s.submit(Request("b", prompt_of(9, seed=1), max_tokens=5))
    batch = s.next_batch()
    (failed,) = s.advance(batch, {}, {"b": RequestStatus.FINISHED_ERROR})
    assert failed.finish_reason == "error"
    assert s.block_manager.match_prefix(prompt_of(9, seed=1)) == ([], 0)  # failed KV never cached
    assert s.block_manager.match_prefix(prompt_of(9))[1] == 8
    assert s.block_manager.num_free_blocks == 64


def test_protocol_and_input_errors_are_clear() -> None:
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.submit(Request("long", prompt_of(17), max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        s.submit(Request("zero", prompt_of(3), max_tokens=0))
    s.submit(Request("a", prompt_of(3), max_tokens=2))
    with pytest.raises(ValueError, match="already used"):
        s.submit(Request("a", prompt_of(3), max_tokens=2))
    batch = s.next_batch()
    with pytest.raises(RuntimeError, match="advance"):
        s.next_batch()
    with pytest.raises(ValueError, match="expected a sampled token"):
        s.advance(batch, {})
    with pytest.raises(ValueError, match="chunked prefill"):
        make(max_tokens_per_step=8, max_model_len=16, enable_chunked_prefill=False)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_complete_correctly_without_leaks(seed: int) -> None:
    """Arrivals over time, shared prefixes, aborts and engine stops on random small setups."""
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    num_blocks, max_model_len = rng.randint(3, 20), rng.randint(4, 64)
    s = make(num_blocks=num_blocks, block_size=rng.choice([1, 2, 4, 8]),
             max_num_seqs=rng.randint(1, 8), max_model_len=max_model_len,
             max_tokens_per_step=rng.randint(1 if chunked else max_model_len, 80),
             enable_chunked_prefill=chunked)
    eng = FakeEngine(s)
    bases = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]
    accepted, cut_short = [], set()
    for step in range(3000):
        if step < 60 and rng.random() < 0.5:
            prefix = rng.choice(bases)[: rng.randint(1, 40)]
            prompt = prefix + [rng.randrange(5)] * rng.randint(0, 2)
            req = Request(f"r{step}", prompt, max_tokens=rng.randint(1, 30))
            try:
                s.submit(req)
                accepted.append(req)
            except ValueError as e:
                assert "can never fit" in str(e) or "max_model_len" in str(e)
        if accepted and rng.random() < 0.03 and (gone := s.abort(rng.choice(accepted).request_id)):
            cut_short.add(gone.request_id)
        if (batch := s.next_batch()) is None:
            if step >= 60:
                break
            continue
        sampled = eng.step(batch)
        stops = {rid: RequestStatus.FINISHED_STOPPED for rid in sampled if rng.random() < 0.02}
        cut_short |= set(stops)
        s.advance(batch, sampled, stops)
    assert not s.has_unfinished_requests() and s.block_manager.num_free_blocks == num_blocks
    for r in accepted:
        expected = min(r.max_tokens, max(max_model_len - r.num_prompt_tokens, 1))
        n = r.num_output_tokens if r.request_id in cut_short else expected
        assert r.output_token_ids == reference_output(r.prompt_token_ids, n)
