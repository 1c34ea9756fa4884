"""Async scheduling in the scheduler, torch-free: under a fake two-deep pipeline, step N+1 is
scheduled before step N is advanced, its placeholder rows fed from step N's sampled tokens. The KV
read back must be each request's true context, length limits are never overrun, a request finished
in flight keeps its blocks until its last batch is advanced, and random workloads with stops,
aborts and preemption finish with the reference tokens and no leaked block."""

from __future__ import annotations

import random

import pytest

from serve_cli.engine import BlockManager, Request, RequestStatus, ScheduledBatch, Scheduler
from serve_cli.engine.batch import PLACEHOLDER_TOKEN_ID
from tests.support.fake_model import next_token, reference


class PipelinedFakeEngine:
    """Runs each batch when it is launched, as a device would in order: placeholders take the
    tokens the previous launched batch sampled; the KV written at each slot is read back through
    the block tables and must be the request's true context."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, int]] = {}
        self.previous: dict[str, int] = {}
        self.num_placeholders = 0

    def launch(self, batch: ScheduledBatch) -> dict[str, int]:
        s, bs = self.sched, batch.block_size
        assert batch.num_tokens <= s.max_num_batched_tokens and batch.num_seqs <= s.max_num_seqs
        written = [slot for r in batch.requests for slot in r.slot_mapping]
        assert len(set(written)) == len(written)
        for slot in written:
            assert s.block_manager.ref_count(slot // bs) == 1, "wrote into a shared or free block"
        sampled = {}
        for r in batch.requests:
            req = s.get_request(r.request_id)
            assert r.end_position <= s.max_model_len
            if r.num_placeholders:
                assert r.num_placeholders == r.num_tokens == 1 and r.produces_token
                self.num_placeholders += 1
            tokens = [self.previous[r.request_id] if t == PLACEHOLDER_TOKEN_ID else t
                      for t in r.token_ids]  # fmt: skip
            for p, tok, slot in zip(r.positions, tokens, r.slot_mapping):
                self.kv[slot] = (p, tok)
            ctx = [self.kv[r.block_table[p // bs] * bs + p % bs] for p in range(r.end_position)]
            truth = reference(req.prompt_token_ids, r.end_position - req.num_prompt_tokens)
            assert ctx == list(enumerate(truth[: r.end_position])), "KV read back is wrong"
            if r.produces_token:
                sampled[r.request_id] = next_token([t for _, t in ctx])
        self.previous = sampled
        return sampled


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
         max_model_len: int = 256, chunked: bool = True) -> Scheduler:  # fmt: skip
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len,
                     enable_chunked_prefill=chunked, async_scheduling=True)  # fmt: skip


def test_placeholders_feed_the_in_flight_token_and_length_limits_are_not_overrun() -> None:
    s = make()
    eng = PipelinedFakeEngine(s)
    s.submit(Request("a", [1, 2, 3], max_tokens=2))
    first = s.next_batch()
    sampled = eng.launch(first)
    second = s.next_batch()  # scheduled while the first is outstanding
    (row,) = second.requests
    assert row.token_ids == [PLACEHOLDER_TOKEN_ID] and row.start_position == 3
    assert s.get_request("a").num_placeholders == 2
    with pytest.raises(RuntimeError, match="advance"):
        s.next_batch()  # at most two outstanding
    with pytest.raises(RuntimeError, match="oldest"):
        s.advance(second, {})
    s.advance(first, sampled)
    sampled2 = eng.launch(second)
    assert s.next_batch() is None  # the last token is in flight: max_tokens is certain
    (done,) = s.advance(second, sampled2)
    assert done.finish_reason == "length" and done.output_token_ids == reference([1, 2, 3], 2)[3:]
    assert done.num_placeholders == 0 and s.block_manager.num_free_blocks == 64


def test_a_request_finished_in_flight_keeps_its_blocks_until_its_last_batch_is_advanced() -> None:
    s = make(num_blocks=8)
    eng = PipelinedFakeEngine(s)
    s.submit(Request("a", list(range(1, 10)), max_tokens=20))
    first = s.next_batch()
    sampled = eng.launch(first)
    second = s.next_batch()  # a's placeholder row
    sampled2 = eng.launch(second)
    (done,) = s.advance(first, sampled, {"a": RequestStatus.FINISHED_STOPPED})
    assert done.block_ids == [] and s.block_manager.num_used_blocks == 3  # held for `second`
    assert s.advance(second, sampled2) == []  # its late row is dropped
    assert s.block_manager.num_free_blocks == 8
    # the extra KV slot is never cached: only the 2 full blocks of the 9 known tokens are
    assert s.block_manager.match_prefix(list(range(1, 10)) + [5] * 8)[1] == 8


def run_pipelined(s: Scheduler, rng: random.Random, arrivals: list[Request], stop_p: float,
                  abort_p: float) -> tuple[PipelinedFakeEngine, set[str]]:  # fmt: skip
    eng = PipelinedFakeEngine(s)
    in_flight: tuple[ScheduledBatch, dict[str, int]] | None = None
    cut_short: set[str] = set()
    for step in range(5000):
        if step < len(arrivals) and (req := arrivals[step]) is not None:
            try:
                s.submit(req)
            except ValueError as e:
                assert "can never fit" in str(e) or "max_model_len" in str(e)
        live = [r for r in arrivals[: step + 1] if r is not None and not r.is_finished]
        if live and rng.random() < abort_p and s.abort((victim := rng.choice(live)).request_id):
            cut_short.add(victim.request_id)
        batch = s.next_batch()
        launched = None if batch is None else (batch, eng.launch(batch))
        if in_flight is not None:
            sampled = in_flight[1]
            stops = {rid: RequestStatus.FINISHED_STOPPED for rid in sampled
                     if s.get_request(rid) is not None and rng.random() < stop_p}  # fmt: skip
            cut_short |= set(stops)
            s.advance(in_flight[0], sampled, stops)
        in_flight = launched
        if in_flight is None and step >= len(arrivals) and not s.has_unfinished_requests():
            break
    return eng, cut_short


PLACEHOLDERS_SEEN: list[int] = []


@pytest.mark.parametrize("seed", range(40))
def test_random_pipelined_workloads_complete_correctly_without_leaks(seed: int) -> None:
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    num_blocks, max_model_len = rng.randint(3, 20), rng.randint(4, 64)
    s = make(num_blocks=num_blocks, block_size=rng.choice([1, 2, 4, 8]),
             max_num_seqs=rng.randint(1, 8), max_model_len=max_model_len,
             budget=rng.randint(1 if chunked else max_model_len, 80), chunked=chunked)  # fmt: skip
    bases = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]
    arrivals: list[Request | None] = []
    for i in range(60):
        prompt = rng.choice(bases)[: rng.randint(1, 40)] + [rng.randrange(5)] * rng.randint(0, 2)
        keep = rng.random() < 0.5
        arrivals.append(Request(f"r{i}", prompt, max_tokens=rng.randint(1, 30)) if keep else None)
    eng, cut_short = run_pipelined(s, rng, arrivals, stop_p=0.02, abort_p=0.03)
    assert not s.has_unfinished_requests() and s.block_manager.num_free_blocks == num_blocks
    for r in arrivals:
        if r is None or r.status is RequestStatus.WAITING:  # rejected at submit
            continue
        assert r.num_placeholders == 0
        expected = min(r.max_tokens, max(max_model_len - r.num_prompt_tokens, 1))
        assert r.num_output_tokens == expected or r.request_id in cut_short
        assert r.num_output_tokens <= expected
        assert r.token_ids == reference(r.prompt_token_ids, r.num_output_tokens)
    PLACEHOLDERS_SEEN.append(eng.num_placeholders)


def test_the_random_workloads_did_feed_placeholders() -> None:
    assert sum(PLACEHOLDERS_SEEN) > 0


def test_preemption_under_a_tiny_budget_with_tokens_in_flight() -> None:
    rng = random.Random(7)
    s = make(num_blocks=6, block_size=4, max_num_seqs=6, budget=32, max_model_len=24)
    reqs = []
    for i in range(16):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(2, 12))]
        reqs.append(Request(f"r{i}", prompt, max_tokens=rng.randint(1, 24 - len(prompt))))
    eng, _ = run_pipelined(s, rng, list(reqs), stop_p=0.0, abort_p=0.0)
    for r in reqs:
        assert r.token_ids == reference(r.prompt_token_ids, r.max_tokens)
    assert sum(r.num_preemptions for r in reqs) > 0 and eng.num_placeholders > 0
    assert s.block_manager.num_free_blocks == 6
