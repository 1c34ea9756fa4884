"""TP=2 over a real 2-process gloo group gives TP=1's logits, with half of every sharded weight
on each rank."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import xhal
from models.loader import load_model
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.layers import TensorParallel

PROMPTS = [[3, 17, 5, 9, 22, 1, 7], [11, 4, 19, 30, 2]]
SHARDED = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "embed_tokens.weight",
)


def run_steps(
    model_dir: str,
    tp: TensorParallel,
    collective,
    enforce_eager: bool = True,
    load_format: str = "auto",
) -> tuple[torch.Tensor, dict[str, tuple]]:
    """Prefill both prompts, then two decode steps; returns every step's logits and param shapes."""
    from tests.support.paged_host import PagedHost

    model = load_model(
        model_dir, dtype=torch.float32, tp=tp, progress=False, load_format=load_format
    )
    executor = ModelExecutor(
        model, xhal.platforms.get("cpu"), ExecutorConfig(enforce_eager=enforce_eager), collective
    )
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=32))
    host, out = PagedHost(32, 16, seed=1), []
    steps = [[(i, p) for i, p in enumerate(PROMPTS)], [(0, [8]), (1, [6])], [(1, [25]), (0, [13])]]
    for chunks in steps:
        ids, pos, meta = host.step(chunks)
        out.append(executor.compute_logits(executor.execute(ids, pos, meta)))
    shapes = {
        n: tuple(p.shape)
        for n, p in model.named_parameters()
        if n.startswith("model.layers.0.") or "embed" in n
    }
    return torch.cat(out), shapes


def _rank(
    rank: int, model_dir: str, init: str, result_dir: str, enforce_eager: bool, load_format: str
) -> None:
    platform = xhal.platforms.get("cpu")
    group = platform.init_process_group(rank, 2, init)
    logits, shapes = run_steps(
        model_dir, TensorParallel(rank, 2), platform.collective(group), enforce_eager, load_format
    )
    torch.save({"logits": logits, "shapes": shapes}, os.path.join(result_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()  # both ranks are past their last collective
    # Exit without tearing the gloo group down: under load, its destructor has aborted the process
    # ("terminate called without an active exception") after the results were already saved.
    os._exit(0)


def tp2_matches_tp1(
    model_dir: str, enforce_eager: bool, load_format: str = "auto"
) -> tuple[dict[str, tuple], list[dict]]:
    """Run the steps at TP=1 in this process and at TP=2 over a real 2-process gloo group; assert
    each rank's logits equal TP=1's within 1e-5 relative. Returns TP=1's parameter shapes and
    each rank's results (its logits and parameter shapes)."""
    single, full_shapes = run_steps(
        model_dir,
        TensorParallel(0, 1),
        xhal.platforms.get("cpu").collective(None),
        load_format=load_format,
    )
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.start_processes(
            _rank,
            args=(model_dir, init, tmp, enforce_eager, load_format),
            nprocs=2,
            start_method="spawn",
            join=True,
        )
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for r in results:
        rel = float((r["logits"] - single).abs().max() / single.abs().max())
        assert rel < 1e-5, f"TP=2 logits differ from TP=1 by {rel:.2e} relative"
    return full_shapes, results


@pytest.mark.parametrize(
    ("name", "enforce_eager"),
    [("llama_gqa", True), ("qwen3", True), ("llama_gqa", False)],
    ids=["llama-eager", "qwen3-eager", "llama-graphs"],
)
def test_tp2_matches_tp1(checkpoint_factory, name, enforce_eager):
    """With graphs, the all-reduces are captured inside the decode and piecewise graphs."""
    full_shapes, results = tp2_matches_tp1(str(checkpoint_factory(name)), enforce_eager)
    for r in results:
        for name_, shape in r["shapes"].items():
            if name_.endswith(SHARDED):
                assert (
                    shape[0] * 2 == full_shapes[name_][0] or shape[1] * 2 == full_shapes[name_][1]
                ), name_


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_moe"])
def test_tp2_matches_tp1_with_dummy_weights(checkpoint_factory, tmp_path, name):
    """``load_format="dummy"`` draws the same model at every TP size (a rank keeps its shards of
    what one rank would draw), so TP=2 is checked against TP=1 from a config.json alone."""
    (tmp_path / "config.json").write_text((checkpoint_factory(name) / "config.json").read_text())
    tp2_matches_tp1(str(tmp_path), enforce_eager=True, load_format="dummy")
