"""The CUDA platform's FlashInfer attention (``xhal.platforms.cuda.attention``) on the FlashInfer
emulation (``tests/support/flashinfer_emulation``, CPU tensors), so its bookkeeping is tested on
every CI run and not only on a GPU:

- the conformance families that drive attention (attention, graph) pass through
  ``xhal-conformance --device flashinfer-emulated --plugin ...``;
- full-graph decode through the executor, with batches shrinking and growing in a bucket and
  sequences crossing pages, equals eager decode on the same backend and the CPU reference, on the
  tensor-core and the CUDA-core paths;
- FlashInfer's scheduler reruns only when a sequence's page count changes; skipping that rerun
  gives wrong numbers here, as it would on a GPU;
- the emulated compiled module rejects a call that drifted from 0.5.3's argument layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import xhal
from benchmarks.host_timing import DeviceCalls
from tests.support.conformance_run import explain, run_conformance
from tests.support.paged_host import PagedHost
from xhal.interfaces import BatchKind

PLUGIN = "tests.support.flashinfer_emulation.plugin"
BLOCK_SIZE = 16
PROMPTS = {0: 14, 1: 31, 2: 5, 3: 47}  # prompt lengths; decode steps take 0, 1 and 3 across pages
STEPS = [[0, 1, 2], [0, 1, 2, 3], [1, 3], [3, 0, 2], [2], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_conformance_attention_and_graph_pass(tmp_path: Path) -> None:
    families = ("attention", "graph")
    proc, report = run_conformance("flashinfer-emulated", PLUGIN, tmp_path / "fi.json", families)
    assert proc.returncode == 0, explain(proc)
    assert sorted(report["families"]) == ["attention", "graph"], explain(proc)
    for name, fam in report["families"].items():
        assert fam["failed"] == 0 and fam["passed"] > 0, f"family {name}: {fam}\n{explain(proc)}"


# the executor on the emulated platform ---------------------------------------------------------


@pytest.fixture
def emulated() -> Iterator[type]:
    """The emulated platform's class; the emulation is uninstalled after the test."""
    from tests.support.flashinfer_emulation import uninstall
    from tests.support.flashinfer_emulation.plugin import EmulatedFlashInferPlatform

    try:
        yield EmulatedFlashInferPlatform
    finally:
        uninstall()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="the tiny checkpoint is built with transformers")
    from tests.support.checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("fi-llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> torch.nn.Module:
    from models.loader import load_model

    return load_model(model_dir, dtype=torch.bfloat16, progress=False)


def executor_on(
    platform, model, seqs: int, max_model_len: int = 128, num_blocks: int = 24, **config
):
    """A bf16 executor on ``platform`` with one decode bucket of ``seqs`` and its KV cache bound."""
    from xhal.executor import ExecutorConfig, ModelExecutor

    config = {"decode_graph_sizes": (seqs,), "piecewise_token_sizes": (), **config}
    cfg = ExecutorConfig(
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
        max_num_seqs=seqs,
        max_model_len=max_model_len,
        **config,
    )
    executor = ModelExecutor(model, platform, cfg)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=num_blocks))
    return executor


def decode_run(platform, model: torch.nn.Module, enforce_eager: bool) -> list[torch.Tensor]:
    """Prefill four prompts, then the decode steps of ``STEPS`` (bucket 4: other rows, lengths and
    page counts at every replay). Returns each decode step's logits."""
    executor = executor_on(platform, model, 4, enforce_eager=enforce_eager)
    host = PagedHost(24, BLOCK_SIZE, seed=3)
    chunks = [(s, [(7 * s + j) % 200 + 3 for j in range(n)]) for s, n in PROMPTS.items()]
    executor.execute(*host.step(chunks))
    logits = []
    for step, seqs in enumerate(STEPS):
        ids, pos, meta = host.step([(s, [(11 * step + s) % 200 + 3]) for s in seqs])
        assert meta.kind == BatchKind.DECODE
        logits.append(executor.compute_logits(executor.execute(ids, pos, meta)).clone())
    return logits


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-cores", "cuda-cores"])
def test_graph_decode_equals_eager_and_the_reference(emulated, model, tensor_cores: bool) -> None:
    platform = emulated(use_tensor_cores=tensor_cores)
    graph = decode_run(platform, model, enforce_eager=False)
    eager = decode_run(platform, model, enforce_eager=True)
    reference = decode_run(xhal.platforms.get("cpu"), model, enforce_eager=True)
    for step, (g, e, r) in enumerate(zip(graph, eager, reference)):
        assert torch.equal(g, e), f"decode step {step}: graph replay != eager"
        assert torch.allclose(g, r, atol=2e-2, rtol=0), f"decode step {step}: != the CPU reference"


