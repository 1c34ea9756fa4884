"""The executor over a paged KV cache (random permuted block tables, block size 16, float32)
against Hugging Face transformers running the same checkpoint without a cache."""

from __future__ import annotations

import random

import pytest
import torch

import xhal
from models.loader import load_model
from tests.support.paged_host import PagedHost
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces import BatchKind

transformers = pytest.importorskip("transformers")

RTOL = 1e-4
CHECKPOINTS = ["llama_gqa", "qwen2", "qwen3", "llama_tied"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Harness:
    def __init__(self, model_dir, enforce_eager: bool = True, num_blocks: int = 64, seed: int = 0):
        self.platform = xhal.platforms.get("cpu")
        self.model = load_model(model_dir, dtype=torch.float32, progress=False)
        config = ExecutorConfig(
            dtype=torch.float32,
            block_size=16,
            max_num_seqs=8,
            max_model_len=256,
            enforce_eager=enforce_eager,
        )
        self.executor = ModelExecutor(self.model, self.platform, config)
        self.executor.bind_kv_caches(self.executor.allocate_kv_caches(num_blocks=num_blocks))
        self.host = PagedHost(num_blocks, 16, seed=seed)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.vocab = self.hf.config.vocab_size

    def step(self, chunks):
        """Run one step; returns float32 logits of every token of the step."""
        ids, pos, meta = self.host.step(chunks)
        hidden = self.executor.execute(ids, pos, meta)
        return self.executor.compute_logits(hidden), meta

    @torch.no_grad()
    def reference(self, tokens: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(params=CHECKPOINTS)
def harness(request, checkpoint_factory):
    return Harness(checkpoint_factory(request.param))


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_prefill_batch_of_three_lengths(harness):
    seqs = prompts(harness.vocab, [5, 23, 40])
    logits, meta = harness.step([(i, s) for i, s in enumerate(seqs)])
    assert meta.kind == BatchKind.PREFILL
    start = 0
    for s in seqs:
        assert rel_err(logits[start : start + len(s)], harness.reference(s)) < RTOL
        start += len(s)


def test_decode_steps(harness):
    seqs = prompts(harness.vocab, [7, 19, 33])
    harness.step([(i, s) for i, s in enumerate(seqs)])
    for step in range(4):
        new = [random.Random(step * 10 + i).randrange(harness.vocab) for i in range(len(seqs))]
        logits, meta = harness.step([(i, [t]) for i, t in enumerate(new)])
        assert meta.kind == BatchKind.DECODE
        for i, t in enumerate(new):
            seqs[i].append(t)
            assert rel_err(logits[i], harness.reference(seqs[i])[-1]) < RTOL


def test_prompt_prefilled_in_three_chunks(harness):
    (seq,) = prompts(harness.vocab, [45])
    reference = harness.reference(seq)
    for lo, hi in ((0, 16), (16, 30), (30, 45)):
        logits, meta = harness.step([(0, seq[lo:hi])])
        assert meta.kind == (BatchKind.PREFILL if lo == 0 else BatchKind.CHUNKED_PREFILL)
        assert rel_err(logits, reference[lo:hi]) < RTOL


def test_mixed_decodes_and_prefill_chunk(harness):
    a, b, c = prompts(harness.vocab, [12, 20, 30])
    harness.step([(0, a), (1, b), (2, c[:10])])
    nxt = prompts(harness.vocab, [1, 1], seed=7)
    logits, meta = harness.step([(1, nxt[0]), (2, c[10:25]), (0, nxt[1])])  # any order
    assert meta.kind == BatchKind.MIXED
    b, a = b + nxt[0], a + nxt[1]
    assert rel_err(logits[0], harness.reference(b)[-1]) < RTOL
    assert rel_err(logits[1:16], harness.reference(c[:25])[10:25]) < RTOL
    assert rel_err(logits[16], harness.reference(a)[-1]) < RTOL


@pytest.mark.parametrize(
    "checkpoint,enforce_eager",
    [("llama_gqa", True), ("llama_gqa", False), ("llama_head_dim_16", True)],
    ids=["eager", "graph", "head_dim_16"],
)
def test_greedy_32_steps_match_transformers(checkpoint_factory, checkpoint, enforce_eager):
    """Greedy decoding equals transformers'; head dim 16 too, which the CPU reference serves
    because it declares any head dim."""
    h = Harness(checkpoint_factory(checkpoint), enforce_eager=enforce_eager)
    seqs = prompts(h.vocab, [6, 11, 17])
    with torch.no_grad():
        expected = [
            h.hf.generate(torch.tensor([s]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[
                0, len(s) :
            ].tolist()
            for s in seqs
        ]
    logits, meta = h.step([(i, s) for i, s in enumerate(seqs)])
    ends = meta.q_cu_seq_lens[1:].long() - 1
    produced = [[t] for t in xhal.ops.argmax(logits[ends]).tolist()]
    for _ in range(31):
        logits, _ = h.step([(i, [p[-1]]) for i, p in enumerate(produced)])
        for p, t in zip(produced, xhal.ops.argmax(logits).tolist()):
            p.append(t)
    assert produced == expected


def test_graph_decode_equals_eager_with_padding(checkpoint_factory):
    """Three sequences replay in the bucket of four: the padding row never changes real rows."""
    path = checkpoint_factory("qwen3")
    eager, graph = (
        Harness(path, enforce_eager=True, seed=3),
        Harness(path, enforce_eager=False, seed=3),
    )
    seqs = prompts(eager.vocab, [9, 14, 21])
    for h in (eager, graph):
        h.step([(i, s) for i, s in enumerate(seqs)])
    for step in range(3):  # lengths change every replay
        new = [(i, [random.Random(step + 5 * i).randrange(eager.vocab)]) for i in range(3)]
        a, _ = eager.step(new)
        b, _ = graph.step(new)
        assert rel_err(b, a) < 1e-5  # not bitwise: the bucket's GEMMs have 4 rows, eager's 3
    graphs = graph.executor.decode_graphs
    assert ("decode", 4) in graphs.graphs
    assert ("logits", 4) in graphs.graphs  # the LM head ran from the bucket's graph too
    # hidden states that are not the last replay's own (a copy) take the eager LM head
    hidden = graph.executor.execute(*graph.host.step([(0, [1]), (1, [2]), (2, [3])]))
    by_graph = graph.executor.compute_logits(hidden).clone()
    assert graph.executor.decode_graphs.logits_of(hidden.clone()) is None
    assert rel_err(graph.executor.compute_logits(hidden.clone()), by_graph) < 1e-5


def test_graph_decode_logits_in_inference_mode_bfloat16(checkpoint_factory):
    """bfloat16, every step under ``torch.inference_mode`` as the server runs a CPU platform: the
    LM head's float cast, captured with the bucket, is refreshed at every replay (a recorder
    that trusted ``to``'s "may alias" schema kept the capture step's logits)."""
    path = checkpoint_factory("llama_tied")
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    runs = {}
    for enforce_eager in (True, False):
        config = ExecutorConfig(
            dtype=torch.bfloat16, block_size=16, max_num_seqs=4, max_model_len=128,
            enforce_eager=enforce_eager, decode_graph_sizes=(4,), piecewise_token_sizes=(),
        )  # fmt: skip
        executor = ModelExecutor(model, xhal.platforms.get("cpu"), config)
        executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=32))
        host, logits = PagedHost(32, 16, seed=3), []
        with torch.inference_mode():
            executor.execute(*host.step([(s, [3 + s] * (5 + 7 * s)) for s in range(4)]))
            for step, seqs in enumerate([[0, 1, 2, 3], [0, 2, 3], [1, 3], [0, 1, 2, 3]]):
                hidden = executor.execute(*host.step([(s, [10 + 3 * step + s]) for s in seqs]))
                logits.append(executor.compute_logits(hidden).clone())
        runs[enforce_eager] = logits
    assert ("logits", 4) in executor.decode_graphs.graphs
    for step, (g, e) in enumerate(zip(runs[False], runs[True])):
        assert rel_err(g, e) < 2e-2, f"decode step {step}: graph logits != eager"


def test_graph_decode_batches_shrinking_in_a_bucket(checkpoint_factory):
    """Rows a larger step left in the persistent buffers go back to padding: a smaller batch in
    the same bucket writes no stale slot, and every cache equals the eager run's."""
    path = checkpoint_factory("qwen3")
    eager, graph = (
        Harness(path, enforce_eager=True, seed=3),
        Harness(path, enforce_eager=False, seed=3),
    )
    seqs = prompts(eager.vocab, [9, 14, 21, 6])
    for h in (eager, graph):
        h.step([(i, s) for i, s in enumerate(seqs)])
    for step, active in enumerate(([0, 1, 2, 3], [2], [1, 3], [0, 1, 2])):  # buckets 4, 1, 2, 4
        new = [(i, [random.Random(step + 5 * i).randrange(eager.vocab)]) for i in active]
        a, _ = eager.step(new)
        b, _ = graph.step(new)
        assert rel_err(b, a) < 1e-5
        for ce, cg in zip(eager.executor.backends[0]._caches, graph.executor.backends[0]._caches):
            assert rel_err(cg.key, ce.key) < 1e-5 and rel_err(cg.value, ce.value) < 1e-5


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "piecewise"])
def test_warm_up_prefill_writes_no_cache(checkpoint_factory, enforce_eager):
    h = Harness(checkpoint_factory("llama_tied"), enforce_eager=enforce_eager)
    caches = h.executor.backends[0]._caches
    before = [(c.key.clone(), c.value.clone()) for c in caches]
    assert h.executor.warm_up(40) > 0
    assert all(
        torch.equal(k, c.key) and torch.equal(v, c.value) for (k, v), c in zip(before, caches)
    )
    seqs = prompts(h.vocab, [7])
    logits, _ = h.step([(0, seqs[0])])  # and the executor serves normally afterwards
    assert rel_err(logits[-1], h.reference(seqs[0])[-1]) < RTOL


