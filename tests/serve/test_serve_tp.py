"""Tensor parallelism in the engine and the server: TP=2 (the engine process as rank 0 plus one
spawned worker over gloo) gives TP=1's greedy tokens and text, under chunked prefill and
preemption; a worker's failure fails its step instead of hanging rank 0; no worker outlives its
engine."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve_cli.engine.config import EngineConfig
from serve_cli.engine.core import EngineCore
from serve_cli.engine.offline import generate
from serve_cli.engine.sampling import SamplingParams
from tests.support.processes import alive, spawned_children, wait_gone
from xhal import platforms
from xhal.platforms.cpu_ref.collective import GlooCollective
from xhal.platforms.cpu_ref.platform import CpuPlatform

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# a 32-token budget chunks every prompt longer than that over several steps
BASE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
FAULTY = "tp-faulty-worker"


class _FailingOnRank1(GlooCollective):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            raise RuntimeError("injected fault on rank 1")
        return super().all_reduce(x)


class FaultyWorkerPlatform(CpuPlatform):
    """The CPU reference, except that rank 1's first all-reduce raises."""

    name = FAULTY

    def collective(self, group=None):
        return super().collective(None) if group is None else _FailingOnRank1(group)


# Workers find it through XHAL_PLUGINS=test_serve_tp (spawned children keep tests/ on sys.path).
platforms.register(FAULTY, FaultyWorkerPlatform, replace=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread_per_rank() -> Iterator[None]:
    # two ranks on a 2-core machine: more threads per rank only add contention
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the spawned workers and servers
        yield
    torch.set_num_threads(previous)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _wait_gone(pids: list[int]) -> None:
    wait_gone(pids, f"processes {pids} outlived their engine")


def _kv_bytes_per_block(model_dir: Path, tp: int, block_size: int = 16) -> int:
    import json

    c = json.loads((model_dir / "config.json").read_text())
    per_rank_heads = c["num_key_value_heads"] // tp
    return 2 * c["num_hidden_layers"] * block_size * per_rank_heads * c["head_dim"] * 4


def test_tp2_engine_matches_tp1_with_chunked_prefill_and_preemption(llama_gqa_dir: Path) -> None:
    prompts = _prompts([5, 70, 17, 90, 3, 44])
    single = EngineCore(EngineConfig(model_dir=llama_gqa_dir, num_kv_blocks=64, **BASE))
    expected = generate(single, prompts, GREEDY)
    assert single.stats()["num_preemptions_total"] == 0

    # room for 16 blocks per rank: less than the six requests need together (6 * 7 blocks)
    per_rank = 16 * _kv_bytes_per_block(llama_gqa_dir, tp=2)
    engine = EngineCore(
        EngineConfig(
            model_dir=llama_gqa_dir, tensor_parallel_size=2, kv_cache_memory=per_rank, **BASE
        )
    )
    try:
        # the budget is per rank: each holds one of the two KV heads, so a block costs half
        assert engine.stats()["kv_blocks_total"] == 16
        workers = engine.runner.workers.pids
        assert len(workers) == 1 and all(map(alive, workers))
        assert generate(engine, prompts, GREEDY) == expected
        stats = engine.stats()
        assert stats["num_preemptions_total"] > 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        # a second round over the same engine (prefix-cache hits included) still agrees
        assert generate(engine, prompts[:3], GREEDY) == expected[:3]
    finally:
        engine.close()
    _wait_gone(workers)


def test_tp2_with_async_scheduling_matches_tp1(llama_gqa_dir: Path) -> None:
    """Steps launched before the one before is read back: the worker fills its placeholders from
    rank 0's broadcast of the tokens in flight, under chunked prefill and preemption."""
    prompts = _prompts([5, 70, 17, 90, 3, 44], seed=4)
    single = EngineCore(EngineConfig(model_dir=llama_gqa_dir, num_kv_blocks=64, **BASE))
    expected = generate(single, prompts, GREEDY)
    config = EngineConfig(
        model_dir=llama_gqa_dir,
        tensor_parallel_size=2,
        num_kv_blocks=16,
        async_scheduling=True,
        **BASE,
    )
    engine = EngineCore(config)
    describe, with_placeholders = engine.runner.input_builder.describe, []

    def counting(batch):
        step = describe(batch)
        with_placeholders.append(bool(step.placeholder_idxes))
        return step

    engine.runner.input_builder.describe = counting
    workers = engine.runner.workers.pids
    try:
        assert generate(engine, prompts, GREEDY) == expected
        assert sum(with_placeholders) > 10, "the steps did not overlap"
        assert engine.stats()["num_preemptions_total"] > 0
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.close()
    _wait_gone(workers)


def test_a_worker_failure_fails_the_step_not_the_engine(
    llama_gqa_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XHAL_PLUGINS", "tests.serve.test_serve_tp")
    engine = EngineCore(
        EngineConfig(model_dir=llama_gqa_dir, device=FAULTY, tensor_parallel_size=2, **BASE)
    )
    workers = engine.runner.workers.pids
    try:
        engine.add_request("a", [5, 6, 7], GREEDY)
        start = time.monotonic()
        (out,) = engine.step()
        assert time.monotonic() - start < 10, "rank 0 waited on a failed worker"
        assert out.finished and out.finish_reason == "error"
        assert "rank 1" in out.error and "injected fault on rank 1" in out.error
        _wait_gone(workers)  # the group is torn down at once ...
        engine.add_request("b", [5, 6, 7], GREEDY)
        (out,) = engine.step()  # ... and later steps say so instead of hanging
        assert out.finish_reason == "error" and "restart the engine" in out.error
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.close()


def test_serve_tp2_answers_like_tp1_and_leaves_no_worker(llama_gqa_dir: Path) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    from tests.support.launcher import ServerProcess

    texts = ["hello world the quick brown fox", "one two three", "a lazy dog jumps over " * 6]

    def complete(server: ServerProcess) -> list[tuple[str, list[int]]]:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="tiny",
            prompt=texts,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return [(c.text, c.token_ids) for c in sorted(out.choices, key=lambda c: c.index)]

    args = ["--model", str(llama_gqa_dir), "--served-model-name", "tiny", "--log-level", "warning"]
    args += ["--max-model-len", "128", "--num-kv-blocks", "32", "--max-num-batched-tokens", "16"]
    with ServerProcess(args) as server:
        expected = complete(server)
    server = ServerProcess([*args, "--tensor-parallel-size", "2"]).start()
    try:
        engine = spawned_children(server.process.pid)
        assert len(engine) == 1
        workers = spawned_children(engine[0])
        assert len(workers) == 1
        assert complete(server) == expected
        assert any(text for text, _ in expected), expected  # text, not only ids, is compared
    finally:
        code = server.stop()
    assert code in (0, -signal.SIGTERM), server.log()
    assert "Traceback" not in server.log(), server.log()
    _wait_gone(engine + workers)


def test_a_model_that_does_not_split_fails_to_start_and_leaves_no_worker(
    llama_gqa_dir: Path,
) -> None:
    import multiprocessing

    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        EngineCore(EngineConfig(model_dir=llama_gqa_dir, tensor_parallel_size=3, **BASE))
    left = [p for p in multiprocessing.active_children() if p.name.startswith("xhal-tp-worker")]
    assert not left