def test_piecewise_prefill_and_mixed_steps_equal_eager(emulated, model) -> None:
    """Prefill, chunked and mixed steps through piecewise graphs, FlashInfer's prefill wrapper
    planned per step between the pieces, equal eager steps on the same backend."""
    platform = emulated()

    def run(enforce_eager: bool) -> list[torch.Tensor]:
        executor = executor_on(
            platform, model, 4, enforce_eager=enforce_eager, piecewise_token_sizes=(16, 32)
        )
        host, out = PagedHost(24, BLOCK_SIZE, seed=6), []
        a, b, c = ([(5 * n + j) % 200 + 3 for j in range(n)] for n in (7, 20, 31))
        for chunks in (
            [(0, a), (1, b[:9])],  # 16 tokens: bucket 16
            [(1, b[9:]), (2, c[:5])],  # 16 again, other lengths: a replay
            [(0, [4]), (2, c[5:])],  # mixed, 27 tokens: bucket 32
            [(2, [9]), (1, [5]), (0, [6, 7, 8])],  # mixed, 5 tokens
        ):
            out.append(executor.execute(*host.step(chunks)).clone())
        if not enforce_eager:
            assert all(("tokens", n) in executor.piecewise.graphs for n in (16, 32))
        return out

    for step, (g, e) in enumerate(zip(run(False), run(True))):
        assert torch.equal(g, e), f"step {step}: piecewise != eager"