def test_xllm_tuple_caches_synchronizer_and_empty(checkpoint_factory):
    h = Harness(checkpoint_factory("llama_tied"))
    model = load_model(checkpoint_factory("llama_tied"), dtype=torch.float32, progress=False)
    executor = ModelExecutor(model, h.platform, ExecutorConfig(enforce_eager=True))
    caches = executor.allocate_kv_caches(num_blocks=64)
    executor.bind_kv_caches([(c.key, c.value, None, None, None, None) for c in caches])
    events = []

    class Sync:
        def record_event(self, layer_id: int) -> None:
            events.append(layer_id)

    ids, pos, meta = PagedHost(64, 16).step([(0, [1, 2, 3])])
    hidden = executor.execute(ids, pos, meta, layer_synchronizer=Sync())
    assert events == list(range(len(caches)))
    assert rel_err(executor.compute_logits(hidden), h.reference([1, 2, 3])) < RTOL
    empty = PagedHost(64, 16).step([(0, [1])])[2]
    empty = type(empty)(**{**vars(empty), "kind": BatchKind.EMPTY})
    out = executor.execute(
        torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), empty
    )
    assert out.shape == (0, executor.hidden_size) and executor.hidden_size == 64


def test_capture_graphs_up_front_writes_no_cache(checkpoint_factory):
    h = Harness(checkpoint_factory("llama_tied"), enforce_eager=False)
    before = [c.key.clone() for c in h.executor.backends[0]._caches]
    stats = h.executor.capture_graphs(progress=False)
    assert stats["graphs"] == len(h.executor.config.decode_capture_sizes)
    assert all(
        ("decode", s) in h.executor.decode_graphs.graphs
        for s in h.executor.config.decode_capture_sizes
    )
    assert all(torch.equal(a, c.key) for a, c in zip(before, h.executor.backends[0]._caches))
    seqs = prompts(h.vocab, [5, 9])
    h.step([(i, s) for i, s in enumerate(seqs)])
    logits, _ = h.step([(0, [3]), (1, [4])])  # replays the pre-captured bucket of 2
    assert rel_err(logits[0], h.reference(seqs[0] + [3])[-1]) < RTOL
    assert rel_err(logits[1], h.reference(seqs[1] + [4])[-1]) < RTOL


