"""``xhal-tune`` warms the autotuning cache for a model's shapes (here a CPU solution with a config
space, from a test plugin): every bucket of every linear is tuned once, and a second run times
nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.conformance_run import REPO, explain, suite_env

# five distinct linear shapes: qkv 64x32, o 32x32, gate_up 96x32, down 32x48, lm_head 100x32
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "vocab_size": 100,
}


def tune(
    model: Path, cache: Path, *extra: str, plugin: str = "tests.support.toy_tunable_cpu_plugin"
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "xhal.tools.tune_cli",
        str(model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-batch",
        "4",
        "--plugin",
        plugin,
        *extra,
    ]
    return subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        env=suite_env(XHAL_CACHE_DIR=str(cache)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tune_warms_the_cache_and_a_second_run_times_nothing(tmp_path: Path) -> None:
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    refused = tune(model, cache)  # no weights: a checkpoint is expected unless --load-format dummy
    assert refused.returncode == 2 and "--load-format dummy" in refused.stderr, explain(refused)

    first = tune(model, cache, "--load-format", "dummy")
    assert first.returncode == 0, explain(first)
    assert "linear=tunable: 15 buckets tuned, 0 from the cache" in first.stdout, explain(first)
    files = list((cache / "tuning").glob("cpu-cpu-*.json"))
    assert len(files) == 1, files
    winners = json.loads(files[0].read_text())["winners"]["linear=tunable"]
    expected = {
        f"m{m}-n{n}-k{k}"
        for m in (1, 2, 4)
        for n, k in ((64, 32), (32, 32), (96, 32), (32, 48), (100, 32))
    }
    assert set(winners) == expected and set(winners.values()) <= {"heavy", "light"}, winners

    second = tune(model, cache, "--load-format", "dummy")
    assert second.returncode == 0, explain(second)
    assert "linear=tunable: 0 buckets tuned, 15 from the cache" in second.stdout, explain(second)


def test_tune_runs_the_calls_of_a_solution_that_times_itself(tmp_path: Path) -> None:
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    # the tunable solution's winners share the file; they are not this solution's to report
    assert tune(model, cache, "--load-format", "dummy").returncode == 0
    plugin = "tests.support.toy_self_timing_cpu_plugin"
    first = tune(model, cache, "--load-format", "dummy", plugin=plugin)
    assert first.returncode == 0, explain(first)
    assert "linear=tunable" not in first.stdout, explain(first)
    assert "linear=self-timing: 15 calls run (it times its own choices)" in first.stdout
    assert "linear=self-timing/choice: 15 buckets new, 15 in the cache; winners: plain x15" in (
        first.stdout
    ), explain(first)
    second = tune(model, cache, "--load-format", "dummy", plugin=plugin)
    again = "linear=self-timing/choice: 0 buckets new, 15 in the cache"
    assert again in second.stdout, explain(second)


def test_tune_covers_every_decode_graph_bucket(tmp_path: Path) -> None:
    """``--max-batch 64`` runs the calls of every bucket the executor captures decode graphs at
    up to 64 (1, 2, 4, 8, 16, 32, 48, 64: eight, five linears each), not only the powers of two:
    a bucket left out would be timed at the server's start instead."""
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    extra = ("--load-format", "dummy", "--max-batch", "64")
    proc = tune(model, cache, *extra, plugin="tests.support.toy_self_timing_cpu_plugin")
    assert proc.returncode == 0, explain(proc)
    assert "linear=self-timing: 40 calls run" in proc.stdout, explain(proc)


def test_tune_without_a_config_space_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cmd = [
        sys.executable,
        "-m",
        "xhal.tools.tune_cli",
        str(tmp_path),
        "--device",
        "cpu",
        "--load-format",
        "dummy",
    ]
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        env=suite_env(XHAL_CACHE_DIR=str(tmp_path / "c")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        proc.returncode == 0
        and "nothing to tune" in proc.stdout
        and "linear=reference" in proc.stdout
    ), explain(proc)