def test_scheduler_reruns_only_when_a_page_count_changes(emulated, model, monkeypatch) -> None:
    from xhal.platforms.cuda.flashinfer_decode_bucket import DecodeBucket

    counts: list[tuple[int, ...]] = []
    schedule = DecodeBucket._schedule

    def counting(self, m, indptr, spec, common):
        counts.append(tuple(indptr.tolist()))
        schedule(self, m, indptr, spec, common)

    monkeypatch.setattr(DecodeBucket, "_schedule", counting)
    decode_run(emulated(use_tensor_cores=True), model, enforce_eager=False)
    # the first replay plans through the wrapper; later ones reschedule when the page indptr moves
    host, indptrs = PagedHost(24, BLOCK_SIZE), []
    host.step([(s, [3] * n) for s, n in PROMPTS.items()])
    for seqs in STEPS:
        _, _, meta = host.step([(s, [3]) for s in seqs])
        pages = [-(-n // BLOCK_SIZE) for n in meta.kv_seq_lens_host.tolist()] + [1] * (
            4 - len(seqs)
        )
        indptrs.append(tuple(torch.tensor([0, *pages]).cumsum(0).tolist()))
    expected = [b for a, b in pairwise(indptrs) if a != b]
    assert counts == expected
    assert 0 < len(counts) < len(STEPS) - 1, "the steps should both keep and change page counts"


def test_skipping_the_reschedule_gives_wrong_numbers(emulated, model, monkeypatch) -> None:
    from xhal.platforms.cuda.flashinfer_decode_bucket import DecodeBucket

    platform = emulated(use_tensor_cores=True)
    eager = decode_run(platform, model, enforce_eager=True)
    monkeypatch.setattr(DecodeBucket, "_schedule", lambda *args: None)
    stale = decode_run(platform, model, enforce_eager=False)
    wrong = [step for step, (s, e) in enumerate(zip(stale, eager)) if not torch.equal(s, e)]
    assert wrong, "a schedule left stale after page counts changed went unnoticed"


# the emulation's own checks --------------------------------------------------------------------


def test_compiled_module_rejects_a_drifted_argument_layout(emulated) -> None:
    from tests.support.flashinfer_emulation.compiled import compiled_module

    plan = compiled_module(True, torch.bfloat16, torch.bfloat16, 64, False, False).plan
    ws, host = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    indptr, lens = (
        torch.tensor([0, 1, 3], dtype=torch.int32),
        torch.tensor([5, 20], dtype=torch.int32),
    )
    qo = torch.arange(3, dtype=torch.int32)
    args = [ws, ws, host, qo, indptr, lens, 2, 2, 4, 1, 16, True, 64, 64, False, -1, -1, False, 0]
    assert plan(*args) == [2, 16, 4, 1]
    with pytest.raises(ValueError, match="19 arguments"):  # before 0.5.3: no num_colocated_ctas
        plan(*args[:-1])
    with pytest.raises(ValueError, match="host int32"):  # indptr left on the device, or int64
        plan(*args[:4], indptr.long(), *args[5:])
    with pytest.raises(ValueError, match="head dims"):
        plan(*args[:12], 128, 128, *args[14:])


# the bucket's host work ------------------------------------------------------------------------


def test_bucket_plan_queues_device_work_only_when_pages_change(emulated, model) -> None:
    """Within pages a graph step's attention plan queues nothing: the graph refreshes page ids and
    last-page lengths from the persistent metadata. A page boundary costs one upload."""
    executor = executor_on(emulated(use_tensor_cores=True), model, 2, num_blocks=8)
    host = PagedHost(8, BLOCK_SIZE, seed=1)
    executor.execute(*host.step([(0, [5] * 13), (1, [6] * 3)]))
    backend, plan, device_calls = executor.backends[0], executor.backends[0].plan, []

    def counted(metadata, graph_key=None):
        with DeviceCalls() as calls:
            plan(metadata, graph_key)
        device_calls.append(calls.ops)  # .numpy()

    backend.plan = counted
    lengths = (14, 15, 16, 17, 18)  # sequence 0 takes its second page at 17
    for _ in lengths:
        executor.execute(*host.step([(0, [7]), (1, [8])]))
    for kv_len, ops in zip(lengths, device_calls):
        # the first step creates the bucket and plans it through FlashInfer's wrapper
        assert bool(ops) == (kv_len in (14, 17)), f"kv length {kv_len}: {ops}"


def test_bucket_refuses_metadata_other_than_its_persistent_tensors(emulated) -> None:
    from xhal.interfaces import AttentionSpec

    platform = emulated()
    spec = AttentionSpec(4, 1, 64, torch.bfloat16, BLOCK_SIZE)
    backend = platform.attention_backend(spec)
    host = PagedHost(8, BLOCK_SIZE)
    host.step([(0, [1] * 20), (1, [1] * 3)])
    _, _, meta = host.step([(0, [2]), (1, [2])])
    backend.plan(meta, graph_key="bucket")
    _, _, fresh = host.step([(0, [3]), (1, [3])])  # new tensors, not the captured ones
    with pytest.raises(ValueError, match="persistent"):
        backend.plan(fresh, graph_key="bucket")


def test_bucket_refuses_a_kv_length_past_its_block_table(emulated) -> None:
    """A bucket's page counts come from a table of every length its block table can hold; a
    longer one is an error that says so, never a page count read past the table."""
    from xhal.interfaces import AttentionSpec
    from xhal.platforms.cuda.flashinfer_decode_bucket import page_counts

    assert page_counts(16, 2).tolist() == [0] + [1] * 16 + [2] * 16
    platform = emulated()
    backend = platform.attention_backend(AttentionSpec(4, 1, 64, torch.bfloat16, BLOCK_SIZE))
    host = PagedHost(8, BLOCK_SIZE)
    host.step([(0, [1] * 20), (1, [1] * 3)])
    _, _, meta = host.step([(0, [2]), (1, [2])])  # a table of 2 pages a row: 32 tokens at most
    backend.plan(meta, graph_key="bucket")
    meta.kv_seq_lens_host[0] = 2 * BLOCK_SIZE + 1  # in place, as the executor writes its own
    with pytest.raises(ValueError, match="past the 32 tokens its block table holds"):
        backend.plan(meta, graph_key="bucket")


@pytest.mark.parametrize("full_width", [True, False], ids=["full-width-table", "narrow-table"])
def test_a_steady_graph_step_queues_one_device_op_besides_the_replay(
    emulated, model, full_width: bool
) -> None:
    """Host time per graph step is mostly its device calls. Within pages, ``execute`` queues one
    copy of one packed buffer holding the step's rows, its block table (as wide as the persistent
    one or narrower) and the padding values, and the replay, nothing else."""
    executor = executor_on(
        emulated(use_tensor_cores=True), model, 2, max_model_len=64, num_blocks=8
    )
    host = PagedHost(8, BLOCK_SIZE, seed=2)
    executor.execute(*host.step([(0, [5] * 3), (1, [6] * 4)]))
    runner = executor.decode_graphs.graphs
    replay, outside = runner.replay, []

    def replay_unseen(key):
        with calls.paused():
            return replay(key)

    runner.replay = replay_unseen
    width = executor.config.max_blocks_per_seq if full_width else 1
    # kv lengths 4..6 and 5..7, inside the first page; the last step drops a sequence, whose
    # persistent row goes back to padding in the same copy
    for seqs in ([0, 1], [0, 1], [0, 1], [0]):
        ids, pos, meta = host.step([(s, [7]) for s in seqs])
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        table[:, : meta.block_table.shape[1]] = meta.block_table
        meta = dataclasses.replace(meta, block_table=table)
        with DeviceCalls(executor.decode_graphs.host_buffers) as calls:
            executor.execute(ids, pos, meta)
        outside.append((calls.ops, calls.copies))
    # one multi-tensor copy: the step's rows into the pinned buffer (memcpys on the host), then
    # that buffer's one copy to the device
    assert outside[1:] == [(["_foreach_copy_.default"], 1)] * 3, outside