def test_capture_graphs_reports_the_memory_the_graphs_keep(checkpoint_factory, monkeypatch):
    """The capture's memory figure counts what the graphs keep: not the blocks a caching
    allocator held before it (which capturing gives back, as ``torch.cuda.graph`` empties the
    cache), nor those a warm-up allocated and freed. Here an allocator model: each bucket keeps
    1 MiB and leaves 64 MiB freed in the cache; 100 MiB sit cached before."""
    h = Harness(checkpoint_factory("llama_tied"), enforce_eager=False)
    mib, total = 2**20, 2**40
    memory = {"used": 0, "cached": 100 * mib}

    def empty_cache():
        memory["cached"] = 0

    graphs = h.executor.decode_graphs
    run = graphs.run

    def capture(*args, **kwargs):
        empty_cache()
        memory["used"] += mib
        memory["cached"] += 64 * mib
        return run(*args, **kwargs)

    monkeypatch.setattr(h.platform, "empty_cache", empty_cache)
    monkeypatch.setattr(
        h.platform, "mem_get_info", lambda: (total - memory["used"] - memory["cached"], total)
    )
    monkeypatch.setattr(graphs, "run", capture)
    stats = h.executor.capture_graphs(progress=False)
    assert stats["memory_bytes"] == stats["graphs"] * mib


def test_piecewise_prefill_and_mixed_match_eager(checkpoint_factory):
    """Prefill, chunked and mixed steps of different lengths replay the same token buckets, with
    attention planned per step between the captured pieces."""
    path = checkpoint_factory("qwen2")
    eager, graph = (
        Harness(path, enforce_eager=True, seed=4),
        Harness(path, enforce_eager=False, seed=4),
    )
    a, b, c = prompts(eager.vocab, [7, 20, 31])
    steps = [
        [(0, a), (1, b[:9])],  # 16 tokens: bucket 16
        [(1, b[9:]), (2, c[:5])],  # 16 tokens again, other lengths: replay of bucket 16
        [(0, [4]), (2, c[5:])],  # mixed, 27 tokens: bucket 32
        [(2, [9]), (1, [5]), (0, [6, 7, 8])],  # mixed, 5 tokens: bucket 16 again
    ]
    for chunks in steps:
        expected, _ = eager.step(chunks)
        got, _ = graph.step(chunks)
        assert rel_err(got, expected) < 1e-5
    pieces = graph.executor.piecewise.graphs
    assert ("tokens", 16) in pieces and ("tokens", 32) in pieces and ("tokens", 64) not in pieces
