"""Conformance family "graph": ``platform.graph_runner()`` replays work like a device graph.

A replay re-runs the captured device work on the captured tensors: it sees new values written in
place into its inputs, never calls the captured function again, and keeps the Python values of
capture. Attention inside a graph, the way the executor's decode buckets use it, is the family's
other file (``test_graph_attention.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

import xhal
from conformance_tests.batches import one_cpu_thread, randn, runner_or_skip

UNKNOWN_KEY_ERRORS = (LookupError, RuntimeError, ValueError)

dtypes = pytest.mark.parametrize(
    "dtype",
    (torch.float32, torch.bfloat16, torch.float16),
    ids=lambda d: str(d).removeprefix("torch."),
)


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@dtypes
def test_replay_equals_eager_after_inplace_update(platform, device, dtype):
    """Replay after new values are copied into the inputs equals running the function eagerly."""
    runner = runner_or_skip(platform)
    if dtype not in platform.capabilities.ops_dtypes:
        pytest.skip(f"{platform.name} does not declare ops dtype {dtype}")
    rng = random.Random(f"mlp {dtype}")
    hidden, inter = 64, 96
    shapes = {
        "x": (8, hidden),
        "norm": (hidden,),
        "up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }
    scales = {"x": 1.0, "norm": 1.0, "up": hidden**-0.5, "down": inter**-0.5}

    def draw(name: str) -> torch.Tensor:
        return randn(shapes[name], dtype, device, rng) * scales[name]

    w = {name: draw(name) for name in shapes}

    def mlp() -> tuple[torch.Tensor, torch.Tensor]:
        h = xhal.ops.rms_norm(w["x"], w["norm"], 1e-6)
        act = xhal.ops.silu_and_mul(h @ w["up"])  # [8, inter]
        act.mul_(0.5)  # in place on an intermediate
        return act @ w["down"] + w["x"], act[:, :16]  # a view among the outputs

    with xhal.ops.using(platform.device_type, platform.ops):
        static = runner.capture("mlp", mlp)
        for step in range(3):
            for name, tensor in w.items():  # new values, in place, into every input
                tensor.copy_(draw(name))
            replayed = runner.replay("mlp")
            eager = mlp()
            for i, (r, s, e) in enumerate(zip(replayed, static, eager)):
                assert r.data_ptr() == s.data_ptr(), f"replay output {i} is not the captured tensor"
                if not torch.equal(r, e):
                    err = (r.float() - e.float()).abs().max().item()
                    pytest.fail(f"step {step}, output {i}: replay != eager (max diff {err:.3e})")


def test_replay_refreshes_casts_and_copies_under_inference_mode(platform, device):
    """Captured and replayed under ``torch.inference_mode`` (as a server runs its steps), ops
    whose result may or may not alias their input refresh the new tensors they made: a dtype
    cast (the LM head's float logits), a reshape or ``contiguous`` that had to copy. Views stay
    views of the new input values."""
    runner = runner_or_skip(platform)
    rng = random.Random("casts")
    x = randn((4, 8), torch.bfloat16, device, rng)
    w = randn((16, 8), torch.bfloat16, device, rng)

    def step() -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(x, w).float()  # a cast to a new float32 tensor
        flipped = x.t()  # [8, 4], not contiguous
        return logits, flipped.reshape(-1), flipped.contiguous(), x.reshape(-1)  # copy, copy, view

    with torch.inference_mode():
        static = runner.capture("casts", step)
        for i in range(2):
            x.copy_(randn((4, 8), torch.bfloat16, device, rng))
            replayed, eager = runner.replay("casts"), step()
            for j, (r, s, e) in enumerate(zip(replayed, static, eager)):
                assert r.data_ptr() == s.data_ptr(), f"replay output {j} is not the captured tensor"
                assert torch.equal(r, e), f"replay {i}, output {j}: stale (captured values kept)"


def test_replay_runs_captured_work_not_fn(platform, device):
    """Replay does not call the captured function again; Python values are those of capture."""
    runner = runner_or_skip(platform)
    rng = random.Random("baked")
    x = randn((16,), torch.float32, device, rng)
    state = {"factor": 2.0, "calls": 0}

    def scaled() -> torch.Tensor:
        state["calls"] += 1
        return x * state["factor"]

    runner.capture("scaled", scaled)
    calls, state["factor"] = state["calls"], 3.0
    x.copy_(randn((16,), torch.float32, device, rng))
    out = runner.replay("scaled")
    assert state["calls"] == calls, "replay called the captured function again instead of replaying"
    assert torch.equal(out, x * 2.0), "replay did not use the factor baked at capture on the new x"


def test_piecewise_split_runs_eagerly_between_pieces(platform, device):
    """``split(fn)`` inside a capture: the pieces around it replay as captured (Python values
    baked), while ``fn`` runs again at every replay with the host state of that moment, and the
    piece after it reads its fresh result."""
    runner = runner_or_skip(platform)
    rng = random.Random("split")
    x = randn((16,), torch.float32, device, rng)
    live = {"offset": 1.0}

    def pieces() -> torch.Tensor:
        head = x * 2.0  # piece 1
        middle = runner.split(lambda: head + live["offset"])  # eager, re-run at replay
        return middle * 3.0  # piece 2

    assert torch.equal(runner.split(lambda: x + 1.0), x + 1.0), "split outside a capture is fn()"
    runner.capture("split", pieces)
    for offset in (5.0, -2.0):
        live["offset"] = offset
        x.copy_(randn((16,), torch.float32, device, rng))
        out = runner.replay("split")
        assert torch.allclose(out, (x * 2.0 + offset) * 3.0), (
            "the split function did not run at replay"
        )


def test_runner_keys_and_reset(platform, device):
    runner = runner_or_skip(platform)
    rng = random.Random("keys")
    x = randn((16,), torch.float32, device, rng)
    runner.capture("double", lambda: x * 2)
    runner.capture(("plus", 1), lambda: x + 1)
    assert "double" in runner and ("plus", 1) in runner and "other" not in runner
    x.copy_(randn((16,), torch.float32, device, rng))
    assert torch.equal(runner.replay("double"), x * 2)
    assert torch.equal(runner.replay(("plus", 1)), x + 1)
    with pytest.raises(UNKNOWN_KEY_ERRORS):
        runner.replay("other")
    runner.reset()
    assert "double" not in runner and ("plus", 1) not in runner
    with pytest.raises(UNKNOWN_KEY_ERRORS):
        runner.replay("double")
    runner.capture("double", lambda: x * 3)  # a key is free again after reset
    x.copy_(randn((16,), torch.float32, device, rng))
    assert torch.equal(runner.replay("double"), x * 3)
