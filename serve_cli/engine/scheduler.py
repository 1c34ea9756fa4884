"""Continuous batching over a paged KV cache: chunked prefill under a token budget, prefix-cache
reuse on admission and preemption by recompute. No torch: submit -> next_batch -> advance."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from serve_cli.engine.batch import ScheduledBatch, ScheduledRequest
from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.request import Request, RequestStatus


@dataclass
class _Outstanding:
    """A batch handed out and not advanced yet: the requests it ran (by identity, as an id may be
    reused once its request finished), and the blocks of those that finished meanwhile, held
    until the batch's writes are done."""

    batch: ScheduledBatch
    requests: dict[str, Request]
    held_blocks: list[list[int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # since the batch was handed out

    def runs(self, req: Request) -> bool:
        return self.requests.get(req.request_id) is req


class Scheduler:
    """Decides, step by step, which tokens of which requests run, and where their KV goes.

    Protocol, once per step::

        batch = scheduler.next_batch()        # None when no request is live
        ...the engine runs the batch and samples...
        done = scheduler.advance(batch, {rid: token}, {rid: RequestStatus.FINISHED_STOPPED})

    Each step, running requests go first (decodes, then unfinished prefills, each in admission
    order); then waiting requests are admitted in order while the token budget, ``max_num_seqs``
    and free blocks allow. With chunked prefill a prompt longer than the remaining budget runs in
    chunks over several steps. When a running request needs a block and none is free, the most
    recently arrived running request is preempted: its blocks are freed, its progress is reset and
    it goes back to the front of the queue, to be recomputed (its outputs are kept).

    Invariants:
    - A live request is in exactly one of ``waiting`` / ``running``; a finished one is in neither
      and holds no blocks.
    - Every batch has ``num_tokens <= max_num_batched_tokens`` and ``num_seqs <= max_num_seqs``;
      every fed position is ``< max_model_len``.
    - No request fails for lack of blocks: ``submit`` rejects only a request that could not fit
      even alone in the whole cache, and every accepted request runs to completion.
    - ``next_batch`` commits its batch (``num_computed_tokens`` moves to each chunk's end). At most
      one batch is outstanding, two with ``async_scheduling``: then step N+1 is scheduled while
      step N runs, and each request whose token step N samples feeds a placeholder for it
      (``Request.num_placeholders``). Batches are advanced in the order they were handed out.
    - A request at a length limit it is certain to reach once the steps in flight are read back
      is not scheduled again; one that finishes (or is aborted) while a batch that runs it is
      outstanding keeps its blocks referenced until that batch is advanced, and what that batch
      computed for it is dropped (its extra KV is never cached).
    - Prefix-cache entries are registered in ``advance``, after the step wrote their KV; a request
      the engine fails with ``FINISHED_ERROR`` registers nothing from that step.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}), max_num_batched_tokens "
                f"({max_num_batched_tokens}) and max_model_len ({max_model_len}) must be >= 1"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); raise it "
                "or enable chunked prefill"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_outstanding = 2 if async_scheduling else 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, tuple[float, int]] = {}  # (arrival_time, submit order)
        self._counter = itertools.count()
        self._outstanding: deque[_Outstanding] = deque()  # oldest first

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def submit(self, request: Request) -> None:
        """Queue ``request``; raises ValueError for one that could never complete."""
        rid, num_prompt, bm = request.request_id, request.num_prompt_tokens, self.block_manager
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already used by an unfinished request")
        if num_prompt < 1 or request.max_tokens < 1:
            raise ValueError(
                f"request {rid!r}: needs at least one prompt token ({num_prompt} given) and "
                f"max_tokens >= 1 ({request.max_tokens} given)"
            )
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {num_prompt} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        # The last sampled token is never fed: the KV holds one token less than the final length.
        final_len = max(min(num_prompt + request.max_tokens, self.max_model_len), num_prompt + 1)
        if (need := bm.num_blocks_for(final_len - 1)) > bm.num_blocks:
            raise ValueError(
                f"request {rid!r} can never fit in the KV cache: {num_prompt} prompt tokens + up "
                f"to {request.max_tokens} output tokens need {need} blocks of {bm.block_size} "
                f"tokens, but the cache has {bm.num_blocks} in all; lower max_tokens or the "
                "prompt length, or give the server more KV blocks"
            )
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self._arrival[rid] = (request.arrival_time, next(self._counter))
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a live request as aborted and free its blocks; None if unknown or finished."""
        request = self._requests.get(request_id)
        return None if request is None else self._finish(request, RequestStatus.FINISHED_ABORTED)

    def next_batch(self) -> ScheduledBatch | None:
        """Schedule and commit one step; None when no request is live (or, with a batch
        outstanding, none can run before that batch is advanced)."""
        if len(self._outstanding) >= self.max_outstanding:
            raise RuntimeError("advance() the previous batch before asking for the next one")
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens this step, in batch order
        preempted: list[str] = []

        # Decodes first, then unfinished prefills (a stable sort: admission order within each).
        for req in sorted(self.running, key=lambda r: self._num_unfed(r) > 1):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.num_placeholders and self._at_length_limit(req, req.num_placeholders):
                continue  # finishes for length once the step in flight is read back
            num_new = min(self._num_unfed(req), budget)
            assert num_new > 0, "between steps a running request always has a token to feed"
            while not bm.append_slots(req, req.num_computed_tokens + num_new):
                victim = max(self.running, key=lambda r: self._arrival[r.request_id])
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += scheduled.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = num_new
                budget -= num_new

        # Admit waiting requests in order; none while blocks are short (they would only thrash).
        while not preempted and self.waiting and budget and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted while its token was in flight: wait until it is known
            # a scored prompt is computed whole: a cached position would have no logits
            ids = req.token_ids
            cached_ids, num_cached = ([], 0) if req.scores_prompt else bm.match_prefix(ids)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.enable_chunked_prefill and num_cached + num_new < req.num_tokens:
                break
            if not bm.allocate(req, num_cached + num_new, cached_ids):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            self.running.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        if not scheduled:
            assert self._outstanding or not self._requests, "live requests but nothing schedulable"
            return None
        seqs = []
        for rid, num_new in scheduled.items():
            req = self._requests[rid]
            start = req.num_computed_tokens
            req.num_computed_tokens += num_new
            seq = ScheduledRequest.for_chunk(req, start, start + num_new, bm.block_size)
            req.num_placeholders += seq.produces_token
            seqs.append(seq)
        batch = ScheduledBatch(seqs, bm.block_size, self.num_running, self.num_waiting, preempted)
        self._outstanding.append(
            _Outstanding(batch, {rid: self._requests[rid] for rid in scheduled})
        )
        return batch

    def advance(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: Mapping[str, int],
        finished: Mapping[str, RequestStatus] | None = None,
    ) -> list[Request]:
        """Apply a step's results; return the requests that finished in it.

        ``sampled_token_ids`` holds a token for each of ``batch.sampled_request_ids`` unless
        ``finished`` names that request. ``finished`` maps request ids to a FINISHED_* status the
        engine decided (EOS or stop string: FINISHED_STOPPED; a failed step: FINISHED_ERROR). The
        scheduler itself finishes a request with FINISHED_LENGTH at ``max_tokens`` or
        ``max_model_len``. Requests that finished (or were aborted) since the batch was handed
        out are skipped; one preempted since gets its token (it was computed from valid KV).
        """
        if not self._outstanding or batch is not self._outstanding[0].batch:
            raise RuntimeError("advance() takes the oldest batch next_batch() returned")
        entry = self._outstanding.popleft()
        try:
            return self._apply(entry, sampled_token_ids, dict(finished or {}))
        finally:
            for block_ids in entry.held_blocks:  # the batch's writes into them are done
                self.block_manager.free_blocks(block_ids)

    def _apply(
        self,
        entry: _Outstanding,
        sampled_token_ids: Mapping[str, int],
        finished: dict[str, RequestStatus],
    ) -> list[Request]:
        for rid, reason in finished.items():
            if not reason.is_finished:
                raise ValueError(f"request {rid!r}: finish status must be FINISHED_*, not {reason}")
        done: list[Request] = []
        for seq in entry.batch.requests:
            rid, req = seq.request_id, entry.requests[seq.request_id]
            if self._requests.get(rid) is not req:
                continue  # finished or aborted since: what the step computed for it is dropped
            if seq.produces_token:
                req.num_placeholders -= 1
            reason = finished.pop(rid, None)
            if reason is not RequestStatus.FINISHED_ERROR:
                if rid not in entry.preempted:  # else its blocks are gone: nothing to cache
                    self.block_manager.cache_full_blocks(req, seq.end_position)
                if seq.produces_token and rid in sampled_token_ids:
                    req.append_output_token(sampled_token_ids[rid])
                elif seq.produces_token and reason is None:
                    raise ValueError(f"request {rid!r} expected a sampled token from this step")
                elif not seq.produces_token and rid in sampled_token_ids:
                    raise ValueError(f"request {rid!r} ran a prefill chunk that samples nothing")
                if reason is None and seq.produces_token and self._at_length_limit(req):
                    reason = RequestStatus.FINISHED_LENGTH
            if reason is not None:
                done.append(self._finish(req, reason))
        for rid, reason in finished.items():  # finished requests that were not in the batch
            if rid in self._requests:
                done.append(self._finish(self._requests[rid], reason))
        return done

    def _at_length_limit(self, req: Request, num_pending: int = 0) -> bool:
        """Whether ``req`` is at its length limit (counting ``num_pending`` tokens in flight)."""
        return (
            req.num_output_tokens + num_pending >= req.max_tokens
            or req.num_tokens + num_pending >= self.max_model_len
        )

    @staticmethod
    def _num_unfed(req: Request) -> int:
        """Tokens (known or in flight) whose KV is not computed or scheduled yet."""
        return req.num_tokens + req.num_placeholders - req.num_computed_tokens

    def _preempt(self, req: Request) -> None:
        # Its blocks go back now, even if a batch in flight writes into them: the device runs
        # steps in order, so whoever gets them next writes after that batch. The token that batch
        # samples for it is still valid and is kept.
        for entry in self._outstanding:
            if entry.runs(req):
                entry.preempted.add(req.request_id)
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: RequestStatus) -> Request:
        (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        # A batch still outstanding may be writing into its blocks: the last one frees them.
        holder = next((e for e in reversed(self._outstanding) if e.runs(req)), None)
        if holder is None:
            self.block_manager.free(req)
        else:
            holder.held_blocks.append(self.block_manager.release(req))
        req.num_computed_tokens = req.num_placeholders = 0  # rows still in flight are dropped
        req.status = reason
        del self._requests[req.request_id], self._arrival[req.request_id]
        return req
